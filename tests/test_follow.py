"""`data.follow`: files that keep arriving train once each, in arrival order, across restarts."""

import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    REPO,
    assert_exit,
    checkpoint_values,
    config_flags,
    launched,
    one_line_error,
    run_cli,
    tiny_config,
)
from tests.test_faults import signal_at
from towerflow.errors import PREEMPTED_EXIT_CODE
from trainer import data
from trainer.data import counting, follow
from trainer.loop import actions, train
from trainer.loop.controller import Output

ROWS = 64  # per file: one block of 4 steps of 16
T0 = 1_796_000_000  # a modification time (s): the files' arrival order is set, not raced


def _land(path, order: int) -> None:
    """Sets `path`'s modification time to `T0 + order` seconds: its place in arrival order."""
    os.utime(path, (T0 + order, T0 + order))


def _write_csv(path, seed: int, rows: int = ROWS, order: int | None = None) -> None:
    """A file of `rows` examples, written under a hidden name and renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    x = np.random.default_rng(seed).random((rows, 4))
    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    with open(hidden, "w") as f:
        f.write("a,b,c,d,label\n")
        for row, label in zip(x, (x.sum(1) > 2).astype(int)):
            f.write(",".join(f"{v:.4f}" for v in row) + f",{label}\n")
    if order is not None:
        _land(hidden, order)
    os.rename(hidden, path)


def _config(data_dir, **overrides):
    return tiny_config(
        **{
            "strategy.name": "one_device",
            "data.name": "csv",
            "data.train_files": str(data_dir / "train" / "*"),
            "data.eval_files": str(data_dir / "eval.csv"),
            "data.input_shape": (4,),
            "data.num_classes": 2,
            "data.follow": True,
            "data.follow_poll_secs": 0.2,
            "train.global_batch_size": 16,
            "train.steps_per_loop": 4,
            "train.checkpoint_every": 4,
            "train.deterministic": True,
            **overrides,
        }
    )


def _state(model_dir) -> dict:
    """The position in the newest checkpoint: watermark, done files, partly trained ranges."""
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints"))
    state, done = (
        reader.get_tensor(f"input/{name}/.ATTRIBUTES/VARIABLE_VALUE").decode()
        for name in ("state", "done")
    )
    return {**json.loads(state), "done": dict(json.loads(done))}


def _saved(follower) -> list:
    """The values of `follower`'s position, as a checkpoint saves them."""
    return [variable.numpy() for variable in follower.position.variables]


def _restore(follower, saved: list) -> None:
    """`follower`'s position as restored from `saved`, then started."""
    for variable, value in zip(follower.position.variables, saved, strict=True):
        variable.assign(value)
    follower.start()


def _done(model_dir) -> tuple[list[str], dict[str, list]]:
    """The base names of the files done, and the trained ranges of those partly done."""
    state = _state(model_dir)
    partial = {os.path.basename(name): ranges for name, ranges in state["partial"].items()}
    return sorted(os.path.basename(name) for name in state["done"]), partial


def _assert_same_weights(expected: dict, got: dict, rtol: float = 0.0, atol: float = 0.0):
    """The model's variables in two checkpoints' values (`checkpoint_values`) are equal."""
    weights = [name for name in expected if name.startswith("variables/")]
    assert weights
    for name in weights:
        np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


@dataclasses.dataclass
class Restarts:
    """One run over four files, and one over the same files stopped and restarted."""

    data_dir: pathlib.Path  # the four files, landed as clicks-3, 1, 2, then 4
    straight: dict  # the one run's checkpoint values, at step 16 (the four files)
    done: dict[int, tuple]  # the restarted run's files done (`_done`) by the step it stopped at
    restarted: dict  # the restarted run's checkpoint values at step 16


