"""Start-up of a cluster member: a bounded wait that names who is missing, proxies, SIGTERM.

A cluster that trains with proxy variables set: tests/test_multi_worker.py (`proxied_pair`).
"""

import math
import os
import signal
import socket
import threading
import time

import pytest

from strategies.cluster import tf_config as cluster
from tests.forked import Forked
from tests.helpers import TIMEOUT_S, assert_exit, run_cli, tiny_config
from towerflow.errors import MemberLost, UserError
from trainer.launch import pick_ports
from trainer.loop import train


def _spec(addresses: list[str], index: int) -> cluster.ClusterSpec:
    return cluster.parse(cluster.make_tf_config({"worker": addresses}, "worker", index))


def test_a_peer_that_never_answers_is_named_then_given_up_on_after_the_bound():
    mine, missing = pick_ports(2)
    spec = _spec([f"127.0.0.1:{mine}", f"127.0.0.1:{missing}"], 0)
    said: list[str] = []
    start = time.monotonic()
    with pytest.raises(MemberLost) as error:
        cluster.start_up(spec, 2.0, "some.setting", report=said.append, interval_s=0.2)
    waited = time.monotonic() - start
    assert said == [f"waiting for worker:1 at 127.0.0.1:{missing}"]
    message = str(error.value)
    assert f"worker:1 at 127.0.0.1:{missing} did not answer within 2 s" in message
    assert (
        "DNS" in message and "`http_proxy`/`grpc_proxy`" in message and "`some.setting`" in message
    )
    assert 2.0 <= waited < 60


def test_a_host_that_does_not_resolve_is_named_at_once():
    (mine,) = pick_ports(1)
    spec = _spec([f"127.0.0.1:{mine}", "no-such-host.invalid:2222"], 0)
    said: list[tuple[float, str]] = []
    start = time.monotonic()
    with pytest.raises(MemberLost, match="no-such-host.invalid:2222 did not answer within 1 s"):
        cluster.start_up(
            spec, 1.0, "s", report=lambda line: said.append((time.monotonic() - start, line))
        )
    assert len(said) == 1, said
    seconds, line = said[0]
    assert line.startswith("waiting for worker:1 at no-such-host.invalid:2222 (`no-such-host")
    assert "does not resolve" in line
    assert seconds < 1.0  # named before the wait is over, not only at its end


def test_members_waiting_for_each_other_all_start():
    # Each holds its own port while it waits, so none waits for a server that
    # only starts once its own wait is over.
    ports = pick_ports(3)
    addresses = [f"127.0.0.1:{port}" for port in ports]
    done: list[int] = []
    servers: list[socket.socket] = []  # what TensorFlow's server is once a member has started

    def start(index):
        time.sleep(index * 0.5)  # members come up at different times
        cluster.start_up(_spec(addresses, index), 60.0, "s", report=lambda _: None, interval_s=0.1)
        servers.append(socket.create_server(("127.0.0.1", ports[index])))
        done.append(index)

    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for server in servers:
        server.close()
    assert sorted(done) == [0, 1, 2]


def test_a_taken_port_is_one_line():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        spec = _spec([f"127.0.0.1:{port}", "127.0.0.1:1"], 0)
        with pytest.raises(UserError, match=f"worker:0.*port {port} cannot be used here"):
            cluster.start_up(spec, 5.0, "s", report=lambda _: None)


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan, math.inf])
def test_the_start_up_timeout_must_be_a_positive_finite_number(timeout):
    spec = _spec(["127.0.0.1:1", "127.0.0.1:2"], 0)
    with pytest.raises(UserError, match="`strategy.multi_worker.startup_timeout_seconds`"):
        cluster.start_up(spec, timeout, "strategy.multi_worker.startup_timeout_seconds")


