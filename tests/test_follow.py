"""`data.follow`: files that keep arriving train once each, in name order, across restarts."""

import os
import signal
import threading

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    REPO,
    TIMEOUT_S,
    assert_exit,
    checkpoint_values,
    config_flags,
    kill,
    one_line_error,
    pid_of,
    start_cli,
    tiny_config,
)
from towerflow.errors import PREEMPTED_EXIT_CODE
from trainer.loop import train

ROWS = 64  # per file: one block of 4 steps of 16


def _write_csv(path, seed: int, rows: int = ROWS) -> None:
    """A file of `rows` examples, written under a hidden name and renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    x = np.random.default_rng(seed).random((rows, 4))
    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    with open(hidden, "w") as f:
        f.write("a,b,c,d,label\n")
        for row, label in zip(x, (x.sum(1) > 2).astype(int)):
            f.write(",".join(f"{v:.4f}" for v in row) + f",{label}\n")
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


def _position(model_dir) -> tuple[str, int]:
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints"))
    name = reader.get_tensor("input/file/.ATTRIBUTES/VARIABLE_VALUE").decode()
    return os.path.basename(name), int(reader.get_tensor("input/offset/.ATTRIBUTES/VARIABLE_VALUE"))


def test_files_that_arrive_between_runs_train_once_each_in_name_order(tmp_path):
    once, twice = tmp_path / "once", tmp_path / "twice"
    for data_dir in (once, twice):
        data_dir.mkdir()
        _write_csv(data_dir / "eval.csv", 99)
        for i in (1, 2, 3):
            _write_csv(data_dir / "train" / f"clicks-{i}.csv", i)
    _write_csv(once / "train" / "clicks-4.csv", 4)
    train.train_and_evaluate(_config(once, **{"train.steps": 16}), str(tmp_path / "a"), "train")

    restarted = tmp_path / "b"
    train.train_and_evaluate(_config(twice, **{"train.steps": 8}), str(restarted), "train")
    assert _position(restarted) == ("clicks-3.csv", 0)
    # Then a file arrives in order; one arrives late with an earlier name, one is still
    # being written (a hidden name), one is a marker: none of the last three is read.
    _write_csv(twice / "train" / "clicks-4.csv", 4)
    _write_csv(twice / "train" / "clicks-0.csv", 10)
    _write_csv(twice / "train" / "_clicks-5.csv", 11)
    (twice / "train" / ".clicks-6.csv").write_text("a,b,c,d,label\n1,2,")
    train.train_and_evaluate(_config(twice, **{"train.steps": 16}), str(restarted), "train")
    assert _position(restarted) == ("clicks-4.csv", ROWS)

    # The same batches in the same order: the same weights as one run over the four files.
    expected, got = checkpoint_values(tmp_path / "a"), checkpoint_values(restarted)
    weights = [name for name in expected if name.startswith("variables/")]
    assert weights
    for name in weights:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


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
    proc = start_cli(f"--model_dir={model_dir}", *config_flags(config, tuple(fields)), cwd=REPO)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("train | step: 4 "):  # the one file trained on: it waits now
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE, out[-2000:]
    assert "steps: until stopped" in out
    assert "backlog_files: 0 | backlog_records: 0" in out
    assert "preempted (SIGTERM) at step 4" in out
    assert _position(model_dir) == ("clicks-1.csv", ROWS)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"data.name": "digits"}, "`data.follow` trains on files as they arrive"),
        ({"data.name": "tests.test_follow:no_files"}, "give your `dataset_fn` a `files`"),
        ({"data.train_files": "/nonexistent/*.csv"}, "`data.follow` needs one at start-up"),
        ({"data.follow_poll_secs": 0.0}, "`data.follow_poll_secs` \\(0.0\\) must be > 0"),
        ({"train.epochs": 2}, "`train.epochs` \\(2\\) counts passes over fixed data"),
        ({"data.service": "local:1"}, "`data.follow` reads its files in the trainer"),
        (
            {"strategy.name": "parameter_server"},
            "`strategy.name` 'parameter_server' lets workers take batches as they come",
        ),
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


def test_a_dataset_fn_given_files_follows_them_once_each_across_restarts(tmp_path):
    data_dir = tmp_path / "data"
    _write_csv(data_dir / "eval.csv", 99)
    for i in (1, 2, 3):
        _write_csv(data_dir / "train" / f"clicks-{i}.csv", i)
    user = {"data.name": "tests.test_follow:csv_files"}
    config = _config(data_dir, **user, **{"train.steps": 12})
    train.train_and_evaluate(config, str(tmp_path / "a"), "train")
    assert _position(tmp_path / "a") == ("clicks-3.csv", ROWS)

    restarted = tmp_path / "b"
    train.train_and_evaluate(
        _config(data_dir, **user, **{"train.steps": 8}), str(restarted), "train"
    )
    assert _position(restarted) == ("clicks-3.csv", 0)
    train.train_and_evaluate(config, str(restarted), "train")
    expected, got = checkpoint_values(tmp_path / "a"), checkpoint_values(restarted)
    weights = [name for name in expected if name.startswith("variables/")]
    assert weights
    for name in weights:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_worker_whose_files_are_there_waits_with_its_peers_looking_as_often(tmp_path):
    from trainer.data.follow import Follower

    _write_csv(tmp_path / "train" / "clicks-1.csv", 1)

    def read(name):  # the rows, past the header
        return tf.data.TextLineDataset(name).skip(1)

    follower = Follower(str(tmp_path / "train" / "*"), read, poll_secs=0.01)
    follower.start()
    peers_ready = iter([False, False, True])  # another worker finds the file two looks later
    looks = []
    follower.wait(ROWS, lambda: looks.append(1), everyone=lambda ready: ready and next(peers_ready))
    # Each look is one preemption check: a coordinated watch needs as many on every worker.
    assert len(looks) == 2 and next(peers_ready, None) is None


def _write_tfrecord(path, rows: int, value: float) -> None:
    """`rows` examples whose features all hold `value` (their file's mark)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(rows):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[value] * 4)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )


def test_a_tfrecord_stream_reads_a_new_file_once_it_is_found(tmp_path):
    from trainer import data
    from trainer.data import follow

    _write_tfrecord(tmp_path / "eval.tfrecord", 16, 0.0)
    _write_tfrecord(tmp_path / "train" / "part-1", ROWS, 1.0)
    config = _config(
        tmp_path, **{"data.name": "tfrecord", "data.eval_files": str(tmp_path / "eval.tfrecord")}
    )
    dataset = data.get(config.data)
    follower = follow.follower_of(dataset)
    pipeline = dataset.train_fn(16, seed=0)(tf.distribute.InputContext())
    assert pipeline.options().autotune.enabled is False, "the source's data settings hold"
    batches = iter(pipeline)
    try:
        assert [float(next(batches)[0][0, 0]) for _ in range(4)] == [1.0] * 4
        follower.advance(ROWS)
        assert follower.figures() == {
            "files_waiting": 0.0,
            "records_waiting": 0.0,
            "seconds_behind": 0.0,
        }
        _write_tfrecord(tmp_path / "train" / "part-2", ROWS, 2.0)
        follower.refresh()
        assert follower.figures()["files_waiting"] == 1.0
        assert float(next(batches)[0][0, 0]) == 2.0, "the new file's records come next"
    finally:
        follower.close()


MW_ROWS = 40  # per file: global batches cross file ends, and positions fall inside files
# The fields a cluster's workers take from `_config` (the rest are the defaults of both).
_CLUSTER_FIELDS = (
    "data.name", "data.train_files", "data.eval_files", "data.input_shape", "data.num_classes",
    "data.follow", "data.follow_poll_secs", "train.global_batch_size", "train.steps_per_loop",
    "train.checkpoint_every", "train.export", "eval.every", "model.hidden_units", "model.dropout",
)  # fmt: skip


def _until_stopped_on_two_workers(cwd, flags, react) -> str:
    """Two `multi_worker` workers training until stopped; `react(line)` for each line printed.

    Returns what they printed; they must end preempted (exit 143) within `TIMEOUT_S`.
    """
    args = ("--workers=2", "--", "--strategy=multi_worker", *flags, "--config.train.steps=0")
    proc = start_cli(*args, cwd=cwd, module="trainer.launch")
    timer = threading.Timer(TIMEOUT_S, kill, (proc,))
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            react(line)
        proc.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    assert_exit(proc, PREEMPTED_EXIT_CODE, output)
    return output


def test_two_workers_train_each_record_once_over_files_written_before_and_during_a_restart(
    tmp_path,
):
    data_dir, run = tmp_path / "data", tmp_path / "run"
    _write_csv(data_dir / "eval.csv", 99)
    for i in (1, 2):
        _write_csv(data_dir / "train" / f"clicks-{i}.csv", i, MW_ROWS)
    flags = [f"--model_dir={run}", *config_flags(_config(data_dir), _CLUSTER_FIELDS)]

    def stop_at(step: int):  # SIGTERM to worker:1 once the chief reports `step`
        def react(line: str) -> None:
            if line.startswith(f"[worker:0] train | step: {step} "):
                os.kill(pid_of("worker", 1, str(tmp_path)), signal.SIGTERM)

        return react

    # A block of 4 steps, then both wait for a third file; a SIGTERM to worker:1 while
    # they wait: both save the position at one step and exit 143.
    output = _until_stopped_on_two_workers(tmp_path, flags, stop_at(4))
    for worker in ("worker:0", "worker:1"):
        assert f"[{worker}] preempted (SIGTERM to a worker of the cluster) at step 4" in output
    assert _position(run) == ("clicks-2.csv", 4 * 16 - MW_ROWS)

    # The restart resumes there. Steps 4 to 8 need files 3 and 4, written as it starts;
    # steps 8 to 12 need file 5, written once step 8 is done: both wait for it.
    def write_and_stop(line: str) -> None:
        if "[launch]" in line and not (data_dir / "train" / "clicks-3.csv").exists():
            for i in (3, 4):
                _write_csv(data_dir / "train" / f"clicks-{i}.csv", i, MW_ROWS)
        if line.startswith("[worker:0] train | step: 8 "):
            _write_csv(data_dir / "train" / "clicks-5.csv", 5, MW_ROWS)
        stop_at(12)(line)

    output = _until_stopped_on_two_workers(tmp_path, flags, write_and_stop)
    for worker in ("worker:0", "worker:1"):  # the chief's checkpoint, the position in it
        assert f"[{worker}] restored {run / 'checkpoints' / 'ckpt-4'} at step 4" in output
    assert "[worker:0] preempted (SIGTERM to a worker of the cluster) at step 12" in output
    assert _position(run) == ("clicks-5.csv", 12 * 16 - 4 * MW_ROWS)

    # One process over the same five files, the same global batches: the same weights.
    alone = tmp_path / "alone"
    train.train_and_evaluate(_config(data_dir, **{"train.steps": 12}), str(alone), "train")
    expected, got = checkpoint_values(alone), checkpoint_values(run)
    weights = [name for name in expected if name.startswith("variables/")]
    assert weights
    for name in weights:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
