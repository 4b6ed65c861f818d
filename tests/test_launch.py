"""The local cluster launcher, with real processes on 127.0.0.1 (members: `tests.fake_member`)."""

import io
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from strategies.cluster import tf_config as cluster
from tests.helpers import assert_exit, running
from towerflow.errors import UserError
from trainer import launch

REPO = pathlib.Path(__file__).resolve().parent.parent
FAKE = [sys.executable, "-m", "tests.fake_member"]
TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
    """Lets every member import `tests.fake_member`, whatever the working directory."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{path}" if path else str(REPO))


def _pids(pid_dir: pathlib.Path) -> dict[int, str]:
    """The pids the fake members recorded: pid -> "worker:1" or "worker:1 grandchild"."""
    return {int(p.stem): p.read_text() for p in pid_dir.glob("*.pid")}


def _assert_all_dead(pids, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if running(pid)], "processes left behind"


def _run(members, *args, grace_s=10.0, kill_after_s=2.0, report_s=0.5):
    out = io.StringIO()
    start = time.monotonic()
    console = launch.Console(out)
    code = launch.Cluster(members, [*FAKE, *args], console, grace_s, kill_after_s, report_s).run()
    assert time.monotonic() - start < TIMEOUT_S
    return code, out.getvalue()


# Plans.


def _parsed(members):
    return {member.name: cluster.parse(member.tf_config) for member in members}


def test_plan_multi_worker():
    members = launch.plan_cluster(workers=3)
    specs = _parsed(members)
    assert list(specs) == ["worker:0", "worker:1", "worker:2"]
    addresses = [member.address for member in members]
    assert len(set(addresses)) == 3
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in addresses)
    for member, spec in zip(members, specs.values(), strict=True):
        assert spec.as_dict() == {"worker": addresses}
        assert (spec.task_type, spec.task_index, spec.address) == (
            member.type,
            member.index,
            member.address,
        )
    assert [member.is_chief for member in members] == [True, False, False]


def test_plan_parameter_server_with_evaluator():
    members = launch.plan_cluster(workers=2, ps=2, evaluator=True)
    specs = _parsed(members)
    assert list(specs) == ["chief", "worker:0", "worker:1", "ps:0", "ps:1", "evaluator"]
    jobs = specs["chief"].as_dict()
    assert [len(jobs[job]) for job in ("chief", "worker", "ps")] == [1, 2, 2]
    servers = [address for addresses in jobs.values() for address in addresses]
    assert len(set(servers)) == 5 and all(a.startswith("127.0.0.1:") for a in servers)
    assert all(spec.as_dict() == jobs for spec in specs.values())
    assert [name for name, spec in specs.items() if spec.is_chief] == ["chief"]
    evaluator = specs["evaluator"]
    assert evaluator.task_type == "evaluator" and members[-1].address is None  # runs no server
    # Listed for every member, so the chief knows a sidecar evaluates; kept out of `as_dict`.
    assert all(spec.has_evaluator for spec in specs.values())
    assert all("evaluator" in json.loads(t.tf_config)["cluster"] for t in members)


def test_plan_chief_without_ps():
    specs = _parsed(launch.plan_cluster(workers=1, chief=True))
    assert list(specs) == ["chief", "worker:0"]
    assert specs["chief"].is_chief and not specs["worker:0"].is_chief


def test_a_plan_makes_the_same_members_for_each_attempt_and_refuses_negative_restarts():
    plan = launch.LaunchPlan(("python", "-m", "trainer"), workers=2, ps=1, restarts=1)
    first, second = plan.members(), plan.members()
    assert [m.name for m in first] == ["chief", "worker:0", "worker:1", "ps:0"]
    assert [m.name for m in second] == [m.name for m in first]
    assert plan.with_command("--x=1").command == ("python", "-m", "trainer", "--x=1")
    with pytest.raises(UserError, match=r"`--restarts` \(-1\) must be 0 or more"):
        launch.LaunchPlan(("python",), workers=1, restarts=-1)


def test_plan_with_port_base_uses_consecutive_ports():
    for base in random.sample(range(20000, 30000, 10), 5):  # below Linux's ephemeral ports
        try:
            members = launch.plan_cluster(workers=2, ps=1, port_base=base)
        except UserError:  # taken by something else on this machine: try another
            continue
        assert [member.address for member in members] == [f"127.0.0.1:{base + i}" for i in range(4)]
        return
    pytest.fail("no 4 consecutive free ports found")


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(workers=0), "`--workers` (0) must be at least 1"),
        (dict(workers=1, ps=-1), "`--ps` (-1) must be 0 or more"),
        (dict(workers=2, port_base=65535), "`--port_base` (65535) must leave room for 2 ports"),
    ],
)
def test_plan_refuses_bad_values(kwargs, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        launch.plan_cluster(**kwargs)


def test_port_in_use_is_a_user_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as info:
            launch.plan_cluster(workers=2, port_base=port)
    assert str(info.value).startswith(f"port {port} on 127.0.0.1 is already in use; ")
    assert "`--port_base`" in str(info.value)


def test_free_ports_differ_and_lie_below_the_ephemeral_range():
    ports = launch.pick_ports(20)
    # An outgoing connection's source port comes from the ephemeral range: a port
    # there could be taken between the pick and the server's bind.
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert len(set(ports)) == 20 and all(0 < p < low for p in ports), (ports, low)
    assert launch.pick_ports(0) == []


# Running clusters.


def test_output_is_prefixed_and_the_exit_code_is_the_chiefs(tmp_path):
    members = launch.plan_cluster(workers=2)
    code, out = _run(members, f"--pid_dir={tmp_path}", "--exit=worker:0=7@1", "a b")
    assert code == 7
    assert f"[worker:0] member worker:0 args ['--pid_dir={tmp_path}'" in out
    assert "[worker:1] member worker:1 args" in out and "'a b']" in out
    assert "[worker:1] stderr of worker:1" in out
    assert "[launch] worker:0 (the chief) exited with code 7" in out
    _assert_all_dead(_pids(tmp_path))


def test_a_failing_member_stops_the_whole_cluster(tmp_path):
    members = launch.plan_cluster(workers=2, ps=1, evaluator=True)
    code, out = _run(members, f"--pid_dir={tmp_path}", "--grandchild", "--exit=ps:0=3@2")
    assert code == 3
    assert "[launch] ps:0 exited with code 3; letting the chief report (up to 0.5 s)" in out
    assert "[launch] stopping chief, worker:0, worker:1, evaluator" in out
    pids = _pids(tmp_path)
    assert sorted(pids.values()).count("chief:0 grandchild") == 1
    assert len(pids) == 2 * len(members), "every member and its child recorded its pid"
    _assert_all_dead(pids)


def test_a_failing_parameter_server_worker_is_restarted_a_few_times(tmp_path):
    members = launch.plan_cluster(workers=2, ps=1)
    code, out = _run(members, f"--pid_dir={tmp_path}", "--exit=worker:1=3@1")
    for attempt in (1, 2, 3):
        assert f"worker:1 exited with code 3; restarting it (attempt {attempt} of 3)" in out
    assert "[launch] worker:1 exited with code 3; letting the chief report" in out
    assert code == 3
    _assert_all_dead(_pids(tmp_path))


def test_a_member_killed_by_a_signal_fails_the_cluster(tmp_path):
    code, out = _run(launch.plan_cluster(workers=2), "--exit=worker:1=-9@0.5")
    assert code == 128 + 9
    assert "[launch] worker:1 was killed by SIGKILL; letting the chief report" in out


def test_the_chief_may_end_on_its_own_after_a_member_fails(tmp_path):
    code, out = _run(
        # 2 s apart: each time counts from its own start, and a loaded machine starts them apart.
        launch.plan_cluster(workers=2),
        "--exit=worker:1=5@0.2",
        "--exit=worker:0=144@2.2",
        report_s=10.0,
    )
    assert code == 5, "the member that failed first sets the exit status"
    assert "[launch] worker:0 exited with code 144" in out and "stopping" not in out


def test_a_preempted_member_lets_the_others_save_at_the_same_step(tmp_path):
    args = ["--exit=worker:1=143@0.2", "--exit=worker:0=143@1.5"]
    code, out = _run(launch.plan_cluster(workers=2), *args, report_s=0.1)
    assert code == 143
    assert "[launch] worker:1 exited with code 143; letting the others save (up to 10 s)" in out
    assert "[launch] worker:0 exited with code 143" in out and "stopping" not in out


def test_after_the_chief_the_rest_get_a_grace_period_then_sigkill(tmp_path):
    members = launch.plan_cluster(workers=1, ps=1)
    args = [f"--pid_dir={tmp_path}", "--grandchild", "--ignore_term", "--exit=chief:0=0@1"]
    code, out = _run(members, *args, grace_s=0.5, kill_after_s=0.5)
    assert code == 0
    assert "[launch] chief exited with code 0" in out
    assert "[launch] waiting up to 0.5 s for the other members to end" in out
    assert "[launch] stopping worker:0, ps:0" in out
    pids = _pids(tmp_path)
    assert len(pids) == 6
    _assert_all_dead(pids)


def test_members_that_end_with_the_chief_are_not_stopped():
    start = time.monotonic()
    code, out = _run(launch.plan_cluster(workers=2), "--sleep=1", "--exit=worker:0=0@0.5")
    assert code == 0 and "stopping" not in out
    assert time.monotonic() - start < 8, "no wait for the whole grace period"


@pytest.mark.parametrize("evaluator_code, expected", [(0, 0), (4, 4)])
def test_an_evaluator_that_ends_early_fails_the_cluster_only_when_non_zero(
    evaluator_code, expected
):
    members = launch.plan_cluster(workers=1, evaluator=True)
    code, out = _run(members, f"--exit=evaluator:0={evaluator_code}@0.2", "--exit=worker:0=0@2")
    assert code == expected
    assert ("evaluator exited with code 4; letting the chief" in out) == (evaluator_code == 4)


def _launch(tmp_path, *args, restarts):
    out = io.StringIO()
    command = [*FAKE, f"--pid_dir={tmp_path}", *args]
    console = launch.Console(out)
    code = launch.launch(command, workers=2, restarts=restarts, console=console, report_s=0.2)
    chiefs = sorted(name for name in _pids(tmp_path).values() if name == "worker:0")
    return code, out.getvalue(), len(chiefs)


def test_restarts_start_a_failed_cluster_again(tmp_path):
    code, out, starts = _launch(tmp_path, "--exit=worker:1=3@0.5", restarts=2)
    assert (code, starts) == (3, 3)
    assert "[launch] restarting cluster (attempt 2 of 3)" in out
    assert "[launch] restarting cluster (attempt 3 of 3)" in out
    _assert_all_dead(_pids(tmp_path))


@pytest.mark.parametrize("chief_code", [0, 2])
def test_success_and_user_errors_are_not_restarted(tmp_path, chief_code):
    exit_flag = f"--exit=worker:0={chief_code}@0.2"
    code, out, starts = _launch(tmp_path, "--sleep=0.5", exit_flag, restarts=2)
    assert (code, starts) == (chief_code, 1)
    assert "restarting" not in out


def test_negative_restarts_are_refused():
    with pytest.raises(UserError, match=re.escape("`--restarts` (-1) must be 0 or more")):
        launch.launch(FAKE, workers=1, restarts=-1)


# The command line.


def _launcher(*args, **kwargs):
    command = [sys.executable, "-m", "trainer.launch", "--module=tests.fake_member", *args]
    return subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def _read_until(proc: subprocess.Popen, text: str) -> str:
    """The launcher's output up to and including the first line holding `text` (asserted)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return "".join(lines)
    raise AssertionError(f"{text!r} never printed:\n" + "".join(lines)[-3000:])


