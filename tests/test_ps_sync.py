"""Spare replicas and staleness under `parameter_server`: workers + 1 ps on 127.0.0.1.

Cluster runs, each shared by the tests that read it (module fixtures): one
synchronous step with k = n = 2 (2 workers) on known per-worker batches; in the
slow tier, on 3 workers, a k = 2 run with a straggling worker that is killed
mid-run and an asynchronous one. The option checks run in this process.
"""

import contextlib
import json
import signal

import numpy as np
import pytest
import tensorflow as tf

import configs.default
import strategies
from strategies.base import Traits
from strategies.cluster import tf_config as cluster
from strategies.parameter_server import staleness as ps_staleness
from strategies.parameter_server import sync as ps_sync
from tests.helpers import cli_in_process, launch_and_signal, launched, one_line_error, tiny_config
from towerflow.errors import UserError
from trainer.bench import straggling
from trainer.loop import train

CLUSTER_TIMEOUT_S = 300
BATCH = 16  # examples per worker and step
WORKERS = 3
EVERY = 2  # the workers of the k = n step
TINY = [  # the tiny model of `tiny_config`, trained by plain SGD at a constant rate
    "--config.model.hidden_units=(32,)",
    "--config.model.dropout=0.0",
    "--config.optimizer.name=sgd",
    "--config.optimizer.schedule=constant",
    "--config.optimizer.warmup_steps=0",
    "--config.optimizer.learning_rate=0.1",
    "--config.train.export=False",
    "--config.eval.every=0",
]


# Worker 2 reads the digits late (`trainer.bench.straggling`).
STRAGGLING = [f"--config.{field}={value}" for field, value in straggling.CONFIG.items()]


@contextlib.contextmanager
def straggler(spec: str):
    """`TOWERFLOW_STRAGGLER=spec` for the clusters started inside (they inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(straggling.VARIABLE, spec)
        yield


def worker_batches(input_context, split, global_batch_size):
    """Worker i sees one fixed batch of its own, again and again; one pipeline sees them all.

    So k = n workers' averaged gradient is the gradient of their batches together.
    """
    del split
    parts = []
    for worker in range(EVERY):
        rng = np.random.default_rng(worker)
        x = rng.normal(size=(BATCH, 64)).astype(np.float32)
        parts.append((x, rng.integers(0, 10, size=BATCH)))
    if input_context.num_input_pipelines == 1:
        x, y = (np.concatenate(column) for column in zip(*parts))
    else:
        x, y = parts[input_context.input_pipeline_id]
    return tf.data.Dataset.from_tensors((x, y))


def _launch(tmp_path_factory, name: str, *flags: str, workers: int = WORKERS) -> tuple:
    """Trains on `workers` + 1 ps in a fresh directory; returns model_dir and results.json."""
    tmp_path = tmp_path_factory.mktemp(name)
    model_dir = tmp_path / "run"
    launched(
        f"--workers={workers}",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        *TINY,
        *flags,
        cwd=str(tmp_path),
        timeout=CLUSTER_TIMEOUT_S,
    )
    return model_dir, json.loads((model_dir / "results.json").read_text())


def _events(model_dir, tag: str) -> dict[int, np.ndarray]:
    """The train run's TensorBoard tensor `tag` (a scalar, or a histogram's rows), by step."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(
        str(model_dir / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    return {e.step: tf.make_ndarray(e.tensor_proto) for e in events.Tensors(tag)}


def _scalars(model_dir, tag: str) -> dict[int, float]:
    return {step: float(value) for step, value in _events(model_dir, tag).items()}


# k = n: one update, the average of every worker's gradient.

DATA = [
    "--config.data.name=tests.test_ps_sync:worker_batches",
    "--config.data.num_classes=10",
    "--config.data.input_shape=(64,)",
]


@pytest.fixture(scope="module")
def every_worker(tmp_path_factory):
    return _launch(
        tmp_path_factory,
        "sync",
        "--mode=train",  # the step's update is what is asserted
        *DATA,
        f"--config.strategy.parameter_server.sync_replicas={EVERY}",
        "--config.train.steps=1",
        f"--config.train.global_batch_size={BATCH}",
        workers=EVERY,
    )


def test_k_equal_n_applies_the_average_of_every_workers_gradient(every_worker, tmp_path):
    model_dir, results = every_worker
    assert results["placement"]["sync_replicas"] == EVERY
    assert results["train"]["replicas_averaged"] == EVERY
    assert results["train"]["most_pushes_by_one_worker"] == 1  # so each worker once
    # The same step on one device, on the workers' batches together.
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "data.name": "tests.test_ps_sync:worker_batches",
            "data.input_shape": (64,),
            "optimizer.name": "sgd",
            "optimizer.schedule": "constant",
            "optimizer.warmup_steps": 0,
            "optimizer.learning_rate": 0.1,
            "train.steps": 1,
            "train.global_batch_size": EVERY * BATCH,
        }
    )
    train.train_and_evaluate(config, str(tmp_path / "one"), mode="train")
    cluster_init = _values(model_dir, "ckpt-0")
    one_init = _values(tmp_path / "one", "ckpt-0")
    assert cluster_init.keys() == one_init.keys()
    for key in one_init:
        np.testing.assert_array_equal(cluster_init[key], one_init[key], err_msg=key)
    cluster_after, one_after = _values(model_dir, "ckpt-1"), _values(tmp_path / "one", "ckpt-1")
    moved = 0
    for key in one_after:
        np.testing.assert_allclose(
            cluster_after[key], one_after[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
        moved += not np.array_equal(one_after[key], one_init[key])
    assert moved >= 4, "the step moved every kernel and bias"


def _values(model_dir, checkpoint: str) -> dict:
    """The model's variables in `model_dir`'s checkpoint `checkpoint`, by key."""
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / checkpoint))
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith("variables/")]
    return {n: reader.get_tensor(n) for n in names}


