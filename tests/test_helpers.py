"""The test helpers leave no process behind: a child's children die with it, however it ends."""

import contextlib
import functools
import json
import os
import pathlib
import subprocess
import threading
import time

import pytest

from tests import helpers


def _recorded(pid_dir: pathlib.Path) -> dict[int, str]:
    """The pids `tests.fake_member` recorded: pid -> "worker:0" or "worker:0 grandchild"."""
    return {int(p.stem): p.read_text() for p in pid_dir.glob("*.pid")}


def _wait_for_records(pid_dir: pathlib.Path, count: int, proc: subprocess.Popen) -> dict:
    """The pids recorded once there are `count`, or once `proc` ended (or after a long while)."""
    deadline = time.monotonic() + helpers.TIMEOUT_S
    while len(_recorded(pid_dir)) < count and proc.poll() is None:
        assert time.monotonic() < deadline, f"only {_recorded(pid_dir)} after {helpers.TIMEOUT_S} s"
        time.sleep(0.05)
    return _recorded(pid_dir)


@pytest.fixture
def one_member(monkeypatch):
    """`tests.fake_member` run on its own, as worker 0."""
    tf_config = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))


def test_a_finished_child_leaves_no_grandchild(one_member, tmp_path):
    # The member starts a child that sleeps for 120 s, and exits at once.
    done = helpers.run_cli(
        f"--pid_dir={tmp_path}",
        "--grandchild",
        "--sleep=0",
        cwd=str(tmp_path),
        module="tests.fake_member",
        keep_tf_config=True,
        timeout=60,  # its grandchild sleeps 120 s: no waiting for it
    )
    helpers.assert_exit(done)
    pids = _recorded(tmp_path)
    assert sorted(pids.values()) == ["worker:0", "worker:0 grandchild"]
    assert not [pid for pid in pids if helpers.running(pid)], "the grandchild outlived run_cli"


def test_a_timed_out_child_leaves_nothing(one_member, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        helpers.run_cli(
            f"--pid_dir={tmp_path}",
            "--grandchild",
            "--sleep=600",
            cwd=str(tmp_path),
            module="tests.fake_member",
            keep_tf_config=True,
            timeout=5,  # the fake member records its pids within a second even under load
        )
    pids = _recorded(tmp_path)
    assert "worker:0 grandchild" in pids.values()
    assert not [pid for pid in pids if helpers.running(pid)]


def test_a_failed_test_leaves_no_cluster_behind(tmp_path):
    """The autouse fixture's cleanup, on an assertion: the launcher and its members' children.

    The launcher starts each member in a session of its own, so killing the
    launcher's process group alone would miss them.
    """
    with pytest.raises(AssertionError), helpers.killed_when_done():
        launcher = helpers.start_cli(
            "--workers=2",
            "--module=tests.fake_member",
            "--",
            f"--pid_dir={tmp_path}",
            "--grandchild",
            "--sleep=600",
            cwd=str(tmp_path),
            module="trainer.launch",
        )
        pids = _wait_for_records(tmp_path, 4, launcher)  # 2 members, each with a grandchild
        raise AssertionError("a failing test")
    assert len(pids) == 4, pids
    assert launcher.returncode is not None
    assert not [pid for pid in [launcher.pid, *pids] if helpers.running(pid)], (
        "processes left behind"
    )


def test_assert_exit_shows_the_tail_of_the_output_when_the_code_differs():
    done = subprocess.CompletedProcess(["x"], 3, "early\n" + "o" * 5000 + "LAST OUT", "ERR TAIL")
    helpers.assert_exit(done, 3)
    with pytest.raises(AssertionError) as caught:
        helpers.assert_exit(done)
    message = str(caught.value)
    assert "exit 3, expected 0" in message and "LAST OUT" in message and "ERR TAIL" in message
    assert "early" not in message, "only the tail"


def _probe_line(output: str, key: str) -> str:
    return next(line.split(" ", 1)[1] for line in output.splitlines() if line.startswith(key + " "))


def test_run_cli_forks_a_module_from_the_server_with_its_own_exit_and_streams(
    one_member, tmp_path, monkeypatch
):
    monkeypatch.setenv(helpers.FORK_VARIABLE, "1")
    probe = functools.partial(
        helpers.run_cli, module="tests.fork_probe", cwd=str(tmp_path), keep_tf_config=True
    )
    done = probe("--exit=3")
    assert done.returncode == 3
    assert _probe_line(done.stdout, "name") == "worker:0", "forked: named after its task"
    assert _probe_line(done.stdout, "cwd") == str(tmp_path) and done.stderr == ""
    failed = probe("--raise")
    assert failed.returncode == 1
    assert "RuntimeError: the member's own error" in failed.stderr
    assert "forkserver.py" not in failed.stderr and "RuntimeError" not in failed.stdout
    assert _probe_line(failed.stdout, "argv") == '["--raise"]'


def test_run_cli_starts_a_process_of_its_own_with_forking_off(one_member, tmp_path, monkeypatch):
    monkeypatch.setenv(helpers.FORK_VARIABLE, "0")
    done = helpers.run_cli(
        "--exit=3", module="tests.fork_probe", cwd=str(tmp_path), keep_tf_config=True
    )
    assert done.returncode == 3
    assert _probe_line(done.stdout, "name") != "worker:0", "an interpreter's own name"


def test_a_timed_out_forked_launcher_leaves_no_member(tmp_path):
    """A launcher forked from the tests' server, with members forked from a server of its own.

    Those members show the tests' server's environment, not the test's tag: they
    are found as the launcher's descendants. Here they wait for a second file, which never lands.
    """
    rows = "a,b,c,d,label\n" + "0.5,0.5,0.5,0.5,1\n" * 8
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "first.csv").write_text(rows)  # what start-up reads its inputs from
    (tmp_path / "eval.csv").write_text(rows)
    members: set[int] = set()
    watching = threading.Event()

    def watch() -> None:  # the members, seen while they run (both seen: no more to find)
        while not watching.is_set() and len(members) < 2:
            for pid in helpers.descendants({os.getpid()}):
                with contextlib.suppress(OSError):
                    if pathlib.Path(f"/proc/{pid}/comm").read_text().startswith("worker:"):
                        members.add(pid)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            helpers.run_cli(
                "--workers=2",
                "--",
                "--strategy=multi_worker",
                f"--model_dir={tmp_path / 'run'}",
                "--config.data.name=csv",
                f"--config.data.train_files={tmp_path / 'train' / '*'}",
                f"--config.data.eval_files={tmp_path / 'eval.csv'}",
                "--config.data.input_shape=(4,)",
                "--config.data.num_classes=2",
                "--config.data.follow=True",
                "--config.data.follow_poll_secs=1",
                "--config.train.global_batch_size=4",
                "--config.train.steps=0",  # until stopped
                cwd=str(tmp_path),
                module="trainer.launch",
                timeout=30,  # the members are up and waiting well before, even under load
            )
    finally:
        watching.set()
        watcher.join()
    assert len(members) == 2, members
    assert not [pid for pid in members if helpers.running(pid)], "members left behind"
