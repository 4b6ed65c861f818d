"""A run leaves none of AutoGraph's generated modules in the temp directory, however it ends.

AutoGraph removes its files only at a normal exit; a member that ends through
`os._exit` (lost, forked, the watchdog) left them behind. Here the run ends
through `os._exit` after its first block, from an action of its own, in a
process of its own (forked from the tests' server: TensorFlow imported once).
"""

import os

from tests.fresh_process import run_script
from tests.helpers import REPO

# `python -m trainer ARGS` with the temp directory `DIR` (`tempfile.tempdir`, where Python
# keeps what `TMPDIR` says at start-up: a forked process has its server's already).
TRAINER_IN = """
import runpy, sys, tempfile
tempfile.tempdir = sys.argv[1]
sys.argv = ["trainer", *sys.argv[2:]]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""


def exit_after_the_first_block(config):
    """A loop action that ends the process at once, as a lost member does: no `atexit` hooks."""

    def action(output):
        os._exit(0)

    return action


def test_a_run_ended_through_os_exit_leaves_no_autograph_files(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = run_script(
        TRAINER_IN,
        str(temp),
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
