"""Input on the tf.data service (`data.service`): the same training, its servers, its failures.

One dispatcher and one data worker, started once for this module with
`python -m trainer.data_service`, serve the in-process runs, which must train
to the weights of in-process input for every kind of source under `one_device`
and `mirrored`, and resume exactly. `local:N` (servers started by the trainer)
runs through the command line; so do the failures: a killed data worker or
dispatcher ends the run with one line and exit 144, never a hang; bad
addresses and counts are one line, bounded, with `model_dir` untouched.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    REPO,
    _env,
    checkpoint_values,
    spawn,
    tiny_config,
)
from trainer import launch, train
from trainer.data import service

STEPS = 10
USER_EXAMPLES = 96


def pipeline(input_context, split, global_batch_size):
    """A user's `dataset_fn`: seeded, sharded by the input context."""
    x = tf.random.stateless_normal([USER_EXAMPLES, 6], seed=[1, 2])
    y = tf.cast(x[:, 0] + x[:, 1] > 0, tf.int32)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    if split == "train":
        examples = examples.shuffle(USER_EXAMPLES, seed=3)
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    return examples.batch(batch, drop_remainder=split == "train")


def _write_csv(directory) -> dict:
    rng = np.random.RandomState(0)
    for name, rows in (("train", 80), ("eval", 24)):
        x = rng.normal(size=(rows, 4))
        table = np.column_stack([x, (x[:, 0] > 0).astype(int)])
        np.savetxt(
            directory / f"{name}.csv",
            table,
            delimiter=",",
            fmt="%.6g",
            header="a,b,c,d,label",
            comments="",
        )
    return {
        "data.name": "csv",
        "data.train_files": str(directory / "train.csv"),
        "data.eval_files": str(directory / "eval.csv"),
        "data.input_shape": (4,),
        "data.num_classes": 2,
    }


SOURCES = {
    "digits": lambda directory: {},
    "csv": _write_csv,
    "user": lambda directory: {"data.name": f"{__name__}:pipeline", "data.num_classes": 2},
    "task": lambda directory: {"task.name": "tests.user_tasks:DictTask"},
}


@pytest.fixture(scope="module")
def dispatcher():
    """A dispatcher and one data worker, as a user runs them: `python -m trainer.data_service`."""
    ports = launch.pick_ports(2)
    module = [sys.executable, "-m", "trainer.data_service"]
    spawn([*module, "--role=dispatcher", f"--port={ports[0]}"], env=_env(), cwd=REPO)
    spawn(
        [*module, "--role=worker", f"--port={ports[1]}", f"--dispatcher=127.0.0.1:{ports[0]}"],
        env=_env(),
        cwd=REPO,
    )
    address = f"grpc://127.0.0.1:{ports[0]}"
    assert service.wait_until_served(address, None, timeout_s=120) == 1
    return address


def _run(model_dir, fields: dict, steps: int = STEPS) -> dict:
    config = tiny_config(**{"train.steps": steps, "train.global_batch_size": 16, **fields})
    return train.train_and_evaluate(config, str(model_dir), mode="train")


def _assert_same_weights(a, b) -> None:
    first, second = checkpoint_values(a), checkpoint_values(b)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_allclose(second[name], first[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize(
    "source, strategy",
    [(s, "one_device") for s in SOURCES] + [("digits", "mirrored"), ("user", "mirrored")],
)
def test_each_source_trains_as_in_process_input(tmp_path, dispatcher, source, strategy):
    fields = {"strategy.name": strategy, **SOURCES[source](tmp_path)}
    _run(tmp_path / "in_process", fields)
    results = _run(tmp_path / "service", {**fields, "data.service": dispatcher})
    _assert_same_weights(tmp_path / "in_process", tmp_path / "service")
    assert results["input"]["address"] == dispatcher
    assert results["input"]["processing_mode"] == "parallel_epochs"


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, dispatcher):
    fields = {"strategy.name": "one_device", "data.service": dispatcher}
    _run(tmp_path / "straight", fields, steps=2 * STEPS)
    _run(tmp_path / "resumed", fields, steps=STEPS)
    _run(tmp_path / "resumed", fields, steps=2 * STEPS)
    _assert_same_weights(tmp_path / "straight", tmp_path / "resumed")


def test_dynamic_sharding_sends_every_batch_once(dispatcher):
    config = tiny_config(**{"data.service": dispatcher, "data.service_sharding": "dynamic"})
    with service.started(config.data, True, print) as running:
        dataset = service.wrap(_digits(config), running, "run")
        context = tf.distribute.InputContext(2, 1, 2)  # one of two trainers' pipelines
        whole = tf.distribute.InputContext(1, 0, 2)  # the one stream, for 2 replicas
        fresh = list(_digits(config).train_fn(16, seed=0)(whole).take(6))
        served = list(dataset.train_fn(16, seed=0)(context).take(6))
    for (x, y), (want_x, want_y) in zip(served, fresh, strict=True):
        np.testing.assert_array_equal(y, want_y)  # one worker: the one stream, in order
        np.testing.assert_allclose(x, want_x)


def _digits(config):
    from trainer import data

    return data.get(config.data)