# k = 2 of 3 with a straggler, which is killed mid-run.

STEPS = 160


@pytest.fixture(scope="module")
def spare(tmp_path_factory):
    """k = 2 with worker 2 sleeping 0.1 s a batch; SIGKILLed at step 40, restarted."""
    tmp_path = tmp_path_factory.mktemp("sync2")
    model_dir = tmp_path / "run"
    with straggler("2:0.1"):
        code, lines, killed_at = _spare_run(tmp_path, model_dir)
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-4000:]
    return model_dir, lines, killed_at


def _spare_run(tmp_path, model_dir):
    return launch_and_signal(
        f"--workers={WORKERS}",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        *TINY,
        "--config.strategy.parameter_server.sync_replicas=2",
        *STRAGGLING,
        f"--config.train.steps={STEPS}",
        "--config.train.steps_per_loop=20",
        "--config.train.checkpoint_every=0",
        cwd=tmp_path,
        trigger="[chief] train | step: 40/",
        member=("worker", 2),
        sig=signal.SIGKILL,
        timeout=CLUSTER_TIMEOUT_S,
    )


@pytest.mark.slow  # a 4-member cluster with a spare
def test_no_gradient_is_applied_twice_or_at_another_step(spare):
    model_dir, _, _ = spare
    blocks = _scalars(model_dir, "wrong_step_pushes")
    assert sorted(blocks) == list(range(20, STEPS + 1, 20)), "one record per block"
    assert set(blocks.values()) == {0.0}, "every push applied was computed at its step"
    assert set(_scalars(model_dir, "most_pushes_by_one_worker").values()) == {1.0}
    assert min(_scalars(model_dir, "min_replicas_averaged").values()) >= 2
    averaged = _scalars(model_dir, "replicas_averaged").values()
    assert all(2 <= a <= 3 for a in averaged)
    assert sum(_scalars(model_dir, "late_dropped").values()) > 0, "the straggler's were dropped"


@pytest.mark.slow  # a 4-member cluster with a spare
def test_a_killed_worker_does_not_stop_training_with_a_spare(spare):
    model_dir, lines, killed_at = spare
    restarted = next(
        (t for t, line in lines if t > killed_at and "[worker:2] serving as" in line), None
    )
    after_kill = [
        line
        for t, line in lines
        if t > killed_at and (restarted is None or t < restarted) and "[chief] train |" in line
    ]
    assert after_kill, "steps went on while worker 2 was down"
    output = "\n".join(line for _, line in lines)
    assert "worker:2 was killed by SIGKILL" in output
    results = json.loads((model_dir / "results.json").read_text())
    assert results["step"] == STEPS
    assert results["eval"]["accuracy"] >= 0.8


# Asynchronous, with a straggler: staleness recorded, the stalest updates dropped.

WARMUP = 20


@pytest.fixture(scope="module")
def asynchronous(tmp_path_factory):
    with straggler("2:0.05"):
        return _launch(
            tmp_path_factory,
            "async",
            "--config.strategy.parameter_server.staleness=drop_above=1",
            f"--config.strategy.parameter_server.warmup_steps={WARMUP}",
            *STRAGGLING,
            "--config.train.steps=120",
            f"--config.train.steps_per_loop={WARMUP}",
            "--config.train.checkpoint_every=0",
        )


def _histograms(model_dir, tag: str) -> dict[int, np.ndarray]:
    """The counts of the train run's histogram `tag` (one bucket per value), by step."""
    return {step: rows[:, 2] for step, rows in _events(model_dir, tag).items()}