@pytest.fixture(scope="module")
def restarts(tmp_path_factory) -> Restarts:
    """Files arriving out of their names' order (3, 1, 2, then 4: their modification times).

    The restarted run stops in the middle of a file (step 6), at a file's end (8),
    after file 4 and a late file 0 land (16), and once more (20).
    """
    tmp_path = tmp_path_factory.mktemp("restarts")
    once, twice = tmp_path / "once", tmp_path / "twice"
    for data_dir in (once, twice):
        data_dir.mkdir()
        _write_csv(data_dir / "eval.csv", 99)
        for order, i in enumerate((3, 1, 2)):
            _write_csv(data_dir / "train" / f"clicks-{i}.csv", i, order=order)
    _write_csv(once / "train" / "clicks-4.csv", 4, order=3)
    train.train_and_evaluate(_config(once, **{"train.steps": 16}), str(tmp_path / "a"), "train")

    run, done = tmp_path / "b", {}

    def until(steps: int) -> None:
        train.train_and_evaluate(_config(twice, **{"train.steps": steps}), str(run), "train")
        done[steps] = _done(run)

    until(6)
    until(8)
    # Then file 4 lands; file 0 lands after it (a name sorting first), one is still being
    # written (a hidden name), one is a marker: 2 then 4 train, and 0 waits for the next run.
    _write_csv(twice / "train" / "clicks-4.csv", 4, order=3)
    _write_csv(twice / "train" / "clicks-0.csv", 10, order=4)
    _write_csv(twice / "train" / "_clicks-5.csv", 11, order=5)
    (twice / "train" / ".clicks-6.csv").write_text("a,b,c,d,label\n1,2,")
    until(16)
    restarted = checkpoint_values(run)
    until(20)
    return Restarts(once, checkpoint_values(tmp_path / "a"), done, restarted)


def test_files_that_arrive_out_of_name_order_between_runs_train_once_each(restarts):
    assert restarts.done[8] == (["clicks-1.csv", "clicks-3.csv"], {})
    assert restarts.done[16] == (
        ["clicks-1.csv", "clicks-2.csv", "clicks-3.csv", "clicks-4.csv"],
        {},
    )
    # The same batches in the same order: the same weights as one run over the four files.
    _assert_same_weights(restarts.straight, restarts.restarted)
    assert "clicks-0.csv" in restarts.done[20][0], "the late file trains in the next run"


def test_a_restart_in_the_middle_of_a_file_goes_on_with_its_next_record(restarts):
    # 6 x 16 records: file 3 whole, 32 of file 1; the checkpoint holds both facts.
    assert restarts.done[6] == (["clicks-3.csv"], {"clicks-1.csv": [[0, 32]]})
    assert restarts.done[8] == (["clicks-1.csv", "clicks-3.csv"], {})
    _assert_same_weights(restarts.straight, restarts.restarted)  # no record lost or repeated


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_a_trickle_short_of_a_block_trains_within_the_max_wait(tmp_path, strategy):
    _write_csv(tmp_path / "eval.csv", 99)
    # 40 records: 2 global batches of 16 and 8 more, where a block is 100 steps.
    _write_csv(tmp_path / "train" / "clicks-1.csv", 1, rows=40)
    run = tmp_path / "run"
    overrides = {
        "train.steps": 3,
        "train.steps_per_loop": 100,
        "train.checkpoint_every": 100,
        "data.follow_max_wait_secs": 0.5,
        "strategy.name": strategy,  # mirrored: the padded batch's last replicas hold only padding
    }
    results = train.train_and_evaluate(_config(tmp_path, **overrides), str(run), "train")
    # A short block of the 2 whole batches, then the 8 padded to one step of weight 8/16.
    assert results["step"] == 3
    assert _done(run) == (["clicks-1.csv"], {})


sigterm_at_step_4 = signal_at(4)


