"""One trainer per `model_dir`: a lock file naming the host and pid that hold it.

The chief takes the lock before it writes anything in `model_dir` and
releases it on every way out (normal end, an exception, SIGTERM's exit 143;
an `atexit` hook backs up the loop's own release). A second trainer started
on the same `model_dir` is refused with one line. Workers of one cluster
share `model_dir` and take no lock; neither do `--mode=eval` and a sidecar
evaluator, which only read it.

The lock is `model_dir/towerflow.lock`, held with `flock` while its holder
runs, and holding "host pid" (on a file system without `flock`, a live pid
of this host is what holds it). A process killed with SIGKILL leaves the file
behind, but the kernel drops its `flock`: the next trainer on the same host
finds the file unlocked, and takes it over with a warning. A lock file from
another host cannot be checked from here (its `flock` may not reach this
host), so it is refused with the path to delete once that trainer is gone.

A remote `model_dir` (a bucket, `scheme://...`, see `towerflow.storage`) has
neither `flock` nor exclusive creation through `tf.io.gfile`: there the lock
is a plain file written with gfile, and the recorded "host pid" alone decides,
as on a local file system without `flock`. It refuses a second trainer that
starts while the first runs; two started within the same second may both get
through.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import socket
import sys

import tensorflow as tf

from towerflow import storage
from towerflow.errors import UserError, one_line

LOCK_FILE = "towerflow.lock"


class ModelDirLock:
    """The held lock of one `model_dir`; `release` (or process exit) gives it up."""

    def __init__(self, path: str, fd: int | None):
        """Args: path: the lock file; fd: its open descriptor, None for a remote one."""
        self.path = path
        self._fd = fd
        self._held = True
        atexit.register(self.release)

    def release(self) -> None:
        """Removes the lock file and drops the lock; does nothing the second time."""
        if not self._held:
            return
        self._held = False
        atexit.unregister(self.release)
        if self._fd is None:
            with contextlib.suppress(tf.errors.OpError):
                if _read_remote(self.path) == _holder():  # not taken over meanwhile
                    tf.io.gfile.remove(self.path)
            return
        with contextlib.suppress(OSError):
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        os.close(self._fd)


def take(model_dir: str) -> ModelDirLock:
    """Creates `model_dir` if needed and takes its lock.

    Raises:
      UserError: another trainer holds it, or a remote `model_dir` may not be
        written; nothing in `model_dir` is changed.
    """
    path = os.path.join(model_dir, LOCK_FILE)
    if not storage.is_local(model_dir):
        return _take_remote(model_dir, path)
    flocked = True
    while True:
        try:
            fd = os.open(path, os.O_RDWR)  # an existing lock file is left as it is while checked
        except FileNotFoundError:
            os.makedirs(model_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise UserError(_in_use(model_dir, holder, path)) from None
        except OSError:  # a file system without `flock`: the recorded pid decides alone
            flocked = False
        if _same_file(fd, path):  # not a file its last holder removed meanwhile
            break
        os.close(fd)
    try:
        _check_holder(model_dir, path, _read(fd), pid_decides=not flocked)
    except UserError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{_holder()}\n".encode(), 0)
    return ModelDirLock(path, fd)


def _take_remote(model_dir: str, path: str) -> ModelDirLock:
    """The lock of a remote `model_dir`: a file naming this host and pid, written with gfile."""
    _check_holder(model_dir, path, _read_remote(path), pid_decides=True)
    try:
        tf.io.gfile.makedirs(model_dir)
        storage.write_text(path, f"{_holder()}\n")
    except tf.errors.PermissionDeniedError as e:
        raise UserError(
            f"`--model_dir` '{model_dir}' is not writable ({one_line(e)}); "
            "give a directory you can write to."
        ) from None
    return ModelDirLock(path, None)


def _check_holder(model_dir: str, path: str, holder: str, pid_decides: bool) -> None:
    """Refuses a lock held by a trainer that may still run; warns when taking one over.

    Args:
      holder: the lock file's "host pid" ("" for a new lock).
      pid_decides: there is no `flock` to tell a running holder from a dead one,
        so a live pid of this host holds the lock.

    Raises:
      UserError: the holder runs (or, on another host, cannot be checked).
    """
    if not holder:
        return
    host, _, pid = holder.partition(" ")
    running = pid_decides and pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))
    if host != _host() or running:
        raise UserError(_in_use(model_dir, holder, path, other_host=host != _host()))
    print(
        f"warning: taking over the lock of `model_dir` {model_dir} from a trainer "
        f"that is gone ({holder}); it was stopped without releasing it",
        file=sys.stderr,
        flush=True,
    )


def _in_use(model_dir: str, holder: str, path: str, other_host: bool = False) -> str:
    host, _, pid = holder.partition(" ")
    who = f"pid {pid} on host {host}" if holder else "another trainer"
    fix = (
        f"if that trainer is gone, delete `{path}`" if other_host else "wait for it to end, stop it"
    )
    return (
        f"`model_dir` {model_dir} is in use by {who} (lock `{path}`); two trainers must "
        f"not write one `model_dir`: {fix}, or pass another `--model_dir`."
    )


def _read(fd: int) -> str:
    return os.pread(fd, 1024, 0).decode(errors="replace").strip()


def _read_remote(path: str) -> str:
    """A remote lock file's "host pid", or "" when there is none."""
    try:
        with tf.io.gfile.GFile(path) as f:
            return f.read(1024).strip()
    except tf.errors.NotFoundError:
        return ""


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _host() -> str:
    return socket.gethostname() or "localhost"


def _holder() -> str:
    """What this process writes in a lock it holds."""
    return f"{_host()} {os.getpid()}"


def alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
