"""A local cluster's members started as forks of one process that imported TensorFlow once.

Every member of a `python -m trainer.launch` cluster imports TensorFlow and
Keras before it does anything else: about 3 s of CPU each here, for every
chief, worker, ps and evaluator, and again for a member started anew. The
launcher instead starts one server process (`python -m towerflow.forkserver`),
which imports them and nothing more (no TensorFlow runtime starts: no threads,
no devices), and asks it for each member. The server forks twice, so that the
member becomes the launcher's own child (the launcher is a child subreaper),
and the member then runs like `python -m MODULE ARGS...` would: in its own
session, in the launcher's working directory, with its own environment,
arguments and output pipe, a fresh random state, exiting with its own status
(a traceback of its own code, as the interpreter would print it).

The tests' one-shot commands (`tests/helpers.py`'s `run_command`) are forked
the same way, by `Client.fork`, with stdout and stderr on pipes of their own.
A forked command that starts members of its own (a launcher, `server=True`)
gets its server forked from the member's process before its module runs, as
the server left it: its `Client` adopts that one instead of starting a server
that imports TensorFlow again (where the launcher moved into namespaces of its
own meanwhile, a loopback-only network, the server follows it there first).

Only a command of the form `[sys.executable, "-m", MODULE, ...]` is forked;
where the kernel has no child subreapers (not Linux) or the server cannot
start, and under `python -m trainer.launch --nofork_members`, members are
started as processes of their own (`start_process`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from towerflow import registry
from towerflow.processes import native_stderr_silenced, pump_lines, start_process

PRELOADED = ("tensorflow", "keras", "absl.app")  # what every member imports first
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
_MESSAGE_BYTES = 1 << 20  # a request: the member's argv and environment, as JSON
_POLL_S = 0.02
# The namespaces a server follows its launcher into (`_join`), user first, by `setns` flag.
_NAMESPACES = {
    "user": 0x10000000,
    "net": 0x40000000,
    "mnt": 0x00020000,
    "uts": 0x04000000,
    "ipc": 0x08000000,
}
# A server forked for this process before its module ran (`server=True`), and the socket
# to it; the first `Client` to start one adopts it.
PREFORKED: tuple[Forked, socket.socket] | None = None


class Forked:
    """A member forked by the server: `subprocess.Popen`'s `pid`, `poll`, `wait`, `returncode`."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._reaping = threading.Lock()  # one thread reaps it; another sees its code

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(_POLL_S)
        return self.returncode