def test_proxy_variables_are_named_and_the_clusters_hosts_bypass_them():
    spec = cluster.parse(
        cluster.make_tf_config({"worker": ["10.0.0.1:2222", "host-b:2222"]}, "worker", 0)
    )
    environ = {"http_proxy": "http://proxy:3128", "no_proxy": "localhost"}
    warning = cluster.keep_off_proxies(spec, environ)
    assert warning.startswith("warning: `http_proxy` set;")
    assert environ["no_proxy"] == "localhost,10.0.0.1,host-b"
    assert environ["no_grpc_proxy"] == "10.0.0.1,host-b"
    assert cluster.keep_off_proxies(spec, {}) is None


def test_a_non_finite_collective_timeout_is_a_user_error(tmp_path):
    config = tiny_config(**{"strategy.name": "multi_worker"})
    config.strategy.multi_worker.timeout_seconds = math.nan
    with pytest.raises(UserError, match=r"`strategy.multi_worker.timeout_seconds` \(nan\)"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_an_empty_tf_config_means_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "")  # as TensorFlow reads it (a blank one is refused)
    config = tiny_config(**{"strategy.name": "multi_worker", "train.steps": 10})
    results = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert results["step"] == 10
    assert "1 worker process(es)" in results["placement"]["communication"]


def _start_worker_0(tmp_path, missing_port: int, *flags: str) -> Forked:
    """Worker 0 of a two-worker `TF_CONFIG` whose worker 1 never starts, its output followed.

    Forked from the tests' server (`tests.forked`): a member of its own, as a user runs it.
    """
    (mine,) = pick_ports(1)
    tf_config = cluster.make_tf_config(
        {"worker": [f"127.0.0.1:{mine}", f"127.0.0.1:{missing_port}"]}, "worker", 0
    )
    member = Forked(
        "trainer", "--strategy=multi_worker", "--model_dir=run", *flags,
        cwd=str(tmp_path), env={"TF_CONFIG": tf_config}, output=tmp_path / "output",
    )  # fmt: skip
    member.start()
    return member


@pytest.mark.parametrize("strategy", ["multi_worker", "parameter_server"])
def test_the_cli_gives_up_on_missing_members_with_one_line(monkeypatch, tmp_path, strategy):
    chief, worker, ps = pick_ports(3)
    jobs = {"worker": [f"127.0.0.1:{chief}", f"127.0.0.1:{worker}"]}
    missing = [f"worker:1 at 127.0.0.1:{worker}"]
    if strategy == "parameter_server":  # its chief waits for the worker and the ps
        jobs = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"]}
        jobs["ps"] = [f"127.0.0.1:{ps}"]
        missing = [f"worker:0 at 127.0.0.1:{worker}", f"ps:0 at 127.0.0.1:{ps}"]
    # Forked from the tests' server (`run_cli`): a member of its own, as a user runs it.
    tf_config = cluster.make_tf_config(jobs, "chief" if "chief" in jobs else "worker", 0)
    monkeypatch.setenv("TF_CONFIG", tf_config)
    result = run_cli(
        f"--strategy={strategy}",
        "--model_dir=run",
        f"--config.strategy.{strategy}.startup_timeout_seconds=3",
        cwd=str(tmp_path),
        keep_tf_config=True,
    )
    assert_exit(result, 144)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {missing[0]} did not answer within 3 s"), lines[0]
    assert all(f"waiting for {member}" in result.stdout for member in missing), result.stdout
    assert not (tmp_path / "run").exists()


def test_sigterm_while_waiting_for_the_cluster_exits_143_at_once(tmp_path):
    (missing,) = pick_ports(1)
    member = _start_worker_0(tmp_path, missing)  # the default wait: 120 s
    for line in member.lines():
        if line.startswith("waiting for worker:1"):
            break
    sent = time.monotonic()
    os.kill(member.pid, signal.SIGTERM)
    member.join(timeout=TIMEOUT_S)
    took = time.monotonic() - sent
    assert member.result, member.output()
    assert_exit(member.result, 143, output=member.output())
    assert took < 30, "stops at the signal, not at the end of the wait"
