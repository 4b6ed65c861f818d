"""A run leaves none of AutoGraph's generated modules in the temp directory, however it ends.

AutoGraph removes its files only at a normal exit; a member that ends through
`os._exit` (lost, forked, the watchdog) left them behind. Here the run ends
through `os._exit` after its first block, from an action of its own.
"""

import os

from tests.helpers import REPO, run_cli


def exit_after_the_first_block(config):
    """A loop action that ends the process at once, as a lost member does: no `atexit` hooks."""

    def action(output):
        os._exit(0)

    return action


def test_a_run_ended_through_os_exit_leaves_no_autograph_files(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    result = run_cli(
        "--strategy=one_device",
        f"--model_dir={tmp_path / 'run'}",
        "--config.devices.logical_cpus=1",
        "--config.train.steps=4",
        "--config.train.steps_per_loop=2",
        "--config.eval.every=0",
        "--config.train.actions=tests.test_autograph_files:exit_after_the_first_block",
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run").exists()  # it did run
    assert [p.name for p in temp.iterdir() if p.name.startswith("__autograph")] == []
