"""Members forked from the server run as processes of their own would (`towerflow.forkserver`).

A driver process (the launcher's role) starts three members of
`tests.fork_probe` through one server: each sees its own arguments,
environment, working directory and session, has its own name and random state,
and exits with its own status; an error of its own shows its own traceback.
A fourth, with forking off (`--nofork_members`), is a process of its own.
A launcher forked with a server for it (`server=True`, as the tests fork
`trainer.launch`) forks its members from that server, which imported nothing again.
A server that preloads towerflow's modules gives its members towerflow's own,
not a package of the same name in their working directory.
"""

import json
import os
import sys

import pytest

from tests import helpers

DRIVER = """
import json, os, sys
from towerflow import forkserver

client = forkserver.Client()
client.enabled = True
results = []
for index, extra in enumerate([[], ["--exit=3"], ["--raise"], []]):
    lines = []
    env = {**os.environ, "TF_CONFIG": json.dumps({"task": {"type": "worker", "index": index}})}
    command = [sys.executable, "-m", "tests.fork_probe", f"--n={index}", *extra]
    proc, pump = client.start(command, env, lines.append)
    code = proc.wait(timeout=120)
    pump.join(5)
    results.append({"forked": isinstance(proc, forkserver.Forked), "code": code, "lines": lines})
    client.enabled = index < 2  # as `--nofork_members` leaves it: the last, a process of its own
client.close()
print(json.dumps(results))
"""


def _value(lines: list[str], key: str) -> str:
    return next(line.split(" ", 1)[1] for line in lines if line.startswith(key + " "))


def test_forked_members_run_as_processes_of_their_own(tmp_path):
    result = helpers.run_command([sys.executable, "-c", DRIVER], str(tmp_path))
    helpers.assert_exit(result)
    members = json.loads(result.stdout.splitlines()[-1])
    assert [m["forked"] for m in members] == [True, True, True, False]
    assert [m["code"] for m in members] == [0, 3, 1, 0]
    for index, member in enumerate(members):
        lines = member["lines"]
        assert json.loads(_value(lines, "argv"))[0] == f"--n={index}"
        assert _value(lines, "cwd") == str(tmp_path)
        assert json.loads(_value(lines, "task")) == {"type": "worker", "index": index}
        assert _value(lines, "session_leader") == "True"
    assert [_value(m["lines"], "name") for m in members[:3]] == ["worker:0", "worker:1", "worker:2"]
    assert _value(members[3]["lines"], "name") != "worker:3"  # an interpreter's own name
    assert len({_value(m["lines"], "random") for m in members}) == 4
    traceback = "\n".join(members[2]["lines"])
    assert "RuntimeError: the member's own error" in traceback
    assert "fork_probe.py" in traceback and "in _fail" in traceback
    assert "forkserver.py" not in traceback


PRELOAD_DRIVER = """
import json, os, sys
from towerflow import forkserver

client = forkserver.Client(preload=["strategies", "no_such_module"])
client.enabled = True
lines = []
env = {**os.environ, "TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 0}})}
proc, pump = client.start([sys.executable, "-m", "tests.fork_probe"], env, lines.append)
print(json.dumps({"forked": isinstance(proc, forkserver.Forked), "code": proc.wait(timeout=120)}))
pump.join(5)
print("\\n".join(lines))
client.close()
"""


def test_a_preloaded_module_is_towerflows_own_not_the_working_directorys(tmp_path):
    # A user's project with a package named like one of ours, where the members run.
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "__init__.py").write_text(
        "raise ImportError('a package of the user')\n"
    )
    result = helpers.run_command([sys.executable, "-c", PRELOAD_DRIVER], str(tmp_path))
    helpers.assert_exit(result)
    report, *lines = result.stdout.splitlines()
    # A module that does not import (`no_such_module`) is left to the members.
    assert json.loads(report) == {"forked": True, "code": 0}, result.stdout
    origin = _value(lines, "strategies")
    assert origin.endswith(os.path.join("strategies", "__init__.py"))
    assert not origin.startswith(str(tmp_path))


LAUNCHER_DRIVER = """
import os, sys
from towerflow import forkserver

client = forkserver.Client(label=["the driver's server"])
client.enabled = True
read, write = os.pipe()
launcher = [sys.executable, "-m", "tests.fork_launcher", *sys.argv[1:]]
proc = client.fork(launcher, dict(os.environ), [write], server=True)
os.close(write)
with os.fdopen(read) as output:
    print(output.read().splitlines()[-1])
print(proc.wait(timeout=120))
client.close()
"""


@pytest.mark.parametrize("network", ["host", "loopback"])
def test_a_launchers_members_fork_from_a_server_forked_with_it(tmp_path, network):
    flags = ["--loopback"] if network == "loopback" else []
    command = [sys.executable, "-c", LAUNCHER_DRIVER, *flags]
    result = helpers.run_command(command, str(tmp_path))
    helpers.assert_exit(result)
    report, code = result.stdout.splitlines()[-2:]
    launcher = json.loads(report)
    assert code == "0" and launcher["forked"] and launcher["code"] == 4, result.stdout
    # Forked from the driver's server, the launcher shows its command line, and so does
    # the member: its server was forked from the launcher, not started (and imported) anew;
    # where the launcher moved to a loopback-only network, its server followed it there.
    assert launcher["cmdline"][-1] == "the driver's server"
    assert json.loads(_value(launcher["lines"], "cmdline")) == launcher["cmdline"]
    assert _value(launcher["lines"], "net") == launcher["net"]
    assert (launcher["net"] == os.readlink("/proc/self/ns/net")) == (network == "host")
    assert _value(launcher["lines"], "name") == "worker:0"
