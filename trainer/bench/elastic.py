"""The `elastic` case: an elastic `multi_worker` job losing a member, and the group it shrinks to.

A local elastic job (`python -m trainer.launch --workers=2:3`) trains the
digits job on 3 members; once the chief reports step `Sizes.elastic_kill_at`,
member 2 gets SIGKILL and stays out (a cool-down longer than the run). From
the launcher's output, read as it comes:

- seconds from the loss to the next completed step of the group of 2, in parts:
  detection (SIGKILL to the survivors' save line), save (the survivors' own
  figure), re-form (the save to the new group's restore), first step (the
  restore to the group's first block, `Sizes.elastic_loop` steps);
- steps lost per failure (the step saved minus the step the new group restored:
  steps it trains again) and the examples repeated (those steps' global batches);
- the steps/s of the shrunk group (its blocks after the first) against a fresh
  2-worker job of the same config (target >= 0.95).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from towerflow.processes import member_pid
from trainer.bench.harness import note, result
from trainer.bench.sizes import Sizes

BATCH = 48  # splits over 3 replicas and over 2: the same examples at every step
_RATE = re.compile(r"\[member:0\] train \| step: (\d+)/.*?steps/s: ([\d.]+)")


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Loss-to-step seconds and its parts, steps lost, examples repeated, shrunk throughput."""
    samples: dict[str, list[float]] = {}
    for _ in range(max(1, reps // 2)):  # each repetition is two whole jobs
        figures = shrink(sizes, workdir)
        figures["fresh_steps_per_s"] = _steps_per_s(fresh(sizes, workdir))
        note(f"  {figures}")
        for key, value in figures.items():
            samples.setdefault(key, []).append(value)
    # Counts whose target is 0 are reported beside the figures (which are positive).
    lost = {key: samples.pop(key) for key in ("steps_lost", "examples_repeated")}
    figures = {key: statistics.median(values) for key, values in samples.items()}
    ratios = {
        "shrunk 3->2 / fresh 2 steps/s": statistics.median(
            s / f
            for s, f in zip(
                samples["shrunk_steps_per_s"], samples["fresh_steps_per_s"], strict=True
            )
        )
    }
    return result("s, steps/s", figures, ratios, samples, per_failure=lost)


def _flags(sizes: Sizes, model_dir: str) -> list[str]:
    return [
        "--strategy=multi_worker",
        f"--model_dir={model_dir}",
        f"--config.train.steps={sizes.elastic_steps}",
        f"--config.train.steps_per_loop={sizes.elastic_loop}",
        f"--config.train.global_batch_size={BATCH}",
        f"--config.eval.global_batch_size={BATCH}",
        "--config.eval.every=0",
        "--config.train.export=False",
        "--config.cluster.elastic.cooldown_s=100000",  # the lost member stays out
    ]


def shrink(sizes: Sizes, workdir: str) -> dict[str, float]:
    """One elastic job of 3 that loses member 2: the figures of its loss and of the group of 2."""
    model_dir = tempfile.mkdtemp(prefix="elastic-", dir=workdir)
    command = ["--workers=2:3", "--", *_flags(sizes, model_dir)]
    trigger = f"[member:0] train | step: {sizes.elastic_kill_at}/"
    lines, killed = _launch(command, trigger, model_dir)
    text = "\n".join(line for _, line in lines)

    def first(pattern: str, after: float = 0.0) -> tuple[float, re.Match]:
        for seconds, line in lines:
            if seconds >= after and (match := re.search(pattern, line)):
                return seconds, match
        raise RuntimeError(f"no line matches {pattern!r}: {text[-2000:]}")

    saved_at, save = first(r"elastic: .* saved step (\d+) to \S+ in ([\d.]+) s", killed)
    restored_at, restore = first(r"\[member:0\] restored \S+ at step (\d+)", saved_at)
    stepped_at, _ = first(r"\[member:0\] train \| step: ", restored_at)
    lost = int(save.group(1)) - int(restore.group(1))
    rates = [float(r) for s, line in lines if s > stepped_at for r in _rates(line)]
    return {
        "loss_to_step_s": stepped_at - killed,
        "detection_s": saved_at - killed - float(save.group(2)),
        "save_s": float(save.group(2)),
        "reform_s": restored_at - saved_at,
        "first_step_s": stepped_at - restored_at,
        "steps_lost": float(lost),
        "examples_repeated": float(lost * BATCH),
        "shrunk_steps_per_s": statistics.median(rates) if rates else float("nan"),
    }


def fresh(sizes: Sizes, workdir: str) -> list[tuple[float, str]]:
    """A fresh 2-worker job of the same config: its output lines."""
    model_dir = tempfile.mkdtemp(prefix="fresh-", dir=workdir)
    lines, _ = _launch(["--workers=2:2", "--", *_flags(sizes, model_dir)], None, model_dir)
    return lines


def _steps_per_s(lines: list[tuple[float, str]]) -> float:
    rates = [float(r) for _, line in lines for r in _rates(line)][1:]  # the first block traces
    return statistics.median(rates)


def _rates(line: str) -> list[str]:
    match = _RATE.search(line)
    return [match.group(2)] if match else []


def _launch(
    command: list[str], trigger: str | None, model_dir: str
) -> tuple[list[tuple[float, str]], float]:
    """Runs the launcher; at the first line holding `trigger`, SIGKILLs member 2.

    Returns its lines as (seconds since start, line) and the second of the kill.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(900, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    start, killed, lines = time.monotonic(), 0.0, []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if trigger and not killed and trigger in line:
                pid = member_pid("worker", 2, model_dir)
                if pid is None:
                    raise RuntimeError(f"worker 2 of {model_dir} not found")
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic() - start
        code = proc.wait()
    finally:
        timer.cancel()
    if code:
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"the elastic job exited with {code}: {tail}")
    return lines, killed