def _rest(proc: subprocess.Popen) -> str:
    """The launcher's output after `_read_until` (its buffer included), once it has exited."""
    rest = proc.stdout.read()
    proc.wait(timeout=TIMEOUT_S)
    return rest


def test_command_line_passes_the_trainer_flags_through(tmp_path):
    proc = _launcher("--workers=2", "--grace_s=5", "--", "--sleep=1", "--exit=worker:0=0@0.5", "x")
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert_exit(proc, output=err)
    assert "[worker:0] member worker:0 args ['--sleep=1', '--exit=worker:0=0@0.5', 'x']" in out
    assert "[worker:1] member worker:1 args" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_every_member(tmp_path, sig):
    proc = _launcher("--workers=2", "--ps=1", "--", f"--pid_dir={tmp_path}", "--grandchild")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_pids(tmp_path)) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_pids(tmp_path)) == 8, "4 members and their children started"
        proc.send_signal(sig)
        got = _read_until(proc, f"[launch] got {sig.name}")
        proc.send_signal(sig)  # pressed twice: the cleanup still runs to the end
        out = got + _rest(proc)
    finally:
        proc.kill()
    assert_exit(proc, 128 + sig, output=out)
    assert f"[launch] got {sig.name}" in out and "[launch] stopping chief" in out
    _assert_all_dead(_pids(tmp_path))


