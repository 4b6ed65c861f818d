"""Scratch directories of killed tasks are removed on the next start; live ones never are."""

import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

from strategies import scratch
from tests.helpers import REPO
from trainer.checkpoints import Checkpointer

MAKE = "import sys; from strategies import scratch; print(scratch.make(sys.argv[1]), flush=True); "


@pytest.fixture(autouse=True)
def _temp_dir(tmp_path, monkeypatch):
    """This test's own temp dir, so that other runs' scratch directories are not touched."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _scratch_of_another_process(kind: str, then: str = "sys.stdin.read()"):
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKE + then, kind],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_a_killed_tasks_scratch_is_removed_when_the_next_task_starts(tmp_path):
    killed, orphan = _scratch_of_another_process("ckpt")
    alive, live = _scratch_of_another_process("preemption")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.basename(orphan).startswith(f"towerflow-ckpt-{socket.gethostname()}-")
        assert f"-{killed.pid}-" in orphan and os.path.isdir(orphan)
        elsewhere = tmp_path / "towerflow-ckpt-otherhost-1-abcdefgh"  # another host's
        mine = tmp_path / "towerflow-ckpt-unrelated"  # not named by this module
        elsewhere.mkdir()
        mine.mkdir()
        # A task that is not the chief starts: its checkpointer makes its own scratch.
        checkpointer = Checkpointer(str(tmp_path / "model"), False, 1, [tf.Variable(1.0)])
        assert not os.path.exists(orphan), "the killed task's scratch is gone"
        assert os.path.isdir(live), "a live task's scratch is kept"
        assert elsewhere.is_dir() and mine.is_dir()
        checkpointer.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [os.path.basename(live), elsewhere.name, mine.name]
        )
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait()


def test_scratch_names_carry_the_kind_host_and_pid():
    path = scratch.make("preemption")
    try:
        name = os.path.basename(path)
        assert name.startswith(f"towerflow-preemption-{socket.gethostname()}-{os.getpid()}-")
        assert scratch.remove_orphans() == [] and os.path.isdir(path)
    finally:
        os.rmdir(path)
