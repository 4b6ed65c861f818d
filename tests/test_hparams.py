"""Every run's hyper-parameters and final metrics, read back through TensorBoard's HParams backend.

What TensorBoard's dashboard shows is what its hparams plugin computes from
the event files; these tests ask the plugin itself (`backend_context` and
`list_session_groups` over an `EventMultiplexer`), not the files.
"""

from __future__ import annotations

import os

import pytest
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.context import RequestContext
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

from tests.helpers import tiny_config
from trainer.loop import train
from trainer.loop.summaries import flat_hparams


def dashboard(logdir: str) -> tuple[api_pb2.Experiment, dict[str, dict]]:
    """What TensorBoard's HParams dashboard shows for `logdir`.

    Returns:
      The experiment (its hyper-parameter and metric infos) and, per session
      (run directory relative to `logdir`), `{"hparams": {name: value},
      "metrics": {"group/tag": final value}}`.
    """
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, logdir)
    context = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=logdir))
    ctx = RequestContext()
    experiment = context.experiment_from_metadata(
        ctx,
        "",
        True,
        context.hparams_metadata(ctx, ""),
        context.hparams_from_data_provider(ctx, "", limit=None),
    )
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0,
        slice_size=100,
        include_metrics=True,
        allowed_statuses=api_pb2.Status.values(),  # as the dashboard asks: every status
    )
    for info in experiment.hparam_infos:
        request.col_params.add(hparam=info.name)
    for info in experiment.metric_infos:
        request.col_params.add(metric=info.name)
    groups = list_session_groups.Handler(ctx, context, "", request).run().session_groups
    sessions = {}
    for group in groups:
        for session in group.sessions:
            sessions[session.name] = {
                "hparams": {
                    name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
                    for name, value in group.hparams.items()
                },
                "metrics": {f"{m.name.group}/{m.name.tag}": m.value for m in session.metric_values},
            }
    return experiment, sessions


def test_flat_hparams_keep_scalars_and_write_tuples_as_typed():
    config = tiny_config(**{"model.hidden_units": (8, 4)})
    flat = flat_hparams(config)
    assert flat["model.hidden_units"] == "(8, 4)"
    assert flat["optimizer.learning_rate"] == 1e-3
    assert flat["train.export"] is False
    assert flat["strategy.name"] == "mirrored"
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())


def test_two_runs_show_their_hparams_and_final_metrics_in_the_dashboard(tmp_path):
    results = {}
    for name, rate in (("slow", 1e-3), ("fast", 3e-2)):
        config = tiny_config(**{"optimizer.learning_rate": rate, "strategy.name": "one_device"})
        results[name] = train.train_and_evaluate(config, str(tmp_path / name))
    experiment, sessions = dashboard(str(tmp_path))

    assert set(sessions) == {"slow", "fast"}
    for name, rate in (("slow", 1e-3), ("fast", 3e-2)):
        hparams, metrics = sessions[name]["hparams"], sessions[name]["metrics"]
        assert hparams["optimizer.learning_rate"] == rate
        assert hparams["model.hidden_units"] == "(32,)"
        assert hparams["strategy.name"] == "one_device"
        # The final eval metrics, as the run's results.json holds them.
        assert metrics["eval/accuracy"] == pytest.approx(results[name]["eval"]["accuracy"])
        assert metrics["train/loss"] == pytest.approx(results[name]["train"]["loss"])
    infos = {info.name: info for info in experiment.hparam_infos}
    assert len(infos) == len(flat_hparams(tiny_config()))  # the whole config
    assert infos["optimizer.learning_rate"].differs
    assert not infos["model.hidden_units"].differs
    metric_names = {f"{m.name.group}/{m.name.tag}" for m in experiment.metric_infos}
    assert {"eval/accuracy", "eval/loss", "train/loss"} <= metric_names
    assert os.path.exists(tmp_path / "slow" / "results.json")
