"""`data.follow` under asynchronous `parameter_server`: followed files handed out in units.

Two runs of one cluster (2 workers + 1 ps), a module fixture, are read by the
tests of what they trained; they score progressive validation's window too.
"""

import dataclasses
import json
import signal

import pytest
import tensorflow as tf

import strategies
from strategies.parameter_server import units as ps_units
from tests.helpers import config_flags, launch_and_signal, launched, one_line_error
from tests.test_follow import _CLUSTER_FIELDS, _config, _done, _state, _write_csv
from tests.test_progressive import _assert_same
from trainer import data
from trainer.data import follow
from trainer.data.follow_units import FollowedUnits
from trainer.loop import actions, progressive
from trainer.loop.controller import Output
from trainer.loop.features.follow import Follow

CLUSTER_TIMEOUT_S = 300
ROWS = 40  # per file: 3 steps of 16 (16, 16 and a short one of 8)


def _flags(tmp_path, steps: int, checkpoint_every: int = 3, **fields) -> list[str]:
    fields = {"train.steps": steps, "train.checkpoint_every": checkpoint_every, **fields}
    config = _config(tmp_path / "data", **fields)
    return [
        "--",
        "--strategy=parameter_server",
        f"--model_dir={tmp_path / 'run'}",
        *config_flags(config, tuple(dict.fromkeys((*_CLUSTER_FIELDS, *fields)))),
    ]


def _results(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "results.json").read_text())


# Progressive validation (docs/progressive.md) rides along in the runs below: every batch
# scored before it trains, into a window of 9 global batches (all of the first run's 9
# steps), at a rate that moves no weight, and the runs evaluate the very files they train
# on at their end: so the first run's window is its end's evaluation.
PROGRESSIVE = {
    "eval.progressive": True,
    "eval.window_examples": 9 * 16,
    "optimizer.name": "sgd",
    "optimizer.schedule": "constant",
    "optimizer.warmup_steps": 0,
    "optimizer.learning_rate": 1e-9,  # the config refuses 0
}


@dataclasses.dataclass
class Run:
    """A run of the cluster: what it printed, the files done at its end, its results.json."""

    stdout: str
    done: tuple[list[str], dict]
    results: dict


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Run, Run]:
    """2 workers + 1 ps over files landing as c, a, b; then 0.csv lands behind b, and again."""
    tmp_path = tmp_path_factory.mktemp("follow_ps")
    data = tmp_path / "data"
    _write_csv(data / "eval.csv", 99)
    for order, name in enumerate(["c", "a", "b"]):  # landing in no name order
        _write_csv(data / "train" / f"{name}.csv", order, ROWS, order=order)
    fields = {**PROGRESSIVE, "data.eval_files": str(data / "train" / "*")}

    def run(steps: int, mode: str) -> Run:
        flags = [*_flags(tmp_path, steps, **fields), f"--mode={mode}"]
        result = launched("--workers=2", "--ps=1", *flags, cwd=str(tmp_path))
        return Run(result.stdout, _done(tmp_path / "run"), _results(tmp_path))

    first = run(9, "train_and_eval")  # its evaluation: the window's figures
    _write_csv(data / "train" / "0.csv", 7, ROWS, order=1)  # landing behind b.csv
    return first, run(12, "train")


def test_two_workers_and_a_ps_train_each_file_once_whatever_order_they_land_in(two_runs):
    first, _ = two_runs
    assert "[chief] train | step: 9/9" in first.stdout, first.stdout[-3000:]
    assert first.done == (["a.csv", "b.csv", "c.csv"], {})
    assert first.results["follow"] == {"records_repeated": 0}
    assert "records_repeated: 0" in first.stdout


def test_a_file_landing_behind_the_newest_is_said_late_and_trained_once_by_the_next_run(two_runs):
    _, again = two_runs  # it resumes from the checkpoint without training a file again
    assert "late file" in again.stdout and "0.csv" in again.stdout, again.stdout[-3000:]
    assert "[chief] train | step: 12/12" in again.stdout
    assert again.done == (["0.csv", "a.csv", "b.csv", "c.csv"], {})
    assert again.results["follow"] == {"records_repeated": 0}


def test_the_cluster_reports_the_window_of_the_batches_it_trained(two_runs):
    """Asynchronous workers score into one window on the ps: its figures are the run's
    evaluation of the same records at its end (a unit's short steps count what they hold)."""
    first, _ = two_runs
    windowed = {
        name.removeprefix(progressive.PREFIX): value
        for name, value in first.results["train"].items()
        if name.startswith(progressive.PREFIX)
    }
    assert windowed["examples"] == first.results["eval"]["examples"] == 3 * ROWS
    _assert_same(windowed, first.results["eval"])


