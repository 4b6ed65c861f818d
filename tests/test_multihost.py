"""Clusters across simulated hosts: a network namespace per host, real addresses, a bridge.

Each member runs the README's per-host command (`TF_CONFIG=... python -m
trainer ...`) in its own namespace (`trainer.bench.hosts`), so members talk over
10.77.0.x addresses through a bridge, as separate machines would, and a link
can be shaped or cut. The default tier's cluster forks that command from the
tests' server into each host (`tests.forked`: TensorFlow imported once,
hosts reached by address); the others start it with `ip netns exec`. The
model_dir is a directory every host sees (the namespaces share the file
system). Needs root and iproute2, and netem or iptables for loss; skipped with
the reason otherwise, except under `.ci/run` (`TOWERFLOW_CI`, as root), where
they must run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from strategies.cluster import tf_config as cluster
from tests.forked import Forked
from tests.helpers import TIMEOUT_S, running
from trainer.bench import hosts as hosts_lib
from trainer.loop import faults

TINY = [
    "--config.train.steps_per_loop=10",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.model.hidden_units=(32,)",
]
# The longest path the README documents for naming a lost member: the watchdog looks once a
# loop has run `WATCHDOG_AFTER_S` (checking every as often), and gives up after `GIVE_UP_S`
# of probes that each wait up to `PROBE_S`. The coordination service's heartbeats name a
# cut-off host sooner (about 12 s here).
DETECTION_BOUND_S = 2 * faults.WATCHDOG_AFTER_S + faults.GIVE_UP_S + 2 * cluster.PROBE_S


def _cannot(reason: str) -> None:
    """Skips, saying why; fails under `.ci/run` (`TOWERFLOW_CI`), which runs as root."""
    (pytest.fail if os.environ.get("TOWERFLOW_CI") else pytest.skip)(reason)


@pytest.fixture
def make_hosts():
    """`make_hosts(count, names=None)`: entered `Hosts`, torn down after the test; or a skip."""
    reason = hosts_lib.available()
    if reason:
        _cannot(f"simulated hosts cannot be made here: {reason}")
    made: list[hosts_lib.Hosts] = []

    def make(count: int, names: list[str] | None = None) -> hosts_lib.Hosts:
        made.append(hosts_lib.Hosts(count, names).__enter__())
        return made[-1]

    yield make
    for hosts in made:
        hosts.close()


def _start(hosts, members, tmp_path, *args: str) -> dict[str, subprocess.Popen]:
    """Each member's per-host command, on its host; its output to `tmp_path/<member>.log`."""
    return {
        member.name: hosts.start_trainer(
            member, args, log=str(tmp_path / f"{member.name}.log"), cwd=str(tmp_path)
        )
        for member in members
    }


def _forked(hosts, members, tmp_path, *args: str) -> dict[str, int | None]:
    """Each member's per-host command forked into its host (`tests.forked`); exit codes.

    Forked from the tests' server as `run_cli` runs commands, TensorFlow imported once;
    each member's output goes to `tmp_path/<member>.log`. None: it ran over `TIMEOUT_S`.
    """
    runs = {}
    for member in members:
        runs[member.name] = Forked(
            "trainer", *args, cwd=str(tmp_path), namespace=hosts.namespaces[member.host],
            env={"TF_CONFIG": member.tf_config},
        )  # fmt: skip
        runs[member.name].start()
    for name, run in runs.items():
        run.join()
        (tmp_path / f"{name}.log").write_text(run.output())
    return {name: run.result.returncode if run.result else None for name, run in runs.items()}


def _wait(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """Each member's exit code, all within `TIMEOUT_S` (generous: a loaded machine)."""
    deadline = time.monotonic() + TIMEOUT_S
    return {name: p.wait(timeout=max(1, deadline - time.monotonic())) for name, p in procs.items()}


def _logs(tmp_path) -> str:
    """Every member's output (its end), for a failure's message."""
    return "\n".join(
        f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(tmp_path.glob("*.log"))
    )


def _trained(
    tmp_path, hosts, layout: dict, steps: int, *args: str, by_name=False, forked=False
) -> dict:
    """Trains a tiny job on `hosts` as `layout` says; every member exits 0. Its results.json.

    `forked`: the members forked from the tests' server (`_forked`), each reaching the
    others by address; else each a process of its own (`ip netns exec`), names resolving.
    """
    members = hosts.cluster(layout, by_name=by_name)
    args = (*args, f"--config.train.steps={steps}", *TINY)
    if forked:
        codes = _forked(hosts, members, tmp_path, *args)
    else:
        codes = _wait(_start(hosts, members, tmp_path, *args))
    assert set(codes.values()) == {0}, _logs(tmp_path)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] == steps
    return results


