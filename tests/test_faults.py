"""Preemption, loss blow-ups and corrupt checkpoints: no work or data lost."""

import json
import os
import re
import signal
import socket
import threading

import numpy as np
import pytest
import tensorflow as tf

from strategies.cluster import tf_config as cluster
from tests.helpers import assert_exit, cli_in_process, run_cli, tiny_config
from tests.steps_two_replicas import TWO_CPUS
from towerflow import errors
from trainer.loop import faults, lock, train


def _all_checkpoints_finite(model_dir) -> bool:
    state = tf.train.get_checkpoint_state(os.path.join(str(model_dir), "checkpoints"))
    for path in state.all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            value = reader.get_tensor(name)
            if np.issubdtype(np.asarray(value).dtype, np.floating) and not np.all(
                np.isfinite(value)
            ):
                return False
    return True


@pytest.mark.usefixtures("iterators_end_with_the_test")
def test_a_blown_up_loss_recovers_then_stops_cleanly(tmp_path, capsys):
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "optimizer.name": "sgd",
            "optimizer.learning_rate": 1e9,
            "optimizer.warmup_steps": 0,
            "train.loss_upper_bound": 1e3,
            "train.max_recoveries": 2,
        }
    )
    job = train.build(config, str(tmp_path))
    with pytest.raises(faults.Diverged) as e:
        train.run(job, "train")
    out = capsys.readouterr().out
    assert "loss nan blew up" in out  # non-finite first, then above the bound
    assert "recovery 1 of 2" in out and "recovery 2 of 2" in out
    assert "after 2 recoveries" in str(e.value) and "ckpt-0" in str(e.value)
    assert _all_checkpoints_finite(tmp_path)


def test_divergence_is_one_line_and_exit_code_3(tmp_path, capsys):
    # In-process, through the command's error handling (`cli.guarded`); tests/test_cli.py
    # runs its exits in a process.
    code, _, err = cli_in_process(
        f"--config.strategy.mirrored.devices={TWO_CPUS}",  # the default's, on 2 replicas
        "--config.optimizer.learning_rate=1e9",
        "--config.train.loss_upper_bound=1000",
        "--config.optimizer.name=sgd",
        "--config.train.max_recoveries=1",
        "--config.train.steps_per_loop=10",
        f"--model_dir={tmp_path / 'run'}",
        capsys=capsys,
    )
    assert code == errors.DIVERGED_EXIT_CODE, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "last good checkpoint" in lines[0], err
    assert _all_checkpoints_finite(tmp_path / "run")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys):
    config = tiny_config(**{"strategy.name": "one_device"})
    train.run(train.build(config, str(tmp_path)), "train")
    directory = tmp_path / "checkpoints"
    data = next(directory.glob("ckpt-20.data-*"))
    data.write_bytes(data.read_bytes()[:10])  # truncated, as by a crash mid-write
    capsys.readouterr()
    job = train.build(config, str(tmp_path))
    train.run(job, "train")
    captured = capsys.readouterr()
    assert "ckpt-20 is unreadable" in captured.err
    assert "at step 10" in captured.out
    assert job.step() == 20


def signal_at(step: int, sig: int = signal.SIGTERM, worker: int | None = None):
    """For `train.actions`: an action that sends its own process `sig` once `step` is trained.

    As a scheduler (SIGTERM) or a crash (SIGKILL) would, from outside the loop's own
    stop paths; the action runs last after a block, so the loop sees the signal after
    the block's other actions. `worker`: only the member that is that worker of its
    cluster (`TF_CONFIG`'s task index) sends it.
    """

    def make_action(config):
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})

        def action(output):
            if output.step == step and worker in (None, task.get("index")):
                os.kill(os.getpid(), sig)

        return action

    return make_action


sigterm_at_step_40 = signal_at(40)