class Client:
    """The launcher's side: starts the server once, then asks it for each member.

    Attributes:
      enabled: fork members (off: every one a process of its own). The launcher
        turns it on; the server makes this process a child subreaper.
    """

    def __init__(
        self,
        server_env: dict[str, str] | None = None,
        label: Sequence[str] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        """Starts nothing yet: the server starts with the first command forked.

        Args:
          server_env: the server's environment; None: the first command's, less TF_CONFIG.
          label: what the server's command line (and so every member's) shows after
            `--`; None: the first command forked, whose members it starts.
          preload: towerflow's own modules the server imports after `PRELOADED`, so
            that no member imports them again (`towerflow.registry.own_imported`; one
            that fails to import is left to the members, which fail on it as they would).
        """
        self.enabled = False
        self._server_env = server_env
        self._label = label
        self._preload = tuple(preload)
        self._socket: socket.socket | None = None
        self._server: subprocess.Popen | Forked | None = None  # started, or forked for us
        self._failed = False
        self._lock = threading.Lock()  # one request at a time on the socket

    def start(
        self,
        command: Sequence[str],
        env: dict[str, str],
        on_line: Callable[[str], None],
        cores: Sequence[int] = (),
        name: str = "",
    ) -> tuple[subprocess.Popen | Forked, threading.Thread]:
        """Starts `command` as `start_process` would, forked from the server where it can.

        `cores`: the CPU cores a forked command runs on (default the server's); a
        command started anew inherits the caller's. `name`: a forked command's
        (`/proc/PID/comm`), where its `TF_CONFIG` names no task.
        """
        read, write = os.pipe()
        env = {**env, "PYTHONUNBUFFERED": "1"}
        proc = self.fork(command, env, [write], cores=cores, name=name)
        os.close(write)
        if proc is None:
            os.close(read)
            return start_process(command, env, on_line)
        return proc, pump_lines(os.fdopen(read, "rb"), on_line)

    def fork(
        self,
        command: Sequence[str],
        env: dict[str, str],
        fds: Sequence[int],
        cwd: str | None = None,
        server: bool = False,
        cores: Sequence[int] = (),
        name: str = "",
    ) -> Forked | None:
        """Forks `command` from the server, its stdout on `fds[0]` and stderr on `fds[-1]`.

        It runs in `cwd` (default this process's). The caller keeps (and closes)
        `fds`. `server`: the command starts members of its own (a launcher):
        a server is forked for it too, which its own `Client` adopts. `cores`:
        the CPU cores it runs on (default the server's); `name`: its name where
        its `TF_CONFIG` names no task (`run_member`). Returns
        None where it cannot fork (not `python -m MODULE`, not enabled, no
        server): start it another way.
        """
        module = _module(command)
        if module is None or not self.enabled or not self._started(command, env):
            return None
        request = {"module": module, "argv": list(command[3:]), "cwd": cwd or os.getcwd()}
        request.update(env=env, server=server, cores=list(cores), name=name)
        try:
            with self._lock:
                socket.send_fds(self._socket, [json.dumps(request).encode()], list(fds))
                reply = json.loads(self._socket.recv(_MESSAGE_BYTES) or b"{}")
        except OSError:
            reply = {}
        if "pid" not in reply:  # the server is gone: from now on, processes of their own
            self.close()
            self._failed = True
            return None
        return Forked(reply["pid"], command)

    def close(self) -> None:
        """Ends the server (members it started run on)."""
        if self._socket is not None:
            self._socket.close()
        if self._server is not None:
            self._server.wait()
        self._socket = self._server = None

    def _started(self, command: Sequence[str], env: dict[str, str]) -> bool:
        if self._socket is not None:
            return True
        if self._failed or not _become_subreaper():
            return False  # failed before, or members could not be this process's children
        preforked = _take_preforked()  # ready, in this process's namespaces
        self._server, ours = preforked or self._start_server(command, env)
        if not preforked and ours.recv(_MESSAGE_BYTES) != b"ready":  # its error is on stderr
            ours.close()
            self._server.wait()
            self._server, self._failed = None, True
            return False
        self._socket = ours
        return True

    def _start_server(
        self, command: Sequence[str], env: dict[str, str]
    ) -> tuple[subprocess.Popen, socket.socket]:
        """A new server process (it imports `PRELOADED`), and the socket to it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = self._server_env
        if server_env is None:
            server_env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
        label = command if self._label is None else self._label
        server = subprocess.Popen(  # its command line shows whose members it starts
            [sys.executable, "-m", "towerflow.forkserver", str(theirs.fileno()), *self._preload]
            + ["--", *label],
            # Unbuffered output from the start: the members inherit its streams' buffering.
            env={**server_env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        return server, ours


def _take_preforked() -> tuple[Forked, socket.socket] | None:
    """The server forked for this process (`PREFORKED`), once, ready, in this process's namespaces.

    Where this process has moved since into namespaces of its own (a launcher
    that runs its cluster on a loopback-only network, `towerflow.netns`), the
    server joins them first, so that its members run there too. Where it cannot,
    that server ends (its socket closes) and None says to start another.
    """
    global PREFORKED
    if PREFORKED is None:
        return None
    (server, ours), PREFORKED = PREFORKED, None
    ready = ours.recv(_MESSAGE_BYTES) == b"ready"
    if ready and _namespaces(server.pid) != _namespaces(os.getpid()):
        ours.sendall(json.dumps({"join": os.getpid()}).encode())
        ready = ours.recv(_MESSAGE_BYTES) == b"ready"  # once it tried
    if ready and _namespaces(server.pid) == _namespaces(os.getpid()):
        return server, ours
    ours.close()
    server.wait()
    return None


def _namespaces(pid: int) -> dict[str, str]:
    """The namespaces of process `pid` (`/proc/PID/ns`), by kind."""
    return {kind: os.readlink(f"/proc/{pid}/ns/{kind}") for kind in _NAMESPACES}


def _join(pid: int) -> None:
    """Moves this (single-threaded) process into each namespace of `pid` it is not in.

    The user namespace first (a process's user owns the ones it made): it gives
    the rights to join the others. A namespace it may not join stays as it was.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    ours = _namespaces(os.getpid())
    for kind, flag in _NAMESPACES.items():
        path = f"/proc/{pid}/ns/{kind}"
        if os.readlink(path) == ours[kind]:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            libc.setns(fd, flag)
        finally:
            os.close(fd)


def _module(command: Sequence[str]) -> str | None:
    """MODULE of `[sys.executable, "-m", MODULE, ...]`, else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2]
    return None


def _become_subreaper() -> bool:
    """Makes orphaned descendants (the forked members) this process's children; Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):  # no such call here
        return False


def _set_name(name: str) -> None:
    """This process's name (`/proc/self/comm`, at most 15 bytes)."""
    with open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def serve(channel: socket.socket) -> dict | None:
    """The server's loop: forks a member per request; returns the request in the member."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher stops it by closing the socket
        signal.signal(sig, signal.SIG_IGN)
    # What the imports made, out of the collector's sight: a member's collections do not
    # walk (and so copy, page by page) the server's objects.
    gc.freeze()
    channel.sendall(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 2)
        except OSError:
            return None
        if not message:
            return None
        request = json.loads(message)
        if "join" in request:  # its launcher moved into namespaces of its own
            _join(request["join"])
            channel.sendall(b"ready")
            continue
        pids_read, pids_write = os.pipe()
        middle = os.fork()
        if middle == 0:  # the member's parent for a moment: it exits, the launcher adopts
            os.close(pids_read)
            member = os.fork()
            if member == 0:
                os.close(pids_write)
                channel.close()
                request["fds"] = fds  # stdout, and stderr where it is another
                return request
            os.write(pids_write, str(member).encode())
            os._exit(0)
        os.close(pids_write)
        for fd in fds:
            os.close(fd)
        with os.fdopen(pids_read, "rb") as pids:
            member = int(pids.read() or 0)
        os.waitpid(middle, 0)
        channel.sendall(json.dumps({"pid": member} if member else {}).encode())


def run_member(request: dict) -> None:
    """Runs the member as `python -m MODULE ARGV...` would, in this forked process.

    Its command line and `/proc/PID/environ` are the server's; its name
    (`/proc/PID/comm`, what `ps -o comm` shows) says which member it is, e.g.
    `worker:1` (`towerflow.processes.member_pid` reads either), or is the name it
    was started with (`data:worker:0`).
    """
    os.setsid()  # a process group of its own, as `start_process` gives
    task = json.loads(request["env"].get("TF_CONFIG") or "{}").get("task")  # "" for none
    name = f"{task['type']}:{task['index']}" if task else request.get("name")
    if name:
        _set_name(name)
        # `absl.app.run` names the process after its script first: named again after that.
        sys.modules["absl.app"].call_after_init(lambda: _set_name(name))
    fds = request["fds"]
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in set(fds):
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if request.get("cores"):  # where a process started anew would inherit its caller's
        os.sched_setaffinity(0, request["cores"])
    if request.get("server"):  # before this member changes anything a server's fork keeps
        _prefork_server()
    if sys.path and sys.path[0] == os.getcwd():  # as `python -m` puts its working directory first
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    sys.modules["numpy"].random.seed()  # as fresh as a new process's
    with native_stderr_silenced():  # the device probe's chatter, as `python -m trainer` hides it
        sys.modules["tensorflow"].config.list_physical_devices()
    sys.argv = [request["module"], *request["argv"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException as error:  # the member's own traceback, without these frames
        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        if isinstance(error, KeyboardInterrupt):  # as the interpreter ends: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def _prefork_server() -> None:
    """Forks a server from this member before its module runs; its `Client` adopts it.

    The member is still as the server left it (`PRELOADED` imported, no
    thread, its streams and session already the member's), so the fork serves
    as a server started anew would, without importing TensorFlow again. It is
    this member's child, as a started one would be; it ends when the socket
    closes (this member is gone). A member it forks runs to its own exit.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        request = serve(theirs)
        if request is None:
            os._exit(0)  # the socket closed: nothing of the member's own to run here
        run_member(request)
        raise SystemExit(0)  # its module returned: it ends as `main` would
    theirs.close()
    # This file runs as `__main__`; the member's modules import it by name: the state goes there.
    from towerflow import forkserver  # noqa: PLC0415

    forkserver.PREFORKED = (Forked(pid, [sys.executable, "-m", "towerflow.forkserver"]), ours)


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as `python -m trainer` sets it
    channel = socket.socket(fileno=int(sys.argv[1]))
    with native_stderr_silenced():  # TensorFlow's C++ start-up chatter, as members hide it
        for name in PRELOADED:
            __import__(name)
        # A member would find them so: towerflow's own, never the working directory's.
        registry.own_imported(sys.argv[2 : sys.argv.index("--")], failing_ok=True)
    request = serve(channel)
    if request is not None:
        run_member(request)


if __name__ == "__main__":
    main()