def test_sigterm_while_waiting_for_a_file_saves_the_position_and_exits_143(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write_csv(data_dir / "eval.csv", 99)
    _write_csv(data_dir / "train" / "clicks-1.csv", 1)
    config = _config(data_dir, **{"train.steps": 0})
    fields = [
        "strategy.name", "data.name", "data.train_files", "data.eval_files", "data.input_shape",
        "data.num_classes", "data.follow", "data.follow_poll_secs", "train.steps",
        "train.global_batch_size", "train.steps_per_loop", "train.checkpoint_every",
    ]  # fmt: skip
    model_dir = tmp_path / "run"
    # The one file trained on at step 4, the signal comes: the loop sees it waiting for the
    # next file (a real SIGTERM to a process of its own, forked from the tests' server).
    sigterm = "--config.train.actions=tests.test_follow:sigterm_at_step_4"
    flags = config_flags(config, tuple(fields))
    result = run_cli(f"--model_dir={model_dir}", *flags, sigterm, cwd=REPO)
    assert_exit(result, PREEMPTED_EXIT_CODE)
    out = result.stdout
    assert "steps: until stopped" in out
    assert "backlog_files: 0 | backlog_records: 0" in out
    assert "preempted (SIGTERM) at step 4" in out
    assert _done(model_dir) == (["clicks-1.csv"], {})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"data.name": "digits"}, "`data.follow` trains on files as they arrive"),
        ({"data.name": "tests.test_follow:no_files"}, "give your `dataset_fn` a `files`"),
        ({"data.train_files": "/nonexistent/*.csv"}, "`data.follow` needs one at start-up"),
        ({"data.follow_poll_secs": 0.0}, "`data.follow_poll_secs` \\(0.0\\) must be > 0"),
        (
            {"data.follow_max_wait_secs": -1.0},
            "`data.follow_max_wait_secs` \\(-1.0\\) must be >= 0",
        ),
        ({"data.follow_horizon_files": 0}, "`data.follow_horizon_files` \\(0\\) must be > 0"),
        ({"data.follow_marker": "_SUCCESS"}, "has no wildcard in its directories"),
        ({"train.epochs": 2}, "`train.epochs` \\(2\\) counts passes over fixed data"),
        ({"data.service": "local:1"}, "`data.follow` reads its files in the trainer"),
    ],
)
def test_follow_without_files_to_follow_is_one_line_and_leaves_model_dir_alone(
    tmp_path, overrides, match
):
    _write_csv(tmp_path / "eval.csv", 99)
    _write_csv(tmp_path / "train" / "clicks-1.csv", 1)
    model_dir = tmp_path / "run"
    config = _config(tmp_path, **overrides)
    one_line_error(match, train.train_and_evaluate, config, str(model_dir))
    assert not model_dir.exists()


def csv_files(files, split, global_batch_size):
    """A user's `dataset_fn` that reads the CSV files it is given."""
    del split
    records = tf.data.experimental.CsvDataset(files, [0.0] * 4 + [0], header=True)
    examples = records.map(lambda a, b, c, d, label: (tf.stack([a, b, c, d]), label))
    return examples.batch(global_batch_size)


def no_files(split, global_batch_size):
    """A user's `dataset_fn` that reads its own files: nothing to follow."""
    del split
    x = tf.zeros((ROWS, 4))
    return tf.data.Dataset.from_tensor_slices((x, tf.zeros((ROWS,), tf.int32))).batch(
        global_batch_size
    )


def test_a_dataset_fn_given_files_follows_them_once_each_across_restarts(restarts, tmp_path):
    user = {"data.name": "tests.test_follow:csv_files"}
    restarted = tmp_path / "run"
    config = _config(restarts.data_dir, **user, **{"train.steps": 8})
    train.train_and_evaluate(config, str(restarted), "train")
    assert _done(restarted) == (["clicks-1.csv", "clicks-3.csv"], {})
    config.train.steps = 16
    train.train_and_evaluate(config, str(restarted), "train")
    assert _done(restarted) == (
        ["clicks-1.csv", "clicks-2.csv", "clicks-3.csv", "clicks-4.csv"],
        {},
    )
    # It reads the records as the built-in reader does: the batches of the straight run.
    _assert_same_weights(restarts.straight, checkpoint_values(restarted))


def test_a_worker_whose_files_are_there_waits_with_its_peers_looking_as_often(tmp_path):
    _write_csv(tmp_path / "train" / "clicks-1.csv", 1)

    def read(name):  # the rows, past the header
        return tf.data.TextLineDataset(name).skip(1)

    follower = follow.Follower(str(tmp_path / "train" / "*"), read, poll_secs=0.01)
    follower.start()
    looks = []

    def everyone(ready: bool) -> bool:  # another worker finds the file two looks later
        return ready and len(looks) >= 2

    follower.wait(ROWS, 16, lambda: looks.append(1), everyone=everyone)
    # Each look is one preemption check: a coordinated watch needs as many on every worker.
    assert len(looks) == 2