@pytest.mark.slow  # a cluster with a straggler
def test_async_staleness_is_recorded_and_the_stalest_updates_dropped(asynchronous):
    model_dir, results = asynchronous
    assert results["step"] == 120, "dropped updates are not steps: the job ran until 120"
    assert results["placement"]["staleness"] == "drop_above=1"
    histograms = _histograms(model_dir, "staleness")
    first, *later = sorted(histograms)
    # The warm-up block ran on one worker alone: nothing was stale, nothing dropped.
    assert first == WARMUP and histograms[first][0] == WARMUP and histograms[first].sum() == WARMUP
    stale = sum(histograms[step][2:].sum() for step in later)
    dropped = sum(_scalars(model_dir, "stale_dropped").values())
    assert dropped == stale > 0, "every update staler than 1, and only those, was dropped"
    assert set(_scalars(model_dir, "staleness_mean")) == set(histograms)


# Options, in this process.

PS_CLUSTER = {
    "chief": ["127.0.0.1:1"],
    "worker": ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"],
    "ps": ["127.0.0.1:5"],
}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sync_replicas": 4}, r"`strategy.parameter_server.sync_replicas` \(4\) must be between"),
        ({"sync_replicas": -1}, r"`strategy.parameter_server.sync_replicas` \(-1\) must be"),
        ({"sync_replicas": 2, "staleness": "scale"}, r"is synchronous: .* `staleness=none`"),
        ({"sync_replicas": 3, "warmup_steps": 10}, r"is synchronous: .*`warmup_steps=0`"),
        ({"staleness": "drop_above"}, r"Unknown `strategy.parameter_server.staleness` 'drop_above"),
        ({"staleness": "halve"}, r"known: none, scale, drop_above=N"),
        ({"warmup_steps": -5}, r"`strategy.parameter_server.warmup_steps` \(-5\) must be >= 0"),
    ],
)
def test_impossible_update_options_are_one_line(monkeypatch, options, message):
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, "evaluator", 0))
    config = configs.default.get_config().strategy.parameter_server
    config.update(options)
    with pytest.raises(UserError, match=message) as caught:
        strategies.get("parameter_server", config)
    assert "\n" not in str(caught.value)


def test_the_defaults_are_asynchronous_and_say_so(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, "evaluator", 0))
    plugin = strategies.get(
        "parameter_server", configs.default.get_config().strategy.parameter_server
    )
    assert (plugin.sync_replicas, plugin.staleness.mode, plugin.warmup_steps) == (0, "none", 0)
    assert not plugin.traits.splits_steps
    assert "asynchronously" in plugin.describe()["communication"]


@pytest.mark.parametrize(
    "options, mode, splits, says",
    [
        ({"sync_replicas": 2}, ps_sync.SyncUpdates, True, "averages the first 2"),
        ({"staleness": "scale"}, ps_staleness.AsyncUpdates, True, "divided by 1 + staleness"),
        ({"warmup_steps": 3}, ps_staleness.AsyncUpdates, False, "first 3 steps on one worker"),
    ],
)
def test_the_update_mode_is_chosen_once_from_the_options(monkeypatch, options, mode, splits, says):
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, "evaluator", 0))
    config = configs.default.get_config().strategy.parameter_server
    config.update(options)
    plugin = strategies.get("parameter_server", config)
    assert type(plugin.updates) is mode
    assert plugin.traits.splits_steps is splits and says in plugin.describe()["communication"]


def test_a_bad_option_on_the_command_line_exits_2_and_writes_nothing(monkeypatch, tmp_path, capsys):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, "chief", 0))
    code, _, err = cli_in_process(
        "--strategy=parameter_server",
        f"--model_dir={tmp_path / 'run'}",
        "--config.strategy.parameter_server.sync_replicas=5",
        capsys=capsys,
    )
    assert code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sync_replicas` (5)" in errors[0], err[-2000:]
    assert "use 2 for one spare worker" in errors[0]
    assert not (tmp_path / "run").exists()


def test_a_tasks_own_train_step_under_a_plugin_that_splits_steps_is_one_line(tmp_path):
    """Sync `parameter_server` runs a step's halves apart; a task's own step has none."""

    class Splitting(strategies.plugin("one_device")):  # as `sync_replicas` > 0 reports
        traits = Traits(splits_steps=True)

    config = tiny_config(**{"task.name": "examples.custom_step:ConsistencyTask"})
    strategy = Splitting(config.strategy.one_device)
    message = one_line_error("train_step", train.build, config, str(tmp_path / "run"), strategy)
    assert "runs a step's gradients and its update apart" in message
    assert not (tmp_path / "run").exists()