@pytest.mark.slow  # a kill and a restart
def test_a_worker_killed_mid_unit_repeats_at_most_its_unit_and_loses_no_record(tmp_path):
    data = tmp_path / "data"
    _write_csv(data / "eval.csv", 99)
    for order in range(6):
        _write_csv(data / "train" / f"f{order}.csv", order, 160, order=order)  # 10 steps each
    code, lines, _ = launch_and_signal(
        "--workers=2",
        "--ps=1",
        *_flags(tmp_path, 60),
        cwd=tmp_path,
        trigger="[chief] train | step:",
        member=("worker", 1),
        sig=signal.SIGKILL,
        timeout=CLUSTER_TIMEOUT_S,
    )
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert "worker:1 was killed by SIGKILL; restarting it" in output
    assert _done(tmp_path / "run") == ([f"f{order}.csv" for order in range(6)], {})
    results = _results(tmp_path)
    repeated = results["follow"]["records_repeated"]
    assert 0 <= repeated <= 2 * 16, "at most one unit (a block of 4 steps over 2 workers)"
    # The 60 steps of the six files, and each step applied twice on top: 16 records each.
    assert repeated == 16 * (results["step"] - 60), output[-3000:]


@pytest.mark.slow  # a kill, then the cluster started again
@pytest.mark.parametrize("member", [("chief", 0), ("ps", 0)])
def test_a_chief_or_ps_lost_mid_stream_resumes_from_its_checkpoint_losing_no_record(
    tmp_path, member
):
    data = tmp_path / "data"
    _write_csv(data / "eval.csv", 99)
    for order in range(6):
        _write_csv(data / "train" / f"f{order}.csv", order, 160, order=order)  # 10 steps each
    flags = _flags(tmp_path, 60, checkpoint_every=5)
    # Step 12 ends a block (blocks of 4, checkpoints every 5): the checkpoint of step 10 is
    # saved, and the kill lands in the units after it, which no checkpoint holds as done.
    code, lines, _ = launch_and_signal(
        "--workers=2",
        "--ps=1",
        *flags,
        cwd=tmp_path,
        trigger="[chief] train | step: 12/60",
        member=member,
        sig=signal.SIGKILL,
        timeout=CLUSTER_TIMEOUT_S,
    )
    output = "\n".join(line for _, line in lines)
    assert code != 0, output[-3000:]
    stopped_at = _state(tmp_path / "run")
    assert stopped_at["partial"] or len(stopped_at["done"]) < 6, "killed before the end"

    again = launched("--workers=2", "--ps=1", *flags, cwd=str(tmp_path), timeout=CLUSTER_TIMEOUT_S)
    assert "[chief] train | step: 60/60" in again.stdout, again.stdout[-3000:]
    # Every record of every file trained: the six files done, none left in part.
    assert _done(tmp_path / "run") == ([f"f{order}.csv" for order in range(6)], {})
    results = _results(tmp_path)
    # The restart rolled the variables back to the checkpoint: the steps the lost cluster
    # trained after it are undone, so the 60 steps of the 960 records trained each once.
    assert results["step"] == 60
    assert results["follow"] == {"records_repeated": 0}


def test_follow_under_workers_that_neither_keep_order_nor_take_units_is_one_line(tmp_path):
    _write_csv(tmp_path / "eval.csv", 99)
    _write_csv(tmp_path / "train" / "clicks-1.csv", 1)
    config = _config(tmp_path, **{"strategy.name": "parameter_server"})
    unordered = strategies.Traits(ordered_input=False, takes_units=False)
    one_line_error("without taking input in units", Follow().check, config, unordered)
    takes_units = strategies.Traits(ordered_input=False, takes_units=True)
    Follow().check(config, takes_units)  # asynchronous parameter_server: accepted


def test_examples_per_sec_under_units_counts_the_records_trained_a_short_step_what_it_holds(
    tmp_path,
):
    _write_csv(tmp_path / "eval.csv", 99)
    _write_csv(tmp_path / "train" / "a.csv", 1, ROWS)
    dataset = data.get(_config(tmp_path, **{"strategy.name": "parameter_server"}).data)
    follower = follow.follower_of(dataset)
    follower.start()
    units = FollowedUnits(follower, dataset.decode, 16)
    follow_action, _ = actions.follow(units, 16, 4, lambda: None)
    steps = units.steps_ready(4, 16)
    units.finished(units.take(steps, 1))  # as the plugin says when the block's units trained
    output = Output(step=steps, total_steps=100, steps=steps, seconds=2.0, metrics={})
    follow_action.fn(output)
    actions.rates(16, lambda: 0.1).fn(output)  # the loop's rates, after the follow action
    follower.close()
    # One file of 40 records: 3 steps of 16, the last a short one of 8 (not 3 x 16 = 48).
    assert output.metrics["steps_per_sec"] == 1.5
    assert output.metrics["examples_per_sec"] == ROWS / 2.0
    assert "examples_trained" not in output.metrics  # the rate's input, not a metric


def test_a_units_step_takes_its_rows_of_each_feature_dense_ragged_or_sparse():
    records = {
        "dense": tf.reshape(tf.range(20), [10, 2]),
        "ragged": tf.ragged.range(tf.range(10)),
        "sparse": tf.sparse.from_dense(tf.reshape(tf.range(20), [10, 2])),
    }
    # Rows 8 and 9 of 10: the unit's short last step of a batch of 4.
    rows = ps_units._rows(records, tf.constant(8, tf.int64), tf.constant(4, tf.int64))
    assert rows["dense"].numpy().tolist() == [[16, 17], [18, 19]]
    assert rows["ragged"].to_list() == [list(range(8)), list(range(9))]
    assert tf.sparse.to_dense(rows["sparse"]).numpy().tolist() == [[16, 17], [18, 19]]
