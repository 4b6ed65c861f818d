"""A member for `tests/test_forkserver.py`: prints what a process started as it was would see.

    python -m tests.fork_probe [--exit=CODE] [--raise]

Under `absl.app.run`, as the trainer: prints its arguments, working directory,
`TF_CONFIG`'s task, session leader, name (`/proc/self/comm`), a random
number, command line, network namespace and where its `strategies` package
came from (None: not imported; the probe does not import it), then exits with
CODE, or raises from a function of its own.
"""

import json
import os
import sys

import numpy as np
from absl import app, flags


def _fail() -> None:
    raise RuntimeError("the member's own error")


def main(argv: list[str]) -> None:
    print("argv", json.dumps(argv[1:]))
    print("cwd", os.getcwd())
    print("task", json.dumps(json.loads(os.environ["TF_CONFIG"])["task"]))
    print("session_leader", os.getsid(0) == os.getpid())
    with open("/proc/self/comm") as comm:
        print("name", comm.read().strip())
    print("random", np.random.rand())
    with open("/proc/self/cmdline", "rb") as cmdline:  # a forked member's is its server's
        print("cmdline", json.dumps(cmdline.read().decode().rstrip("\0").split("\0")))
    print("net", os.readlink("/proc/self/ns/net"))
    print("strategies", getattr(sys.modules.get("strategies"), "__file__", None))
    if "--raise" in argv:
        _fail()
    codes = [int(a.removeprefix("--exit=")) for a in argv if a.startswith("--exit=")]
    sys.exit(codes[0] if codes else 0)


def _parse(argv: list[str]) -> list[str]:
    flags.FLAGS(argv[:1])  # no flags of its own: its arguments are for `main`
    return argv


if __name__ == "__main__":
    app.run(main, flags_parser=_parse)