@pytest.mark.slow  # namespaces; parameter_server on three hosts runs in the default tier
def test_multi_worker_on_two_hosts_by_name(make_hosts, tmp_path):
    hosts = make_hosts(2, names=["trainer-a", "trainer-b"])
    run = f"--model_dir={tmp_path / 'run'}"
    results = _trained(
        tmp_path, hosts, {"worker": [0, 1]}, 40, "--strategy=multi_worker", run, by_name=True
    )
    assert results["placement"]["replicas_in_sync"] == 2
    assert "2 worker process(es)" in results["placement"]["communication"]


def test_parameter_server_on_three_hosts(make_hosts, tmp_path):
    hosts = make_hosts(3)  # the coordinator, a worker and the ps each on a host of its own
    layout = {"chief": [0], "worker": [1], "ps": [2]}
    run = f"--model_dir={tmp_path / 'run'}"
    # The worker and the ps serve until the chief is gone, then exit 0 too.
    # 2 blocks, training only: what is asserted is where the variables lived.
    strategy = ["--strategy=parameter_server", "--mode=train"]
    results = _trained(tmp_path, hosts, layout, 20, *strategy, run, forked=True)
    assert "variables on 1 ps member(s)" in results["placement"]["communication"]
    ps = "/job:ps/replica:0/task:0/device:CPU:0"
    assert results["placement"]["variables"]["dense/kernel"] == [ps]


