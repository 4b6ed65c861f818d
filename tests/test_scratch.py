"""Scratch space of members that are not the chief: in memory, so no exit leaves any behind."""

import os
import signal
import tempfile

import pytest
import tensorflow as tf

from strategies.cluster import scratch
from tests.helpers import launch_and_signal, launched
from trainer.loop.checkpoints import Checkpointer


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """This test's own temp dir, for this process and those it starts."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.setenv("TMPDIR", str(path))
    return path


def test_a_non_chief_checkpointer_writes_to_memory_and_frees_it(tmp_path, temp_dir):
    variable = tf.Variable([1.0, 2.0])
    checkpointer = Checkpointer(str(tmp_path / "model"), False, 3, [variable])
    for step in (1, 2, 3):
        path = checkpointer.save(step)
        assert path.startswith("ram://") and tf.io.gfile.exists(path + ".index")
    saved = os.path.dirname(path)
    # Only the newest is kept: what a member that is not the chief writes is never read.
    assert sorted(tf.io.gfile.listdir(saved)) == [
        "checkpoint",
        "ckpt-3.data-00000-of-00001",
        "ckpt-3.index",
    ]
    checkpointer.close()
    assert not tf.io.gfile.exists(saved)
    assert os.listdir(temp_dir) == [] and not (tmp_path / "model").exists()


def test_scratch_directories_are_distinct_and_removed_after_their_block():
    with scratch.directory("export") as a, scratch.directory("export") as b:
        assert a != b and not a.startswith(b) and not b.startswith(a)
        assert tf.io.gfile.isdir(a) and tf.io.gfile.isdir(b)
    assert not tf.io.gfile.exists(a) and not tf.io.gfile.exists(b)
    scratch.remove(a)  # a second time: nothing to do


def _scratch_left(temp_dir) -> list[str]:
    return [name for name in os.listdir(temp_dir) if name.startswith("towerflow-")]


@pytest.mark.slow  # a cluster killed, then run to the end
def test_a_non_chief_leaves_no_scratch_when_killed_or_at_the_end(tmp_path, temp_dir):
    # Worker 1 writes its share of every checkpoint (every 20 steps) and runs the
    # preemption handler; it is killed after several saves, with no chance to clean up.
    common = [
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        "--config.train.steps_per_loop=20",
        "--config.train.checkpoint_every=20",
        "--config.eval.every=0",
        "--config.model.hidden_units=(16,)",
    ]
    code, lines, _ = launch_and_signal(
        "--workers=2",
        "--",
        *common,
        "--config.train.steps=100000",
        "--config.train.export=False",
        cwd=tmp_path,
        trigger="[worker:0] train | step: 80/",
        member=("worker", 1),
        sig=signal.SIGKILL,
    )
    output = "\n".join(line for _, line in lines)
    assert code != 0 and "worker:1 (127.0.0.1:" in output, output[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "ckpt-60.index").exists()  # saved by both workers
    assert _scratch_left(temp_dir) == [], "left by the killed worker (or by worker 0 on its exit)"
    # The same job resumed to its end: worker 1 also exports (its copy is dropped).
    result = launched("--workers=2", "--", *common, "--config.train.steps=140", cwd=str(tmp_path))
    assert "[worker:0] train | step: 140/140" in result.stdout
    assert _scratch_left(temp_dir) == [], "left by a normal end"