def _write_tfrecord(path, rows: int, value: float, order: int | None = None) -> None:
    """`rows` examples: features `[value, row, 0, 0]` (their file's mark and their row)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    with tf.io.TFRecordWriter(hidden) as writer:
        for row in range(rows):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[value, row, 0, 0])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    if order is not None:
        _land(hidden, order)
    os.rename(hidden, path)


class _Stream:
    """A followed tfrecord source's training stream, stepped by hand as the loop steps it."""

    def __init__(self, tmp_path, pattern: str, global_batch: int = 16, **follow_fields):
        _write_tfrecord(tmp_path / "eval.tfrecord", 16, 0.0)
        fields = {"data.name": "tfrecord", "data.eval_files": str(tmp_path / "eval.tfrecord")}
        fields |= {"data.train_files": pattern, "data.follow_max_wait_secs": 0.0}
        config = _config(tmp_path, **fields, **follow_fields)
        self.dataset = data.get(config.data)
        self.follower = follow.follower_of(self.dataset)
        self.lines: list[str] = []
        self.follower.say = self.lines.append
        self.batch = global_batch
        self.trained: dict[float, list[int]] = {}  # file mark -> rows trained, in order
        pipeline = self.dataset.train_fn(global_batch, seed=0)(tf.distribute.InputContext())
        self._batches = iter(pipeline)

    def train_what_is_there(self) -> int:
        """Looks, then trains every record there (a remainder padded); returns the steps."""
        self.follower.refresh()
        steps = self.follower.steps_ready(1000, self.batch)
        for _ in range(steps):
            x, _, weights = next(self._batches)
            for (mark, row, *_), weight in zip(x.numpy(), weights.numpy()):
                if weight:
                    self.trained.setdefault(float(mark), []).append(int(row))
        self.follower.advance(steps * self.batch)
        return steps

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.follower.close()  # the stream's generator stops waiting


def test_parallel_writers_landing_in_any_order_train_each_record_once(tmp_path):
    (tmp_path / "train").mkdir()
    _write_tfrecord(tmp_path / "train" / "w2-000", 24, 2000, order=0)  # w2 lands first
    with _Stream(tmp_path, str(tmp_path / "train" / "w*")) as stream:
        stream.train_what_is_there()
        # Three writers' files land in turns, and w2-001 only after w0-002 and w1-002.
        landing = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 2), (0, 2), (1, 2), (2, 1), (0, 3)]
        for order, (writer, k) in enumerate(landing, start=1):
            mark = 1000 * writer + k
            _write_tfrecord(tmp_path / "train" / f"w{writer}-{k:03d}", 24, mark, order=order)
            if order % 3 == 0:  # the trainer looks after every third file
                stream.train_what_is_there()
        stream.train_what_is_there()
        assert len(stream.trained) == 10, sorted(stream.trained)
        for mark, rows in stream.trained.items():
            assert rows == list(range(24)), f"file {mark}: rows {rows}"
        done = stream.follower.position.read()["done"]
        assert sorted(os.path.basename(name) for name in done) == sorted(
            [f"w{w}-{k:03d}" for w, k in landing] + ["w2-000"]
        )


def test_a_file_that_lands_behind_newer_ones_is_said_late_and_trained_once(tmp_path):
    _write_tfrecord(tmp_path / "train" / "b", 16, 2.0, order=5)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as stream:
        stream.train_what_is_there()
        _write_tfrecord(tmp_path / "train" / "a", 16, 1.0, order=1)  # written long before b
        stream.train_what_is_there()
        assert stream.trained == {2.0: list(range(16)), 1.0: list(range(16))}
        late = [line for line in stream.lines if line.startswith("late file")]
        assert len(late) == 1 and str(tmp_path / "train" / "a") in late[0]


def test_a_late_hourly_partition_trains_once_its_marker_lands(tmp_path):
    def partition(hour: int, order: int, marked: bool = True) -> None:
        directory = tmp_path / "train" / "dt=2026-12-07" / f"hour={hour:02d}"
        for part in range(2):
            _write_tfrecord(directory / f"part-{part}.tfrecord", 20, hour * 10 + part, order)
        if marked:
            (directory / "_SUCCESS").write_text("")
            _land(directory / "_SUCCESS", order)

    partition(9, order=0)
    pattern = str(tmp_path / "train" / "dt=*" / "hour=*" / "part-*.tfrecord")
    with _Stream(tmp_path, pattern, **{"data.follow_marker": "_SUCCESS"}) as stream:
        stream.train_what_is_there()
        partition(8, order=1, marked=False)  # hour 08's files land after 09, its marker later
        partition(10, order=2)
        stream.train_what_is_there()
        assert sorted(stream.trained) == [90.0, 91.0, 100.0, 101.0], "no marker, not ready"
        (tmp_path / "train" / "dt=2026-12-07" / "hour=08" / "_SUCCESS").write_text("")
        stream.train_what_is_there()
        assert sorted(stream.trained) == [80.0, 81.0, 90.0, 91.0, 100.0, 101.0]
        assert all(rows == list(range(20)) for rows in stream.trained.values())