def test_sigterm_saves_the_step_reached_and_exits_143(tmp_path, capsys):
    args = [
        "--strategy=one_device",
        "--model_dir=run",
        "--config.train.steps=100000",
        "--config.train.steps_per_loop=20",
        "--config.eval.every=0",
    ]
    small = "--config.model.hidden_units=(32,)"  # a small model: the signal is what is tested
    # A process of its own (forked: TensorFlow imported once), the signal a real one.
    sigterm = "--config.train.actions=tests.test_faults:sigterm_at_step_40"
    result = run_cli(*args, small, sigterm, cwd=str(tmp_path))
    assert_exit(result, errors.PREEMPTED_EXIT_CODE)
    out = result.stdout
    step = int(re.search(r"preempted \(SIGTERM\) at step (\d+)", out).group(1))
    assert step >= 40
    latest = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert latest.endswith(f"ckpt-{step}")
    assert not (tmp_path / "run" / lock.LOCK_FILE).exists(), "the lock goes with exit 143"
    code, resumed, err = cli_in_process(  # the rerun: in-process, training only
        args[0],
        "--mode=train",
        f"--model_dir={tmp_path / 'run'}",
        f"--config.train.steps={step + 20}",
        "--config.train.steps_per_loop=20",
        "--config.eval.every=0",
        small,
        capsys=capsys,
    )
    assert code == 0, err[-3000:]
    assert f"at step {step}" in resumed
    assert f"train | step: {step + 20}/{step + 20}" in resumed


def test_the_watchdog_names_members_that_do_not_answer_while_a_loop_is_overdue():
    reports = []
    said = threading.Event()

    def report(line):
        reports.append(line)
        said.set()

    probe = lambda: ["worker:1 (127.0.0.1:9)"]  # noqa: E731
    with faults.Watchdog(probe, report, after_s=0.05) as watchdog:
        with watchdog.loop(40):
            pass  # a quick loop: nothing to say
        assert reports == []
        with watchdog.loop(60):
            assert said.wait(timeout=60), "an overdue loop is reported"
    assert reports and "loop from step 60" in reports[0]
    assert "not answering: worker:1 (127.0.0.1:9)" in reports[0]


def test_a_failed_step_names_the_lost_member_and_the_checkpoint_to_resume_from(tmp_path):
    error = tf.errors.UnavailableError(None, None, "Socket closed")
    lost = faults.lost_member_error(error, ["ps:1 (127.0.0.1:5)"], str(tmp_path))
    assert isinstance(lost, faults.MemberLost)
    assert str(lost).startswith("ps:1 (127.0.0.1:5) stopped answering (UnavailableError)")
    assert "resumes from the start" in str(lost) and "--restarts=N" in str(lost)


def test_a_hung_peer_is_named_from_the_error_and_other_errors_pass_through(tmp_path):
    hung = tf.errors.UnavailableError(
        None,
        None,
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1",
    )
    assert str(faults.lost_member_error(hung, [], str(tmp_path))).startswith("worker:1 stopped")
    bad = tf.errors.InvalidArgumentError(None, None, "shapes differ")
    assert faults.lost_member_error(bad, [], str(tmp_path)) is None


def _reply_to_every_connection(server: socket.socket) -> None:
    """Plays a serving member: answers each connection as a gRPC server opens HTTP/2."""
    while True:
        try:
            connection, _ = server.accept()
        except OSError:  # closed: the test is over
            return
        with connection:
            connection.sendall(bytes(9))  # the size of the SETTINGS frame a server sends first


def test_unreachable_lists_the_other_members_that_are_gone_or_hung():
    with socket.socket() as alive, socket.socket() as gone, socket.socket() as hung:
        for s in (alive, gone, hung):
            s.bind(("127.0.0.1", 0))
        alive.listen()
        hung.listen()  # the kernel accepts for it, and nothing ever replies: a stopped process
        threading.Thread(target=_reply_to_every_connection, args=(alive,), daemon=True).start()
        # gone: bound, never listening, so connections are refused
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in (gone, alive, gone, hung)]
        spec = cluster.ClusterSpec({"worker": tuple(addresses)}, "worker", 0)
        try:
            assert spec.unreachable(timeout_s=1.0) == [
                f"worker:2 ({addresses[2]})",
                f"worker:3 ({addresses[3]})",
            ]
        finally:
            alive.shutdown(socket.SHUT_RDWR)  # wakes its thread's `accept`, which then ends