@pytest.mark.parametrize("times", [1, 2])
def test_an_interrupted_cluster_may_save_once_and_is_killed_on_the_second(tmp_path, times):
    save_s = launch.KILL_AFTER_S + 1  # longer than a stop without a signal waits
    proc = _launcher(
        "--workers=2", "--grace_s=30", "--", f"--pid_dir={tmp_path}", f"--save_s={save_s}"
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = _read_until(proc, "to save and exit (signal again to kill them now)")
        if times == 2:
            proc.send_signal(signal.SIGTERM)
        out += _rest(proc)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert_exit(proc, 128 + signal.SIGTERM, output=out)
    assert "up to 30 s to save and exit" in out
    saved = sorted(p.name for p in tmp_path.glob("*.saved"))
    if times == 1:
        assert saved == ["worker:0.saved", "worker:1.saved"] and took >= save_s
    else:
        assert "[launch] killing them now" in out
        assert saved == [] and took < save_s
    _assert_all_dead(_pids(tmp_path))


def test_an_interrupted_parameter_server_cluster_stops_its_servers_after_the_chief_saved(
    tmp_path,
):
    """The chief's last save needs the ps (variables) and workers: they are stopped after it."""
    proc = _launcher(
        "--workers=2", "--ps=1", "--grace_s=30", "--", f"--pid_dir={tmp_path}", "--save_s=1"
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_pids(tmp_path)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert_exit(proc, 128 + signal.SIGTERM, output=out)
    saved = float((tmp_path / "chief:0.saved").read_text())
    stopped = {p.stem: float(p.read_text()) for p in tmp_path.glob("*.term")}
    assert set(stopped) == {"chief:0", "worker:0", "worker:1", "ps:0"}, out
    assert all(stopped[name] >= saved for name in ("worker:0", "worker:1", "ps:0")), out
    _assert_all_dead(_pids(tmp_path))


def _own_lines(stderr: str) -> list[str]:
    """stderr without the C++ log lines TensorFlow prints when imported (no flag stops them)."""
    tf_log = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWEF]\d{4} )")
    return [line for line in stderr.splitlines() if not tf_log.match(line)]


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--workers=0", "error: `--workers` (0) must be at least 1"),
        ("--strategy=mirrored", "error: Unknown command line flag 'strategy'; put the trainer's"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flag, expected):
    proc = _launcher(flag)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert_exit(proc, 2, output=err)
    lines = _own_lines(err)
    assert len(lines) == 1 and lines[0].startswith(expected), err