def test_a_file_older_than_the_horizon_is_refused_in_one_line(tmp_path):
    for order in range(4):
        _write_tfrecord(tmp_path / "train" / f"f{order}", 16, order, order=10 + order)
    horizon = {"data.follow_horizon_files": 2}
    with _Stream(tmp_path, str(tmp_path / "train" / "*"), **horizon) as stream:
        stream.train_what_is_there()
        state = stream.follower.position.read()
        assert len(state["done"]) == 2 and state["watermark"][1].endswith("f1")
        _write_tfrecord(tmp_path / "train" / "old", 16, 9.0, order=0)  # older than f0 and f1
        _write_tfrecord(tmp_path / "train" / "new", 16, 8.0, order=20)
        stream.train_what_is_there()
        assert sorted(stream.trained) == [0.0, 1.0, 2.0, 3.0, 8.0], "the old file is refused"
        refused = [line for line in stream.lines if line.startswith("refused late file")]
        assert (
            len(refused) == 1 and "old" in refused[0] and "data.follow_horizon_files" in refused[0]
        )


def test_a_file_removed_before_it_was_trained_whole_is_one_line_at_the_restart(tmp_path):
    _write_tfrecord(tmp_path / "train" / "a", 32, 1.0, order=0)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as stream:
        stream.follower.steps_ready(1, 16)
        next(stream._batches)
        stream.follower.advance(16)  # half of it
        saved = _saved(stream.follower)
    os.remove(tmp_path / "train" / "a")
    _write_tfrecord(tmp_path / "train" / "b", 16, 2.0, order=1)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as again:
        _restore(again.follower, saved)
        removed = [line for line in again.lines if "was removed" in line]
        assert len(removed) == 1 and "only 16 of its records trained" in removed[0]


def test_a_position_of_the_name_order_version_resumes_after_its_file_and_offset(tmp_path):
    for order, name in enumerate("abc"):
        _write_tfrecord(tmp_path / "train" / name, 16, order, order=order)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as stream:
        stream.follower.position.file.assign(str(tmp_path / "train" / "b"))  # as restored
        stream.follower.position.offset.assign(5)
        stream.follower.start()
        stream.train_what_is_there()
        assert stream.trained == {1.0: list(range(5, 16)), 2.0: list(range(16))}
        assert any("position of an earlier version" in line for line in stream.lines)


def test_units_go_to_whoever_asks_and_those_not_done_at_a_restart_go_out_again(tmp_path):
    _write_tfrecord(tmp_path / "train" / "a", 30, 1.0, order=0)
    _write_tfrecord(tmp_path / "train" / "b", 10, 2.0, order=1)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as stream:
        follower = stream.follower
        follower.admit()
        units = [follower.take_unit(most=20) for _ in range(3)]
        assert [(os.path.basename(u.file), u.first, u.records) for u in units] == [
            ("a", 0, 20),
            ("a", 20, 10),
            ("b", 0, 10),
        ]
        assert follower.take_unit() is None, "every record is out"
        follower.unit_done(units[2].id)
        follower.unit_done(units[0].id)  # the unit (a, 20, 10) is out at the checkpoint
        saved = _saved(follower)
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as restarted:
        _restore(restarted.follower, saved)
        restarted.follower.admit()
        unit = restarted.follower.take_unit()
        assert (os.path.basename(unit.file), unit.first, unit.records) == ("a", 20, 10)
        assert restarted.follower.take_unit() is None


def test_files_are_counted_by_their_framing_as_their_readers_count_them(tmp_path):
    _write_tfrecord(tmp_path / "a.tfrecord", 37, 1.0)
    _write_csv(tmp_path / "a.csv", 1, rows=23)
    assert counting.tfrecord_count(str(tmp_path / "a.tfrecord")) == 37
    assert counting.csv_count(str(tmp_path / "a.csv")) == 23
    (tmp_path / "b.csv").write_text("a,b\n1,2\n3,4")  # no line end after the last
    assert counting.csv_count(str(tmp_path / "b.csv")) == 2
    assert counting.tfrecord_count(str(tmp_path / "a.csv")) is None, "not framed as TFRecord"


MW_ROWS = 40  # per file: global batches cross file ends, and positions fall inside files
# The fields a cluster's workers take from `_config` (the rest are the defaults of both).
_CLUSTER_FIELDS = (
    "data.name", "data.train_files", "data.eval_files", "data.input_shape", "data.num_classes",
    "data.follow", "data.follow_poll_secs", "train.global_batch_size", "train.steps_per_loop",
    "train.checkpoint_every", "train.export", "eval.every", "model.hidden_units", "model.dropout",
)  # fmt: skip


