"""A launcher for `tests/test_forkserver.py`: one member through a server of its own.

    python -m tests.fork_launcher [--loopback]

Starts `tests.fork_probe --exit=4` through its own `forkserver.Client`, as
`trainer.launch` starts members (with `--loopback`, after moving into a
loopback-only network namespace, as it does by default), and prints one JSON
line: whether the member was forked, its exit status, its lines, and this
process's command line and network namespace.
"""

import json
import os
import sys

from towerflow import forkserver, netns


def main() -> None:
    if "--loopback" in sys.argv:
        netns.loopback_only("the probe's cluster", "--allow_network", [], False, print)
    client = forkserver.Client()
    client.enabled = True
    lines: list[str] = []
    env = {**os.environ, "TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 0}})}
    command = [sys.executable, "-m", "tests.fork_probe", "--exit=4"]
    proc, pump = client.start(command, env, lines.append)
    code = proc.wait(timeout=120)
    pump.join(5)
    client.close()
    with open("/proc/self/cmdline", "rb") as cmdline:
        own = cmdline.read().decode().rstrip("\0").split("\0")
    forked = isinstance(proc, forkserver.Forked)
    net = os.readlink("/proc/self/ns/net")
    print(json.dumps({"forked": forked, "code": code, "lines": lines, "cmdline": own, "net": net}))


if __name__ == "__main__":
    main()