def _until(condition, procs, tmp_path) -> None:
    """Waits for `condition()` while every member runs (bounded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        running = all(p.poll() is None for p in procs.values())
        assert running and time.monotonic() < deadline, _logs(tmp_path)
        time.sleep(0.05)


@pytest.mark.slow  # waits out the bound
def test_a_cut_link_is_named_on_both_sides_within_the_bound_and_the_rerun_resumes(
    make_hosts, tmp_path
):
    hosts = make_hosts(2)
    members = hosts.cluster({"worker": [0, 1]})
    run = tmp_path / "run"
    args = ["--strategy=multi_worker", f"--model_dir={run}", "--config.train.steps=600", *TINY]
    args.append("--config.train.checkpoint_every=20")
    procs = _start(hosts, members, tmp_path, *args)
    _until((run / "checkpoints" / "checkpoint").exists, procs, tmp_path)
    hosts.set_link(1, up=False)  # worker:1's host is cut off; both processes still run
    cut, ended = time.monotonic(), {}
    while len(ended) < len(procs) and time.monotonic() - cut < TIMEOUT_S:
        for name, proc in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.monotonic() - cut
        time.sleep(0.05)
    hosts.set_link(1, up=True)  # down until both had noticed: longer than it takes
    codes = {name: proc.poll() for name, proc in procs.items()}
    assert codes == {"worker:0": 144, "worker:1": 144}, _logs(tmp_path)
    assert max(ended.values()) < DETECTION_BOUND_S, (ended, _logs(tmp_path))
    resumes = set()
    peers = {"worker:0": "worker:1 (10.77.0.2:2222)", "worker:1": "worker:0 (10.77.0.1:2222)"}
    for member, lost in peers.items():
        log = (tmp_path / f"{member}.log").read_text()
        pattern = rf"^error: {re.escape(lost)} stopped answering .* resumes from (\S+)\.$"
        named = re.search(pattern, log, re.M)
        assert named, log[-3000:]
        resumes.add(named.group(1))
    (checkpoint,) = resumes
    step = int(checkpoint.rpartition("-")[2])
    assert step >= 20

    # The restart recipe: the same commands again, with the same model_dir.
    procs = _start(hosts, members, tmp_path, *args)
    assert _wait(procs) == {"worker:0": 0, "worker:1": 0}, _logs(tmp_path)
    assert f"restored {checkpoint} at step {step}" in (tmp_path / "worker:0.log").read_text()
    assert json.loads((run / "results.json").read_text())["step"] == 600


@pytest.mark.slow  # a shaped, lossy link
def test_a_lossy_rate_limited_link_still_trains_to_the_end(make_hosts, tmp_path):
    hosts = make_hosts(2)
    try:
        hosts.shape(1, rate_mbit=100, loss=0.01)  # both ways: 100 Mbit/s, 1% of packets lost
    except hosts_lib.Unavailable as e:  # no netem and no iptables
        _cannot(str(e))
    run = f"--model_dir={tmp_path / 'run'}"
    _trained(tmp_path, hosts, {"worker": [0, 1]}, 60, "--strategy=multi_worker", run)
    # The training's traffic went through the shaped link, and lost packets on the way.
    counts = hosts.counters(1)
    assert counts["shaped_bytes"] > 100_000 and counts["dropped_packets"] > 0, counts


def _namespaces() -> set[str]:
    return set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )


def _namespace_pids(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split()]


# A process with a descendant in a session of its own; it prints what `b` resolves to there.
_PROCESS = """
import socket, subprocess, time
subprocess.Popen(["sleep", "600"], start_new_session=True)
print(socket.gethostbyname("b"), flush=True)
time.sleep(600)
"""


def test_hosts_are_isolated_and_torn_down_and_a_killed_runs_are_removed():
    reason = hosts_lib.available()
    if reason:
        _cannot(f"simulated hosts cannot be made here: {reason}")
    # A killed run's namespace, a process still in it: its owner's pid is gone.
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{hosts_lib.PREFIX}{gone.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    straggler = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        with hosts_lib.Hosts(2, names=["a", "b"]) as hosts:
            assert stale not in _namespaces() and straggler.wait(timeout=60) == -9
            own = {*hosts.namespaces, hosts.bridge}
            assert own <= _namespaces()
            # None of their addresses or links is in the machine's own namespace.
            addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True)
            assert hosts_lib.SUBNET not in addresses.stdout
            proc = hosts.start(
                1, [sys.executable, "-c", _PROCESS], stdout=subprocess.PIPE, text=True
            )
            assert proc.stdout.readline() == "10.77.0.2\n"  # the name, from its hosts file
            pids = _namespace_pids(hosts.namespaces[1])
            assert len(pids) == 2, pids
    finally:
        straggler.kill()
        straggler.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert not own & _namespaces()
    assert not [pid for pid in pids if running(pid)]
    assert not [n for n in own if os.path.exists(os.path.join(hosts_lib.NETNS_ETC, n))]


@pytest.mark.slow  # waits out the detection of a cut link, then two re-forms
def test_elastic_agents_go_on_without_a_cut_off_host_and_take_it_back_once_reachable(
    make_hosts, tmp_path
):
    hosts = make_hosts(3)
    run = tmp_path / "run"
    args = ["--workers=2:3", "--join_s=3", "--member_port=2222", "--", "--strategy=multi_worker"]
    args += [f"--model_dir={run}", "--config.train.steps=1000000", *TINY]
    args += ["--config.train.global_batch_size=48", "--config.cluster.elastic.cooldown_s=1"]
    procs = {
        f"h{i}": hosts.start_trainer(
            i,
            [f"--name=h{i}", f"--address={hosts.address(i)}", *args],
            log=str(tmp_path / f"h{i}.log"),
            cwd=str(tmp_path),
            module="trainer.elastic",
        )
        for i in range(3)
    }
    log = tmp_path / "h0.log"  # h0's agent and member: the chief in every round here
    _until(lambda: "members: 3" in log.read_text(), procs, tmp_path)
    hosts.set_link(2, up=False)  # h2 is cut off; its agent and member still run
    shrunk = "round 1: group of 2: h0 as worker:0, h1 as worker:1"
    _until(lambda: "members: 2" in log.read_text().partition(shrunk)[2], procs, tmp_path)
    hosts.set_link(2, up=True)
    # A member slow to save under load may miss round 2's join window: a later round takes it.
    grown = ": group of 3: h0 as worker:0, h1 as worker:1, h2 as worker:2"

    def grown_back() -> bool:
        _, found, after = log.read_text().partition(shrunk)[2].rpartition(grown)
        return bool(found) and "members: 3" in after

    _until(grown_back, procs, tmp_path)
    for proc in procs.values():  # the job could go on: stop it, each member saving
        os.killpg(proc.pid, signal.SIGTERM)
    assert set(_wait(procs).values()) == {143}, _logs(tmp_path)
    # Survivors may save steps one apart (one completed a step the other did not): the newest
    # of all their saves is restored (docs/elastic.md), so 0 steps are lost.
    logs = "".join((tmp_path / f"h{i}.log").read_text() for i in range(3))
    saved = re.findall(r"\] elastic: .* saved step (\d+) to", logs)
    restored = re.findall(r"\[h0\] restored \S+ at step (\d+)", log.read_text())
    assert saved and restored[0] == max(saved, key=int), _logs(tmp_path)
