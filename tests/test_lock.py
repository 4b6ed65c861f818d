"""One trainer per `model_dir`: a second is refused, a dead one's lock is taken over."""

import errno
import os
import pathlib
import signal
import socket
import subprocess
import sys
import uuid

import pytest
import tensorflow as tf

from tests.helpers import tiny_config
from towerflow import storage
from towerflow.errors import UserError
from trainer.loop import lock, train


def _snapshot(directory: pathlib.Path) -> dict:
    """Every file under `directory` with its contents and modification time."""
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _config(**overrides):
    """A tiny run under `one_device`: the lock is taken and released the same under every plugin."""
    return tiny_config(**{"strategy.name": "one_device", **overrides})


def test_a_second_trainer_on_a_model_dir_in_use_is_refused_and_changes_nothing(tmp_path):
    config = _config(**{"train.steps": 10})
    train.train_and_evaluate(config, str(tmp_path))  # a checkpoint to evaluate later
    config.train.steps = 20
    # The first trainer's lock, held here: a `flock` belongs to the open file it was taken
    # through, so the trainer's own `take` below is refused as another process's would be.
    held = lock.take(str(tmp_path))
    try:
        holder = [socket.gethostname(), str(os.getpid())]
        assert (tmp_path / lock.LOCK_FILE).read_text().split() == holder
        before = _snapshot(tmp_path)
        with pytest.raises(UserError) as refused:
            train.train_and_evaluate(config, str(tmp_path))
        assert _snapshot(tmp_path) == before
        message = str(refused.value)
        assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "\n" not in message and "`--model_dir`" in message
        # Evaluating only reads model_dir: it needs no lock.
        assert train.train_and_evaluate(config, str(tmp_path), mode="eval")["step"] == 10
    finally:
        held.release()


def test_the_lock_is_released_when_the_run_ends_or_fails(tmp_path):
    train.train_and_evaluate(_config(), str(tmp_path / "ends"))
    assert not (tmp_path / "ends" / lock.LOCK_FILE).exists()
    diverges = _config(
        **{
            "optimizer.name": "sgd",
            "optimizer.learning_rate": 1e9,
            "train.loss_upper_bound": 1e3,
            "train.max_recoveries": 0,
        }
    )
    with pytest.raises(train.faults.Diverged):
        train.train_and_evaluate(diverges, str(tmp_path / "fails"))
    assert not (tmp_path / "fails" / lock.LOCK_FILE).exists()
    lock.take(str(tmp_path / "fails")).release()  # and it can be taken again


def test_the_lock_of_a_killed_trainer_is_taken_over_with_a_warning(tmp_path, capsys):
    # What a trainer killed with SIGKILL leaves: its lock file naming it, and no `flock`
    # (the kernel drops it with the process).
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (tmp_path / lock.LOCK_FILE).write_text(f"{socket.gethostname()} {killed.pid}\n")
    train.train_and_evaluate(_config(), str(tmp_path))
    err = capsys.readouterr().err
    assert f"taking over the lock of `model_dir` {tmp_path}" in err
    assert f"{socket.gethostname()} {killed.pid}" in err
    assert not (tmp_path / lock.LOCK_FILE).exists()


def test_a_lock_from_another_host_is_refused_with_the_file_to_delete(tmp_path):
    (tmp_path / lock.LOCK_FILE).write_text("other-host 4242\n")
    with pytest.raises(UserError, match=r"in use by pid 4242 on host other-host .* delete `"):
        lock.take(str(tmp_path))
    assert (tmp_path / lock.LOCK_FILE).read_text() == "other-host 4242\n"


def test_without_flock_a_live_pid_holds_the_lock_and_a_dead_one_does_not(
    tmp_path, monkeypatch, capsys
):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")  # as on some network file systems

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / lock.LOCK_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
        with pytest.raises(UserError, match=f"in use by pid {sleeper.pid} on host"):
            lock.take(str(tmp_path))
    finally:
        sleeper.kill()
        sleeper.wait()
    held = lock.take(str(tmp_path))  # its pid is gone now
    assert f"from a trainer that is gone ({socket.gethostname()} {sleeper.pid})" in (
        capsys.readouterr().err
    )
    held.release()
    assert not (tmp_path / lock.LOCK_FILE).exists()


def test_on_a_remote_model_dir_the_lock_file_written_with_gfile_decides(capsys):
    # `ram://` stands in for a bucket: no `flock`, so the recorded host and pid decide.
    model_dir = f"ram://towerflow-test-{uuid.uuid4().hex}/run"
    path = f"{model_dir}/{lock.LOCK_FILE}"
    held = lock.take(model_dir)
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == f"{socket.gethostname()} {os.getpid()}\n"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # A trainer of this host that runs (written whole: `ram://` appends to a file it opens).
        storage.write_text(path, f"{socket.gethostname()} {sleeper.pid}\n")
        with pytest.raises(UserError, match=f"in use by pid {sleeper.pid} on host"):
            lock.take(model_dir)
    finally:
        sleeper.kill()
        sleeper.wait()
    held.release()  # the file names another trainer now: left alone
    assert tf.io.gfile.exists(path)
    again = lock.take(model_dir)  # its pid is gone now
    assert f"from a trainer that is gone ({socket.gethostname()} {sleeper.pid})" in (
        capsys.readouterr().err
    )
    again.release()
    assert not tf.io.gfile.exists(path)
    storage.write_text(path, "other-host 4242\n")
    with pytest.raises(UserError, match=r"in use by pid 4242 on host other-host .* delete `ram://"):
        lock.take(model_dir)
    tf.io.gfile.rmtree(model_dir)
