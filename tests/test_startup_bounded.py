"""Every start-up of a cluster member ends: a host that cannot work, TensorFlow's join, SIGTERM.

Bad input of the cluster kind, run as a user runs it (a member of its own with
its `TF_CONFIG`, forked from the tests' server: `run_cli`, and `tests.forked`
where the test reads its output as it comes to signal it): an own host that
does not resolve is one line and exit 2 before TensorFlow starts; TensorFlow's
own join of the cluster (here: this member's address is another machine's, so
it waits for itself there) ends at the start-up bound with one line and exit
144, and SIGTERM during it exits 143 at once.
"""

import os
import signal
import time
from subprocess import CompletedProcess

import pytest

from strategies.cluster import tf_config as cluster
from tests.forked import Forked
from tests.helpers import assert_exit, run_cli
from towerflow.errors import UserError
from trainer.launch import pick_ports

BOUND_S = 90  # far above each case's own bound: TensorFlow's import on a loaded machine
UNROUTED = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine
LONG_HOST = "x" * 300


def _tf_config(host: str, strategy: str) -> str:
    ports = pick_ports(3)
    if strategy == "parameter_server":
        jobs = {
            "chief": [f"{host}:{ports[0]}"],
            "worker": [f"127.0.0.1:{ports[1]}"],
            "ps": [f"127.0.0.1:{ports[2]}"],
        }
        return cluster.make_tf_config(jobs, "chief", 0)
    return cluster.make_tf_config({"worker": [f"{host}:{ports[0]}"]}, "worker", 0)


def _member(monkeypatch, tmp_path, tf_config: str, *args: str) -> tuple[CompletedProcess, float]:
    """Runs a member with `tf_config` to its end (forked, as `run_cli` runs a command); its time."""
    monkeypatch.setenv("TF_CONFIG", tf_config)
    start = time.monotonic()
    result = run_cli(
        *args, "--model_dir=run", cwd=str(tmp_path), timeout=BOUND_S, keep_tf_config=True
    )
    return result, time.monotonic() - start


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "host,strategy",
    [
        ("nosuchhost.invalid", "multi_worker"),
        (LONG_HOST, "multi_worker"),
        ("nosuchhost.invalid", "parameter_server"),
    ],
    ids=["unknown-host", "long-garbage-host", "unknown-chief-host-ps"],
)
def test_an_own_host_that_does_not_resolve_is_one_line_and_exit_2(
    monkeypatch, tmp_path, host, strategy
):
    result, took = _member(
        monkeypatch, tmp_path, _tf_config(host, strategy), f"--strategy={strategy}"
    )
    assert_exit(result, 2)
    line = _one_line(result.stderr)
    assert line.startswith("error: `TF_CONFIG` gives this member"), line
    assert "its host does not resolve here" in line and "its own machine" in line, line
    assert len(line) < 400, "a long host is shortened"
    assert not (tmp_path / "run").exists()
    assert took < BOUND_S


def test_tensorflows_own_join_of_the_cluster_ends_at_the_bound_with_exit_144(monkeypatch, tmp_path):
    result, took = _member(
        monkeypatch,
        tmp_path,
        _tf_config(UNROUTED, "multi_worker"),
        "--strategy=multi_worker",
        "--config.strategy.multi_worker.startup_timeout_seconds=3",
    )
    assert_exit(result, 144)
    out = result.stdout
    line = _one_line(result.stderr)
    assert line.startswith("error: TensorFlow did not join the cluster within 3 s as worker:0"), (
        line
    )
    assert "`strategy.multi_worker.startup_timeout_seconds` sets this wait" in line
    assert f"this member's host `{UNROUTED}`" in out and "no address of this machine" in out, out
    assert "waiting for TensorFlow to join the cluster as worker:0 (at most 3 s)" in out, out
    assert not (tmp_path / "run").exists()
    assert took < BOUND_S


def test_sigterm_while_tensorflow_joins_the_cluster_exits_143_at_once(tmp_path):
    member = Forked(
        "trainer", "--strategy=multi_worker", "--model_dir=run",  # the default bound: 120 s
        cwd=str(tmp_path), env={"TF_CONFIG": _tf_config(UNROUTED, "multi_worker")},
        output=tmp_path / "output",
    )  # fmt: skip
    member.start()
    for line in member.lines():
        if line.startswith("waiting for TensorFlow to join the cluster"):
            break
    time.sleep(1)  # well inside TensorFlow's call, its own SIGTERM handler installed
    sent = time.monotonic()
    os.kill(member.pid, signal.SIGTERM)
    member.join(timeout=BOUND_S)
    took = time.monotonic() - sent
    out = member.output()
    assert member.result, out
    assert_exit(member.result, 143, output=out)
    assert "SIGTERM while TensorFlow joined the cluster: stopping" in out
    assert took < 10, "stops at the signal, not at the end of the bound"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("host", ["nosuchhost.invalid", LONG_HOST, "a..b"])
def test_check_own_host_refuses_a_host_that_cannot_resolve(host):
    spec = cluster.parse(cluster.make_tf_config({"worker": [f"{host}:2222"]}, "worker", 0))
    with pytest.raises(UserError, match="does not resolve here"):
        cluster.check_own_host(spec)


def test_check_own_host_takes_this_machine():
    spec = cluster.parse(cluster.make_tf_config({"worker": ["localhost:2222"]}, "worker", 0))
    cluster.check_own_host(spec)
    assert cluster._not_this_machine(spec) is None