def _until_stopped_on_two_workers(cwd, flags, *actions: str) -> str:
    """Two `multi_worker` workers training until stopped, with loop `actions` of this module.

    Returns what they printed; they must end preempted (exit 143) within `TIMEOUT_S`.
    """
    names = ",".join(f"tests.test_follow:{action}" for action in actions)
    args = ("--workers=2", "--", "--strategy=multi_worker", *flags, "--config.train.steps=0")
    result = launched(*args, f"--config.train.actions={names}", cwd=cwd, code=PREEMPTED_EXIT_CODE)
    return result.stdout + result.stderr


def _land_kth(data_dir, k: int) -> None:
    """The k-th file to land, of `MW_ROWS` records, named clicks-{6 - k}: no name order."""
    _write_csv(data_dir / "train" / f"clicks-{6 - k}.csv", k, MW_ROWS, order=k)


# Loop actions of the workers (`train.actions`): a real SIGTERM that worker:1 sends itself
# once step 5 (12) is trained, and the fifth file, landed by the chief once step 8 is.
worker_1_sigterm_at_5 = signal_at(5, worker=1)
worker_1_sigterm_at_12 = signal_at(12, worker=1)


def file_5_lands_at_step_8(config):
    """For `train.actions`: the chief lands the fifth file once step 8 is trained."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    data_dir = pathlib.Path(config.data.train_files).parent.parent

    def action(output):
        if output.step == 8 and task["index"] == 0:
            _land_kth(data_dir, 5)

    return action


def test_two_workers_train_each_record_once_over_files_landing_out_of_name_order(tmp_path):
    data_dir, run = tmp_path / "data", tmp_path / "run"
    _write_csv(data_dir / "eval.csv", 99)
    for k in (1, 2):
        _land_kth(data_dir, k)
    flags = [f"--model_dir={run}", *config_flags(_config(data_dir), _CLUSTER_FIELDS)]

    # 80 records: 5 steps, then both wait for a third file; a SIGTERM to worker:1 while
    # they wait: both save the position at one step and exit 143.
    output = _until_stopped_on_two_workers(tmp_path, flags, "worker_1_sigterm_at_5")
    for worker in ("worker:0", "worker:1"):
        assert f"[{worker}] preempted (SIGTERM to a worker of the cluster) at step 5" in output
    assert _done(run) == (["clicks-4.csv", "clicks-5.csv"], {})

    # The restart resumes there, with files 3 and 4 landed as it starts and file 5 once
    # step 8 is done: 12 steps hold 192 of the 200 records; the last 8 wait for more.
    for k in (3, 4):
        _land_kth(data_dir, k)
    actions = ("file_5_lands_at_step_8", "worker_1_sigterm_at_12")
    output = _until_stopped_on_two_workers(tmp_path, flags, *actions)
    for worker in ("worker:0", "worker:1"):  # the chief's checkpoint, the position in it
        assert f"[{worker}] restored {run / 'checkpoints' / 'ckpt-5'} at step 5" in output
    assert "[worker:0] preempted (SIGTERM to a worker of the cluster) at step 12" in output
    done = [f"clicks-{i}.csv" for i in (2, 3, 4, 5)]
    assert _done(run) == (done, {"clicks-1.csv": [[0, 12 * 16 - 4 * MW_ROWS]]})

    # One process over the same five files, the same global batches: the same weights.
    alone = tmp_path / "alone"
    train.train_and_evaluate(_config(data_dir, **{"train.steps": 12}), str(alone), "train")
    _assert_same_weights(checkpoint_values(alone), checkpoint_values(run), rtol=1e-5, atol=1e-6)


def test_examples_per_sec_counts_what_a_padded_step_holds_not_its_global_batch(tmp_path):
    _write_tfrecord(tmp_path / "train" / "a", 24, 1.0, order=0)  # a step and a half
    with _Stream(tmp_path, str(tmp_path / "train" / "*")) as stream:
        follow_action, _ = actions.follow(stream.follower, 16, 4, lambda: None)
        stream.follower.refresh()
        steps = stream.follower.steps_ready(4, 16)  # the remainder padded: it waits 0 s
        output = Output(step=steps, total_steps=100, steps=steps, seconds=2.0, metrics={})
        follow_action.fn(output)
        actions.rates(16, lambda: 0.1).fn(output)
    assert steps == 2
    assert output.metrics["examples_per_sec"] == 24 / 2.0  # not 2 x 16 / 2.0
