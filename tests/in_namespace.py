"""`python -m tests.in_namespace NAMESPACE [NAME=VALUE...] MODULE ARGS...`: a module on a host.

What `ip netns exec NAMESPACE env NAME=VALUE python -m MODULE ARGS...` runs, for
a command that `tests.helpers.run_cli` forks from the tests' server (TensorFlow
imported once): this process joins the network namespace of a simulated host
(`trainer.bench.hosts`), sets the variables (a member's `TF_CONFIG`), and runs
the module as `python -m` would. Only the network is the host's: unlike `ip
netns exec`, no /etc/hosts of the namespace is mounted, so hosts are reached
by address. A process of one thread joins whole; TensorFlow's servers, started
after, listen in the namespace.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import subprocess
import sys
import threading
import time

_CLONE_NEWNET = 0x40000000  # setns(2)
NETNS_RUN = "/run/netns"  # where `ip netns add` keeps a namespace


class OnHost(threading.Thread):
    """`python -m MODULE ARGS` run on a host to its end, in a thread: the test's side.

    `start()` returns once the process is in the namespace, so that the first
    fork (which starts the tests' server) is done before another begins. Once
    the thread ends, `result` holds the command's `CompletedProcess` (None:
    it ran over `tests.helpers.TIMEOUT_S`).
    """

    def __init__(
        self, namespace: str, module: str, *args: str, cwd: str, env: dict[str, str] | None = None
    ):
        super().__init__(daemon=True)
        variables = [f"{name}={value}" for name, value in (env or {}).items()]
        self.command = [namespace, *variables, module, *args]
        self.namespace, self.cwd = namespace, cwd
        self.result: subprocess.CompletedProcess | None = None

    def run(self) -> None:
        from tests import helpers

        self.result = helpers.run_cli(*self.command, cwd=self.cwd, module=__name__)

    def start(self) -> None:
        from tests import helpers

        super().start()
        deadline = time.monotonic() + helpers.TIMEOUT_S
        while self.is_alive() and not _pids(self.namespace):
            assert time.monotonic() < deadline, f"{self.command} never reached its host"
            time.sleep(0.05)

    def output(self) -> str:
        """What it printed (stdout, then stderr), once ended; "" before."""
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
    namespace, *rest = argv
    while rest and "=" in rest[0]:
        name, _, value = rest.pop(0).partition("=")
        os.environ[name] = value
    module, *args = rest
    join(namespace)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
