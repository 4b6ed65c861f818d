"""`python -m tests.forked [--netns=NS] [--output=FILE] [NAME=VALUE...] MODULE ARGS...`.

`python -m MODULE ARGS`, for a command that a test forks from the tests' server
(`tests.helpers.run_cli`: TensorFlow imported once) where it would otherwise
start a process anew to have:
- its own variables (`NAME=VALUE`: a member's `TF_CONFIG`);
- a simulated host's network (`--netns`, a namespace of `trainer.bench.hosts`):
  what `ip netns exec NS` does for the network, no more (no /etc/hosts of the
  namespace is mounted: hosts are reached by address). A process of one thread
  joins whole, and TensorFlow's servers, started after, listen there;
- its output followed as it comes (`--output`): its stdout and stderr go to
  FILE, after a first line with its pid.

`Forked` is the test's side: the command run to its end in a thread.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import runpy
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from tests import helpers

_CLONE_NEWNET = 0x40000000  # setns(2)
NETNS_RUN = "/run/netns"  # where `ip netns add` keeps a namespace


class Forked(threading.Thread):
    """`python -m MODULE ARGS` forked from the tests' server and run to its end, in a thread.

    `start()` returns once the process runs (on its host, with `namespace`; its pid
    known, with `output`), so that the first fork, which starts the tests' server,
    is done before another begins. Once the thread ends, `result` holds the
    command's `CompletedProcess` (None: it ran over `timeout` seconds; None for
    `timeout`: no bound, for a server that runs until the test or module ends).
    """

    def __init__(
        self,
        module: str,
        *args: str,
        cwd: str,
        namespace: str | None = None,
        output: pathlib.Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = helpers.TIMEOUT_S,
    ):
        super().__init__(daemon=True)
        options = [f"--netns={namespace}"] if namespace else []
        options += [f"--output={output}"] if output else []
        variables = [f"{name}={value}" for name, value in (env or {}).items()]
        self.command = [*options, *variables, module, *args]
        self.namespace, self.output_file, self.cwd = namespace, output, cwd
        self.timeout = timeout
        self.result: subprocess.CompletedProcess | None = None
        self.pid: int | None = None

    def run(self) -> None:
        self.result = helpers.run_cli(
            *self.command, cwd=self.cwd, module=__name__, timeout=self.timeout
        )

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + helpers.TIMEOUT_S
        while self.is_alive() and not self._running():
            assert time.monotonic() < deadline, f"{self.command} never started"
            time.sleep(0.05)

    def _running(self) -> bool:
        if self.output_file and self.pid is None:
            first = self.output_file.read_bytes() if self.output_file.exists() else b""
            if b"\n" not in first:
                return False
            self.pid = int(first.split(b"\n")[0].removeprefix(b"pid "))
        return not self.namespace or bool(_pids(self.namespace))

    def lines(self) -> Iterator[str]:
        """Each line of its output (`output`) as it comes, until it has ended."""
        with open(self.output_file, "rb") as output:
            output.readline()  # its pid
            pending = b""
            while True:
                ended = not self.is_alive()  # then all it wrote is in the file
                *complete, pending = (pending + output.read()).split(b"\n")
                yield from (line.decode(errors="replace") for line in complete)
                if ended:
                    if pending:
                        yield pending.decode(errors="replace")
                    return
                if not complete:
                    time.sleep(0.02)

    def output(self) -> str:
        """What it printed once ended (with `output`, the file as it stands); "" before."""
        if self.output_file:
            return self.output_file.read_text().partition("\n")[2]
        return self.result.stdout + self.result.stderr if self.result else ""


def _pids(namespace: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return listed.stdout.split()


def join(namespace: str) -> None:
    """Moves this process (its calling thread) into the network namespace `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_RUN, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    while argv[0].startswith("--"):
        option, _, value = argv.pop(0).partition("=")
        if option == "--netns":
            join(value)
        elif option == "--output":
            fd = os.open(value, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, f"pid {os.getpid()}\n".encode())
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    while "=" in argv[0]:
        name, _, value = argv.pop(0).partition("=")
        os.environ[name] = value
    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
