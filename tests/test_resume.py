"""SIGKILL at random points, restart with the same command: the same final weights."""

import random
import signal
import time

import numpy as np
import pytest

from tests.helpers import REPO, assert_exit, checkpoint_values, run_cli, start_cli

ARGS = [
    "--config.train.steps=60",
    "--config.train.steps_per_loop=5",
    "--config.train.checkpoint_every=5",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.train.deterministic=True",
]


def _kill_after(progress_lines: int, delay_s: float, args: list[str], cwd) -> None:
    """Starts the trainer and SIGKILLs it `delay_s` after its n-th progress line."""
    proc = start_cli(*args, cwd=cwd)
    try:
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("train |")
            if seen == progress_lines:
                break
        time.sleep(delay_s)  # let it run into the next loop, or a save
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)


# The ctr job with a dynamic table and incremental checkpoints: full every 20 steps, deltas
# between, so most restarts restore a delta over its full checkpoint.
DELTAS = (
    "--config=configs/ctr.py",
    "--config.model.embedding=dynamic",
    "--config.model.min_count=2",
    "--config.data.ctr.num_examples=2000",
    "--config.data.ctr.ids_per_field=100",
    "--config.data.ctr.vocab_size=1000",
    "--config.train.full_checkpoint_every=20",
)


# In the slow tier (a SIGKILL soak): the default tier resumes exactly in its data-service,
# dynamic-table and command-line tests.
@pytest.mark.parametrize(
    "strategy, extra",
    [
        pytest.param(s, extra, marks=pytest.mark.slow, id=f"{s}{'-deltas' if extra else ''}")
        for s, extra in (("one_device", ()), ("mirrored", ()), ("mirrored", DELTAS))
    ],
)
def test_sigkill_anywhere_then_restart_ends_with_the_same_weights(strategy, extra, tmp_path):
    args = [f"--strategy={strategy}", *extra[:1], *ARGS, *extra[1:]]  # --config first
    straight = run_cli(*args, "--model_dir=straight", cwd=str(tmp_path))
    assert_exit(straight)
    rng = random.Random(strategy)
    for progress_lines in (1, 4, 8):  # three different points of the run
        _kill_after(progress_lines, rng.uniform(0.0, 0.3), [*args, "--model_dir=killed"], tmp_path)
    finished = run_cli(*args, "--model_dir=killed", cwd=str(tmp_path))
    assert_exit(finished)
    assert "restored" in finished.stdout
    _assert_same_checkpoints(tmp_path / "straight", tmp_path / "killed", at_least=10)


@pytest.mark.slow  # SIGKILL soak; the built-in job's runs in the default tier
def test_a_user_task_killed_and_restarted_ends_as_the_uninterrupted_run(tmp_path):
    """A task's own pipeline, model (Keras Dropout) and train step: resumed by skipping batches."""
    args = [f"--config={REPO}/examples/custom_step.py", "--strategy=one_device", *ARGS]
    straight = run_cli(*args, "--model_dir=straight", cwd=str(tmp_path))
    assert_exit(straight)
    for progress_lines in (2, 7):
        _kill_after(progress_lines, 0.1, [*args, "--model_dir=killed"], tmp_path)
    finished = run_cli(*args, "--model_dir=killed", cwd=str(tmp_path))
    assert_exit(finished)
    assert "restored" in finished.stdout
    _assert_same_checkpoints(tmp_path / "straight", tmp_path / "killed", at_least=4)


def _assert_same_checkpoints(straight, killed, at_least: int) -> None:
    a, b = checkpoint_values(straight), checkpoint_values(killed)
    assert a.keys() == b.keys() and len(a) > at_least
    for name in a:
        if "save_counter" not in name:  # how many saves it took differs, nothing else
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
