"""Progressive validation (`trainer.loop.progressive`): each batch scored, then trained on.

The steps run through each strategy plugin's `run_steps`: in this process
(`one_device`, `mirrored` and `central_storage` on logical CPUs), and in
processes of their own for `multi_worker` (2 workers) and `parameter_server`
(2 workers + 1 ps, asynchronous, with the step whole and with its halves apart).
The whole loop's window on a `parameter_server` cluster is asserted with the
followed runs of tests/test_follow_ps.py.
"""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import configs.default
import strategies
from strategies.base import SplitTrainStep
from tests.helpers import (
    REPO,
    assert_exit,
    cli_in_process,
    config_flags,
    one_line_error,
    run_command,
    spawn,
    tensorboard_scalars,
    tiny_config,
    train_on_cluster,
)
from towerflow.errors import USER_ERROR_EXIT_CODE
from towerflow.processes import pick_ports
from trainer.loop import objectives, progressive, steps, train

GLOBAL_BATCH = 64
FEATURES = 8
# The metrics a window and a plain evaluation both give, compared within 1e-4.
COMPARED = ("loss", "accuracy", "auc")


def _records(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Clicks of `count` examples: 8 features, a label that the first feature mostly decides."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.7 * rng.normal(size=count) > 0).astype(np.int32)
    return x, y


class Job:
    """A small click model under `strategy`, its train and eval steps, and a window of `slots`."""

    def __init__(self, strategy: strategies.Strategy, slots: int, learning_rate: float = 0.0):
        self.strategy = strategy
        with strategy.scope():
            keras.utils.set_random_seed(1)
            self.model = keras.Sequential(
                [
                    keras.Input((FEATURES,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(2),
                ]
            )
            self.optimizer = keras.optimizers.SGD(learning_rate)
            self.optimizer.build(self.model.trainable_variables)
        self.objective = objectives.Classification(2)
        self.inner = steps.TrainStep(self.model, self.optimizer, self.objective, GLOBAL_BATCH)
        self.eval_step = steps.make_eval_step(self.model, self.objective)
        spec = progressive.sums_spec(self.eval_step, _batches(_records(8), 8).element_spec)
        with strategy.scope():
            self.window = progressive.Window(spec, slots)
        self.step = progressive.wrap(self.inner, self.eval_step, self.window)

    def train(self, records: tuple, n: int) -> dict:
        """`n` steps on `records` (every input pipeline reads them all, in order, again and again).

        Returns the block's train metrics.
        """

        def stream(context: tf.distribute.InputContext) -> tf.data.Dataset:
            per_replica = context.get_per_replica_batch_size(GLOBAL_BATCH)
            return _batches(records, per_replica).repeat()

        iterator = iter(self.strategy.distribute_dataset(stream))
        sums, _, _ = self.strategy.report(self.strategy.run_steps(self.step, iterator, n))
        return self.objective.metrics(sums)

    def evaluate(self, records: tuple) -> dict:
        """A plain evaluation of `records`: the objective's metrics, and the examples."""

        def data(context: tf.distribute.InputContext) -> tf.data.Dataset:
            return _batches(records, context.get_per_replica_batch_size(GLOBAL_BATCH))

        sums = self.strategy.evaluate(self.eval_step, data)
        return {**self.objective.metrics(sums), "examples": sums["examples"]}

    def windowed(self) -> dict:
        """The window's metrics, without their prefix."""
        metrics = self.window.metrics(self.objective.metrics)
        return {name.removeprefix(progressive.PREFIX): v for name, v in metrics.items()}


def _batches(records: tuple, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(records).batch(batch, drop_remainder=True)


def _assert_same(windowed: dict, plain: dict) -> None:
    for name in COMPARED:
        assert windowed[name] == pytest.approx(plain[name], abs=1e-4), name


def test_a_window_is_rounded_up_to_whole_global_batches():
    assert progressive.slots_for(500, 64) == 8
    assert progressive.slots_for(512, 64) == 8
    assert progressive.slots_for(1, 64) == 1


@pytest.mark.parametrize("name", ["one_device", "mirrored", "central_storage"])
def test_at_a_learning_rate_of_0_the_window_equals_a_plain_evaluation_of_its_records(name):
    """12 steps of 64 examples, a window of 500 examples: the newest 8 batches, 512 examples."""
    job = Job(strategies.get(name), progressive.slots_for(500, GLOBAL_BATCH))
    x, y = _records(1024)
    job.train((x, y), 12)
    windowed = job.windowed()
    plain = job.evaluate((x[4 * 64 : 12 * 64], y[4 * 64 : 12 * 64]))
    assert windowed["examples"] == plain["examples"] == 512
    _assert_same(windowed, plain)


def test_each_batch_is_scored_before_its_update():
    job = Job(strategies.get("one_device"), slots=1, learning_rate=2.0)
    x, y = _records(64)
    before = job.evaluate((x, y))
    job.train((x, y), 1)
    after = job.evaluate((x, y))
    assert job.windowed()["loss"] == pytest.approx(before["loss"], abs=1e-5)
    assert abs(after["loss"] - before["loss"]) > 1e-2  # the update changed the model


def test_a_window_before_its_slots_fill_covers_the_batches_scored():
    job = Job(strategies.get("one_device"), slots=8)
    x, y = _records(192)
    job.train((x, y), 3)
    windowed = job.windowed()
    assert windowed["examples"] == 192
    _assert_same(windowed, job.evaluate((x, y)))


def test_a_window_restored_from_a_checkpoint_goes_on_with_its_batches(tmp_path):
    job = Job(strategies.get("one_device"), slots=4)
    x, y = _records(1024)
    job.train((x[:256], y[:256]), 2)
    path = tf.train.Checkpoint(window=job.window).save(str(tmp_path / "ckpt"))
    resumed = Job(strategies.get("one_device"), slots=4)
    tf.train.Checkpoint(window=resumed.window).restore(path).assert_consumed()
    resumed.train((x[128:], y[128:]), 2)  # the window: 2 batches from before, 2 after
    windowed = resumed.windowed()
    assert windowed["examples"] == 256
    _assert_same(windowed, resumed.evaluate((x[:256], y[:256])))


def test_a_step_with_halves_keeps_them_and_a_tasks_own_step_has_none():
    job = Job(strategies.get("one_device"), slots=2)
    assert isinstance(job.step, SplitTrainStep)
    assert job.step.iterations is job.optimizer.iterations
    assert job.step.variables == job.inner.variables
    own = steps.CustomTrainStep(lambda *args: {}, job.model, job.optimizer, job.objective, 64)
    wrapped = progressive.wrap(own, job.eval_step, job.window)
    assert not isinstance(wrapped, SplitTrainStep)


def test_the_window_keeps_the_auc_histograms_of_a_plain_evaluation():
    job = Job(strategies.get("one_device"), slots=2)
    spec = progressive.sums_spec(job.eval_step, _batches(_records(8), 8).element_spec)
    assert spec["positives"].shape == (objectives.AUC_BUCKETS,)
    assert {"loss", "weight", "examples", "correct", "negatives"} <= set(spec)


# Bad input: one line each.


def _config(**eval_fields) -> ml_collections.ConfigDict:
    config = configs.default.get_config()
    with config.unlocked():
        config.data.follow = True
        config.eval.progressive = True
        config.eval.window_examples = 100_000
        config.eval.update(eval_fields)
    return config


def test_progressive_validation_on_a_source_that_does_not_follow_files_is_refused():
    config = _config()
    config.data.follow = False
    message = one_line_error("`data.follow` is False", progressive.check, config)
    assert "--config.data.follow=True" in message


@pytest.mark.parametrize("window", [0, -5])
def test_a_window_of_no_examples_is_refused(window):
    message = one_line_error(
        rf"`eval.window_examples` \({window}\) must be at least 1",
        progressive.check,
        _config(window_examples=window),
    )
    assert "--config.eval.window_examples=" in message


def test_a_run_without_progressive_validation_checks_nothing_of_it():
    config = _config(progressive=False, window_examples=0)
    config.data.follow = False
    progressive.check(config)


# Clusters: processes of their own on 127.0.0.1.

# One member's part: the job under the strategy that `TF_CONFIG` and argv name, 16 steps
# of 64 over 512 records that every input pipeline reads again and again (so the 16
# batches hold each record equally often, however the steps fall to workers), a window of
# all 16 batches; then the window, a plain evaluation of the 512 records and the block's
# train metrics as one JSON line. argv: strategy, staleness.
_MEMBER = """
import json, sys
import ml_collections
import strategies
from tests.test_progressive import Job, _records

name, staleness = sys.argv[1:]
options = ml_collections.ConfigDict({"staleness": staleness}) if staleness else None
job = Job(strategies.get(name, options), slots=16)
records = _records(512)
train = job.train(records, 16)
print(json.dumps({"window": job.windowed(), "plain": job.evaluate(records), "train": train}))
"""

# A `tf.distribute.Server` for one member of `TF_CONFIG`'s cluster, serving until killed.
_SERVER = """
import json, os
import tensorflow as tf
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), task["type"], task["index"]).join()
"""


def _tf_config(cluster: dict, role: str, index: int) -> dict[str, str]:
    task = {"cluster": cluster, "task": {"type": role, "index": index}}
    return dict(os.environ, TF_CONFIG=json.dumps(task), TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)


def _cluster(jobs: dict[str, int]) -> dict[str, list[str]]:
    ports = iter(pick_ports(sum(jobs.values())))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}


def _member_output(result: subprocess.CompletedProcess) -> dict:
    assert_exit(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_window_is_a_plain_evaluation(out: dict) -> None:
    assert out["window"]["examples"] == 16 * GLOBAL_BATCH  # every batch of the 16 steps
    _assert_same(out["window"], out["plain"])
    _assert_same(out["window"], out["train"])  # the very batches trained on


@pytest.mark.slow  # the whole loop runs it too (`test_a_cluster_reports_the_window_...`)
def test_two_workers_of_multi_worker_keep_one_window_of_the_global_batches(tmp_path):
    cluster = _cluster({"worker": 2})
    command = [sys.executable, "-c", _MEMBER, "multi_worker", ""]
    other = spawn(
        command,
        env=_tf_config(cluster, "worker", 1),
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0)["TF_CONFIG"])
        result = run_command(command, str(tmp_path), keep_tf_config=True)
    other.wait(timeout=60)
    _assert_window_is_a_plain_evaluation(_member_output(result))


@pytest.mark.slow  # the whole loop runs the step whole on a ps cluster too
@pytest.mark.parametrize("staleness", ["none", "scale"])  # the step whole; its halves apart
def test_asynchronous_parameter_server_workers_write_one_window_on_the_ps(tmp_path, staleness):
    cluster = _cluster({"chief": 1, "worker": 2, "ps": 1})
    for role, index in (("worker", 0), ("worker", 1), ("ps", 0)):
        spawn(
            [sys.executable, "-c", _SERVER],
            env=_tf_config(cluster, role, index),
            cwd=str(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    command = [sys.executable, "-c", _MEMBER, "parameter_server", staleness]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TF_CONFIG", _tf_config(cluster, "chief", 0)["TF_CONFIG"])
        result = run_command(command, str(tmp_path), keep_tf_config=True)
    _assert_window_is_a_plain_evaluation(_member_output(result))


# The whole loop: `train_and_evaluate` following files.


def _followed(tmp_path, **overrides) -> ml_collections.ConfigDict:
    """Two files of 64 clicks (4 steps of 16 each) to follow, scored into a window of 128."""
    data_dir = tmp_path / "data"
    for i in range(2):
        x, y = _records(64, seed=i)
        lines = ["a,b,c,d,label"] + [
            ",".join(f"{v:.4f}" for v in row[:4]) + f",{label}" for row, label in zip(x, y)
        ]
        (data_dir / "train").mkdir(parents=True, exist_ok=True)
        (data_dir / "train" / f"clicks-{i}.csv").write_text("\n".join(lines) + "\n")
    return tiny_config(
        **{
            "strategy.name": "one_device",
            "data.name": "csv",
            "data.train_files": str(data_dir / "train" / "clicks-*.csv"),
            "data.eval_files": str(data_dir / "train" / "clicks-*.csv"),  # the same records
            "data.input_shape": (4,),
            "data.num_classes": 2,
            "data.follow": True,
            "data.follow_poll_secs": 0.2,
            "train.global_batch_size": 16,
            "train.steps": 8,
            "train.steps_per_loop": 4,
            "train.checkpoint_every": 4,
            "optimizer.name": "sgd",
            "optimizer.schedule": "constant",
            "optimizer.warmup_steps": 0,
            # The config refuses a rate of 0: one that moves no weight by 1e-7 in 8 steps.
            "optimizer.learning_rate": 1e-9,
            "eval.progressive": True,
            "eval.window_examples": 128,
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> tuple[pathlib.Path, ml_collections.ConfigDict]:
    """A followed run's first 4 steps: its `model_dir`, to copy and resume, and its config."""
    tmp_path = tmp_path_factory.mktemp("four_steps")
    config = _followed(tmp_path)
    config.train.steps = 4
    train.train_and_evaluate(config, str(tmp_path / "run"), mode="train")
    return tmp_path / "run", config


def _resumable(four_steps: tuple, tmp_path: pathlib.Path) -> ml_collections.ConfigDict:
    """A copy of the `four_steps` run in `tmp_path / "run"`; its config, to resume it."""
    model_dir, config = four_steps
    shutil.copytree(model_dir, tmp_path / "run")
    return config.copy_and_resolve_references()


@dataclasses.dataclass
class Resumed:
    """The `four_steps` run resumed to its end (step 8), then evaluated on the records trained."""

    model_dir: pathlib.Path
    results: dict  # as returned
    on_disk: dict  # results.json
    out: str  # what it printed


@pytest.fixture(scope="module")
def resumed(four_steps, tmp_path_factory) -> Resumed:
    tmp_path = tmp_path_factory.mktemp("resumed")
    config = _resumable(four_steps, tmp_path)
    config.train.steps = 8
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = train.train_and_evaluate(config, str(tmp_path / "run"))
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    return Resumed(tmp_path / "run", results, on_disk, out.getvalue())


def test_a_followed_run_reports_its_window_in_the_progress_line_tensorboard_and_results(resumed):
    evaluated = resumed.results["eval"]  # the very records, evaluated at the end
    windowed = {
        name.removeprefix(progressive.PREFIX): value
        for name, value in resumed.results["train"].items()
        if name.startswith(progressive.PREFIX)
    }
    assert windowed["examples"] == evaluated["examples"] == 128
    _assert_same(windowed, evaluated)
    assert resumed.on_disk["train"]["progressive_auc"] == pytest.approx(windowed["auc"])
    out = resumed.out
    assert "progressive validation: each batch scored before it trains" in out
    last = next(line for line in out.splitlines() if line.startswith("train | step: 8/8"))
    assert f"progressive_auc: {windowed['auc']:.4f}" in last
    assert "progressive_examples: 128" in last and "progressive_examples: 128." not in last
    scalars = tensorboard_scalars(resumed.model_dir, progressive.PREFIX)
    assert scalars["progressive_auc"][8] == pytest.approx(windowed["auc"])


def test_a_resumed_run_goes_on_with_its_window(resumed):
    # 4 batches from the first run, 4 after: a window of 128 examples (the figures of all
    # 8 batches are the evaluation's, above).
    assert resumed.results["train"]["progressive_examples"] == 128


# 2 workers, synchronous (mirrored replicas run the same all-reduce here). Under
# `parameter_server` (2 workers + 1 ps) the followed runs of tests/test_follow_ps.py carry a
# window and assert it: `test_the_cluster_reports_the_window_of_the_batches_it_trained`.
@pytest.mark.parametrize(
    ("strategy", "ps"), [pytest.param("multi_worker", 0, marks=pytest.mark.slow)]
)
def test_a_cluster_reports_the_window_of_the_batches_it_trained(tmp_path, strategy, ps):
    """Through the launcher; at a rate that moves nothing, the run's evaluation of the same
    records at its end is the window's figures."""
    config = _followed(tmp_path)
    fields = (
        "data.name",
        "data.train_files",
        "data.eval_files",
        "data.num_classes",
        "data.follow",
        "data.follow_poll_secs",
        "train.global_batch_size",
        "train.steps",
        "train.steps_per_loop",
        "optimizer.name",
        "optimizer.schedule",
        "optimizer.warmup_steps",
        "optimizer.learning_rate",
        "model.hidden_units",
        "eval.progressive",
        "eval.window_examples",
    )
    results = train_on_cluster(
        tmp_path,
        f"--strategy={strategy}",
        "--config.data.input_shape=(4,)",
        "--config.train.export=False",
        *config_flags(config, fields),
        workers=2,
        ps=ps,
    )
    windowed = {
        name.removeprefix(progressive.PREFIX): value
        for name, value in results["train"].items()
        if name.startswith(progressive.PREFIX)
    }
    assert windowed["examples"] == results["eval"]["examples"] == 128
    _assert_same(windowed, results["eval"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"data.follow": False}, "`data.follow` is False"),
        ({"eval.window_examples": 0}, r"`eval.window_examples` \(0\) must be at least 1"),
    ],
)
def test_bad_progressive_input_stops_the_run_before_model_dir_is_written(
    tmp_path, overrides, match
):
    config = _followed(tmp_path, **overrides)
    one_line_error(match, train.train_and_evaluate, config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_run_resumed_with_another_window_is_refused_before_it_writes(four_steps, tmp_path):
    config = _resumable(four_steps, tmp_path)
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    config.train.steps, config.eval.window_examples = 8, 64
    message = one_line_error(
        r"`eval.window_examples` \(64\) makes a window of 4 global batches of 16",
        train.train_and_evaluate,
        config,
        str(tmp_path / "run"),
    )
    assert "--config.eval.window_examples=128" in message
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_a_run_resumed_with_progressive_validation_newly_on_starts_its_window_and_says_so(
    tmp_path, capsys
):
    config = _followed(tmp_path, **{"eval.progressive": False})
    config.train.steps = 4
    train.train_and_evaluate(config, str(tmp_path / "run"), mode="train")
    config.train.steps, config.eval.progressive = 8, True
    resumed = train.train_and_evaluate(config, str(tmp_path / "run"), mode="train")["train"]
    assert resumed["progressive_examples"] == 64  # the 4 batches scored since
    assert "were written without `eval.progressive`: the window starts empty" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--config.eval.progressive=true"], "`data.follow` is False"),
        (
            [
                "--config.eval.progressive=true",
                "--config.data.follow=true",
                "--config.eval.window_examples=-1",
            ],
            "`eval.window_examples` (-1) must be at least 1",
        ),
    ],
)
def test_the_command_refuses_bad_progressive_input_in_one_line_with_exit_2(
    tmp_path, capsys, flags, field
):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    code, _, err = cli_in_process(f"--model_dir={tmp_path / 'run'}", *flags, capsys=capsys)
    assert code == USER_ERROR_EXIT_CODE, err
    assert field in err
    assert not (tmp_path / "run").exists()
