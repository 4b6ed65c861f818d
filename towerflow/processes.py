"""Child processes in groups of their own, with their output prefixed and Ctrl-C handled.

Shared by `python -m trainer.launch` (a local cluster's members),
`python -m trainer.sweep` (a sweep's trials) and a local tf.data service
(`trainer.data.service_client.LocalService`): each process runs in its own
process group, so stopping it stops its children too; it is stopped with
SIGTERM, given a grace period to save, then killed; a signal to the parent is
recorded (`Interrupt`) and acted on by the parent's wait loop.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING

from towerflow.errors import UserError

if TYPE_CHECKING:  # it imports this module
    from towerflow import forkserver

POLL_S = 0.1
LOOPBACK = "127.0.0.1"  # local clusters and servers listen here only
PICKED_FROM = 20000  # picked ports: from here to the kernel's ephemeral range
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Silences file descriptor 2 while TensorFlow loads and probes devices.

    Its C++ runtime prints start-up chatter (no CUDA driver found, ...) before
    any setting can stop it. Python errors still surface: they are raised, not
    printed, inside the block. `TF_CPP_MIN_LOG_LEVEL=0` or `1` keeps the chatter.
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2") < "2":
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class Console:
    """Writes whole lines to one stream from many threads, each prefixed with its source."""

    def __init__(self, stream: IO[str] | None = None, own: str = "launch"):
        """Args: stream: where lines go (default stdout); own: the prefix of `log` lines."""
        self._stream = stream
        self._own = own
        self._lock = threading.RLock()  # re-entrant: the signal handler logs too

    def write(self, source: str, line: str) -> None:
        """Writes `[source] line`."""
        stream = self._stream or sys.stdout
        with self._lock:
            stream.write(f"[{source}] {line}\n")
            stream.flush()

    def log(self, message: str) -> None:
        """A line from the parent itself (the launcher, the sweep)."""
        self.write(self._own, message)


def start_process(
    command: Sequence[str], env: dict[str, str], on_line: Callable[[str], None]
) -> tuple[subprocess.Popen, threading.Thread]:
    """Starts `command` in a process group of its own; each output line goes to `on_line`.

    Stdout and stderr are merged and read by a daemon thread (returned, to be
    joined once the process is gone). Stop it with `terminate`, then `signal_group`
    with SIGKILL: signalling the group stops its children too.
    """
    proc = subprocess.Popen(
        list(command),
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, which `terminate` signals as a whole
    )

    return proc, pump_lines(proc.stdout, on_line)


def pump_lines(stream: IO[bytes], on_line: Callable[[str], None]) -> threading.Thread:
    """A daemon thread that passes each line of `stream` to `on_line`, then closes it."""

    def pump() -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                on_line(raw.decode(errors="replace").rstrip("\r\n"))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def terminate(
    procs: Sequence[subprocess.Popen],
    wait_s: float,
    interrupt: Interrupt | None = None,
    console: Console | None = None,
) -> bool:
    """SIGTERMs `procs` (their groups) and waits up to `wait_s` for them to exit.

    Returns False when a second signal (`interrupt.count > 1`) asked to kill them at once.
    """
    for proc in procs:  # a process that ended may have left children behind: signal them all
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if interrupt is not None and interrupt.count > 1:
            if console is not None:
                console.log("killing them now")
            return False
        time.sleep(POLL_S)
    return True


def reap(procs: Sequence[subprocess.Popen], pumps: Sequence[threading.Thread] = ()) -> None:
    """SIGKILLs what is left of each of `procs`' groups, waits for each, joins their `pumps`."""
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        proc.wait()
    for pump in pumps:
        pump.join(timeout=1.0)  # its pipe closed with the last process of the group


