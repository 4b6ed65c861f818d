"""`multi_worker`: real worker processes on 127.0.0.1, through the launcher."""

import json
import os
import re
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from strategies.cluster import tf_config as cluster
from tests.helpers import (
    TIMEOUT_S,
    assert_exit,
    checkpoint_values,
    cli_in_process,
    kill,
    launch_and_signal,
    launched,
    pid_of,
    start_cli,
    start_member,
)
from trainer.launch import pick_ports

# Port 9 of the loopback address (discard) is closed: traffic sent through this "proxy"
# would fail, so a cluster that trains with it set proves its traffic goes direct.
PROXY = {"http_proxy": "http://127.0.0.1:9", "grpc_proxy": "http://127.0.0.1:9"}
# The default job, made deterministic (no dropout) and with 3 steps to each iteration of a
# loop (each step's all-reduce in the same iteration): the same model as one step an iteration.
DETERMINISTIC = [
    "--config.train.steps=300",
    "--config.train.steps_per_loop=0",  # auto: measured per worker, then agreed on
    "--config.eval.every=0",
    "--config.model.dropout=0",
    "--config.train.steps_per_iteration=3",
]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two workers train the default job (`DETERMINISTIC`), proxy variables set: one cluster."""
    cwd = tmp_path_factory.mktemp("mw")
    with pytest.MonkeyPatch.context() as env:
        for name, value in PROXY.items():
            env.setenv(name, value)
        env.delenv("no_proxy", raising=False)
        env.delenv("no_grpc_proxy", raising=False)
        result = launched(
            "--workers=2",
            "--",
            "--strategy=multi_worker",
            "--model_dir=run",
            *DETERMINISTIC,
            cwd=str(cwd),
        )
    return cwd, result


def test_two_workers_train_the_default_job(two_workers):
    cwd, result = two_workers
    results = json.loads((cwd / "run" / "results.json").read_text())
    assert results["step"] == 300
    assert results["eval"]["accuracy"] >= 0.9
    assert results["eval"]["examples"] == 360
    assert results["placement"]["strategy"] == "multi_worker"
    assert results["placement"]["replicas_in_sync"] == 2
    assert "2 worker process(es)" in results["placement"]["communication"]
    # Only the chief reports and writes; the other worker's files went to a temporary place.
    assert "[worker:0] train | step: 300/300" in result.stdout
    assert "[worker:1] train |" not in result.stdout
    names = sorted(os.listdir(cwd / "run"))
    events = [n for n in names if n.startswith("events.out.tfevents.")]
    assert len(events) == 1  # the run's hyper-parameters, for TensorBoard's HParams dashboard
    assert [n for n in names if n not in events] == [
        "checkpoints",
        "config.json",
        "eval",
        "export",
        "results.json",
        "train",
        "variables.json",
    ]
    assert sorted(os.listdir(cwd)) == ["run"]


def test_a_cluster_trains_with_proxy_variables_set(two_workers):
    cwd, result = two_workers
    assert "[worker:0] warning: `grpc_proxy`, `http_proxy` set;" in result.stdout
    assert json.loads((cwd / "run" / "results.json").read_text())["step"] == 300


def test_two_workers_match_mirrored_over_two_cpus(two_workers, tmp_path, capsys):
    cluster_dir, _ = two_workers
    # In this process, over 2 of its 4 logical CPUs: the same 2 replicas, the same model.
    code, _, err = cli_in_process(
        "--strategy=mirrored",
        "--config.strategy.mirrored.devices=/device:CPU:0,/device:CPU:1",
        f"--model_dir={tmp_path / 'mirrored'}",
        *DETERMINISTIC,
        "--config.train.export=False",  # the weights are compared: no export needed
        capsys=capsys,
    )
    assert code == 0, err[-3000:]
    a, b = checkpoint_values(cluster_dir / "run"), checkpoint_values(tmp_path / "mirrored")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_malformed_tf_config_is_one_line(tmp_path, capsys, monkeypatch):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:99999"]}, "task": {}}')
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_in_process("--strategy=multi_worker", capsys=capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "`TF_CONFIG`" in lines[0] and "99999" in lines[0], err
    assert not (tmp_path / "runs").exists()


FAULT_RUN = [
    "--config.train.steps=200",
    "--config.train.steps_per_loop=20",
    "--config.train.checkpoint_every=40",
    "--config.eval.every=0",
    "--config.train.export=False",
]


def _fault_run(tmp_path, sig):
    """Two workers with `--restarts=1`; `sig` goes to worker:1 once step 120 is reported."""
    code, lines, sent = launch_and_signal(
        "--workers=2",
        "--restarts=1",
        "--",
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        *FAULT_RUN,
        cwd=tmp_path,
        trigger="[worker:0] train | step: 120/",
        member=("worker", 1),
        sig=sig,
    )
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert "[launch] restarting cluster (attempt 2 of 2)" in output
    assert "[worker:0] train | step: 200/200" in output
    return lines, sent, output


def _named(lines: list[tuple[float, str]], by: str, lost: str) -> tuple[float, str]:
    """The first (second, line) in which member `by` says member `lost` (its address) stopped."""
    pattern = rf"\[{by}\] error: {lost} \(127\.0\.0\.1:\d+\) stopped answering"
    named = [(t, line) for t, line in lines if re.match(pattern, line)]
    assert named, "\n".join(line for _, line in lines)[-3000:]
    return named[0]


@pytest.mark.slow  # a cluster stopped, then rerun
def test_sigterm_to_one_worker_saves_all_at_one_step_and_the_restart_loses_none(tmp_path):
    _, _, output = _fault_run(tmp_path, signal.SIGTERM)
    steps = {
        worker: int(step)
        for worker, step in re.findall(
            r"\[(worker:\d)\] preempted \(SIGTERM.*?at step (\d+)", output
        )
    }
    assert set(steps) == {"worker:0", "worker:1"}, output[-3000:]
    assert steps["worker:0"] == steps["worker:1"] >= 120
    step = steps["worker:0"]
    assert (
        f"[worker:0] restored {tmp_path / 'run' / 'checkpoints' / f'ckpt-{step}'} at step {step}"
        in output
    )


@pytest.mark.slow  # waits out the timeout, then a rerun
def test_a_killed_peer_is_named_within_the_timeout_and_the_cluster_resumes(tmp_path):
    lines, sent, output = _fault_run(tmp_path, signal.SIGKILL)
    seconds, line = _named(lines, "worker:0", "worker:1")
    assert seconds - sent < 120, "named within a bound (generous: the machine may be loaded)"
    step = int(re.search(r"resumes from \S*ckpt-(\d+)", line).group(1))
    assert step >= 40 and f"ckpt-{step} at step {step}" in output


def _threads(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.slow  # a 600-step soak
def test_each_workers_thread_count_stays_flat_over_many_steps(tmp_path):
    # Any per-collective timeout made TensorFlow keep one sleeping thread per
    # collective op: about 8 more threads per step, until the process aborted.
    proc = start_cli(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        "--config.train.steps=600",
        "--config.train.steps_per_loop=10",
        "--config.train.checkpoint_every=500",
        "--config.eval.every=0",
        "--config.train.export=False",
        "--config.model.hidden_units=(16,)",
        cwd=tmp_path,
        module="trainer.launch",
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    samples: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # worker -> (step, threads)
    pids: dict[int, int] = {}
    try:
        while proc.poll() is None:
            steps = [int(m) for m in re.findall(r"step: (\d+)/600", "".join(lines[-5:]))]
            if steps and steps[-1] >= 100:
                for worker in (0, 1):
                    pids[worker] = pids.get(worker) or pid_of("worker", worker, proc)
                    count = pids[worker] and _threads(pids[worker])
                    if count:
                        samples[worker].append((steps[-1], count))
            time.sleep(0.2)
        reader.join(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    output = "".join(lines)
    assert_exit(proc, output=output[-3000:])
    assert "step: 600/600" in output
    for worker, seen in samples.items():
        assert seen and seen[-1][0] - seen[0][0] >= 400, (worker, seen, output[-2000:])
        first, most = seen[0][1], max(count for _, count in seen)
        assert most - first <= 16, f"worker:{worker} threads grew from {first} to {most}: {seen}"


@pytest.mark.slow  # waits out the hang bound
def test_a_hung_chief_is_named_and_its_peer_exits(tmp_path):
    # A stopped process still accepts TCP connections (the kernel does), but its
    # server replies to nothing; the coordination service's leader is the chief.
    code, lines, sent = launch_and_signal(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        "--config.train.steps=100000",
        "--config.train.steps_per_loop=20",
        "--config.eval.every=0",
        "--config.train.export=False",
        cwd=tmp_path,
        trigger="[worker:0] train | step: 100/",
        member=("worker", 0),
        sig=signal.SIGSTOP,
    )
    seconds, _ = _named(lines, "worker:1", "worker:0")
    assert seconds - sent < 120, "named within a bound, not after TensorFlow's hour"
    assert "[launch] worker:1 exited with code 144" in "\n".join(line for _, line in lines)
    assert code != 0


def test_workers_that_restored_different_steps_stop_with_one_line(two_workers, tmp_path):
    trained, _ = two_workers
    shutil.copytree(trained / "run" / "checkpoints", tmp_path / "run" / "checkpoints")
    # A rerun where worker 1 sees another `model_dir`, as when it is not shared.
    addresses = [f"127.0.0.1:{port}" for port in pick_ports(2)]
    procs = [
        start_member(
            cluster.make_tf_config({"worker": addresses}, "worker", index),
            "--strategy=multi_worker",
            f"--model_dir={model_dir}",
            "--config.train.steps=400",
            "--config.eval.every=0",
            "--config.model.dropout=0",  # the model of the checkpoints
            cwd=tmp_path,
        )
        for index, model_dir in enumerate(["run", "elsewhere"])
    ]
    try:
        results = [proc.communicate(timeout=TIMEOUT_S) for proc in procs]
    finally:
        kill(*procs)
    for proc, (out, err) in zip(procs, results, strict=True):
        lines = [line for line in err.splitlines() if line.strip()]
        assert_exit(proc, 2, output=out[-2000:] + err[-3000:])
        assert len(lines) == 1, err
        assert "the workers restored different steps" in lines[0]
        assert "worker:0 step 300, worker:1 step 0" in lines[0] and "not shared" in lines[0]