class Group:
    """Named child processes started together, their output on one console, stopped together."""

    def __init__(self, console: Console | None = None, forks: forkserver.Client | None = None):
        """Args:
        console: where their output lines go, each prefixed with its name.
        forks: forks each from its server, named (`/proc/PID/comm`) by its name;
          None: each a process of its own (`start_process`).
        """
        self.console = console or Console()
        self.procs: dict[str, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._forks = forks

    def start(self, name: str, command: Sequence[str], env: dict[str, str]) -> None:
        """Starts `command` as `name`."""
        on_line = functools.partial(self.console.write, name)
        if self._forks is None:
            proc, pump = start_process(command, env, on_line)
        else:
            proc, pump = self._forks.start(command, env, on_line, name=name)
        self.procs[name] = proc
        self._pumps.append(pump)

    def ended(self) -> list[tuple[str, int]]:
        """The processes that have exited, with their exit codes."""
        return [(name, p.returncode) for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, wait_s: float) -> None:
        """SIGTERM to each, SIGKILL to those still there after `wait_s`; every one reaped."""
        procs = list(self.procs.values())
        terminate(procs, wait_s)
        reap(procs, self._pumps)
        self._pumps.clear()


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Sends `sig` to the process group `proc` leads (see `start_process`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(proc.pid, sig)


class Interrupt:
    """SIGINT or SIGTERM reaching the launcher; its wait loops check `signal` between polls.

    The handler only records the signal. Raising from it could land inside
    `subprocess` bookkeeping (between taking and releasing a process's wait lock),
    and the cleanup's `wait()` would then block for ever.
    """

    def __init__(self) -> None:
        self.signal: int | None = None  # the first one: what the exit status reports
        self.count = 0  # how many arrived: a second one cuts the members' grace short

    @property
    def code(self) -> int:
        """The launcher's exit status: 128 + the signal number."""
        return 128 + (self.signal or 0)

    @contextlib.contextmanager
    def catching(self) -> Iterator[Interrupt]:
        """Records SIGINT and SIGTERM while the block runs, instead of dying of them."""

        def handler(sig: int, frame: object) -> None:
            self.count += 1
            if self.signal is None:  # a second Ctrl-C must not change what is reported
                self.signal = sig

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in previous.items():  # after a signal, more (a second Ctrl-C) are ignored
                signal.signal(s, h if self.signal is None else signal.SIG_IGN)


def pick_ports(count: int, base: int = 0) -> list[int]:
    """`count` ports on 127.0.0.1 that are free now.

    Picked ports lie below the kernel's ephemeral range: a port the OS would hand
    out as the source of an outgoing connection (any member's gRPC channel) can be
    taken by one between this check and the server's bind.

    Args:
      count: how many ports.
      base: 0 picks free ones at random; otherwise `base`, `base + 1`, ..., each checked.

    Raises:
      UserError: a port from `base` on is out of range or in use.
    """
    if not base:
        return _free_ports(count)
    if not 1 <= base <= 65536 - count:
        raise UserError(
            f"`--port_base` ({base}) must leave room for {count} ports from 1 to 65535; "
            "pass a smaller one, or 0 to pick free ports."
        )
    for port in range(base, base + count):
        try:
            _bind(port).close()
        except OSError as e:
            problem = (
                "is already in use"
                if e.errno == errno.EADDRINUSE
                else f"cannot be used ({e.strerror})"
            )
            raise UserError(
                f"port {port} on {LOOPBACK} {problem}; pass another `--port_base`, "
                "or 0 to pick free ports."
            ) from None
    return list(range(base, base + count))


def _free_ports(count: int) -> list[int]:
    if count == 0:
        return []
    low = min(_ephemeral_start(), 65536)
    if low - PICKED_FROM < 1000:  # a kernel that hands out nearly every port: let it pick
        with contextlib.ExitStack() as stack:
            return [stack.enter_context(_bind(0)).getsockname()[1] for _ in range(count)]
    candidates = random.sample(range(PICKED_FROM, low), k=min(low - PICKED_FROM, 4 * count + 64))
    with contextlib.ExitStack() as stack:  # held open together, so no port repeats
        ports = []
        for port in candidates:
            try:
                stack.enter_context(_bind(port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise UserError(f"found no {count} free ports on {LOOPBACK} from {PICKED_FROM} to {low - 1}.")


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (32768 where unknown)."""
    try:
        return int(pathlib.Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are free
        s.bind((LOOPBACK, port))
    except OSError:
        s.close()
        raise
    return s


def member_pid(task_type: str, index: int, marker: str) -> int | None:
    """The live process that is this member of a local cluster, whose command holds `marker`.

    A member is known by its `TF_CONFIG`, or, forked by `towerflow.forkserver`
    (whose environment it shows), by its name, `TYPE:INDEX`. For tests and the
    benchmark, which signal one member of a local cluster.
    """
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if marker not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            if member_identity(int(proc.name)) == {"type": task_type, "index": index}:
                return int(proc.name)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return None


def member_identity(pid: int) -> dict | None:
    """The `{"type", "index"}` of the member `pid` is, from its `TF_CONFIG` or its name."""
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    for entry in environ.split("\0"):
        if entry.startswith("TF_CONFIG="):
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not a member's
                return json.loads(entry.removeprefix("TF_CONFIG="))["task"]
            return None
    name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    task_type, _, index = name.partition(":")
    return {"type": task_type, "index": int(index)} if index.isdigit() else None
