"""The `stragglers` case: spare replicas and staleness under `parameter_server`, on digits.

Local clusters of 3 workers and 1 ps (`python -m trainer.launch`) train the
default digits job; worker 2 sleeps `Sizes.straggler_s` before each batch
(its input is `trainer.bench.straggling`'s):

- synchronous, k = 2 of 3 (one spare) against k = 3: seconds per step (the
  chief's clock marks) and final eval accuracy;
- asynchronous, `staleness=none` against `scale`: the staleness histogram
  (updates applied by others between a worker's read and its update), and
  the first step whose eval accuracy reaches the k = 3 run's final one.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import numpy as np

from trainer.bench import clock, straggling
from trainer.bench.harness import child, note, result, tail
from trainer.bench.sizes import Sizes

RUNS = {
    "sync_k3": {"sync_replicas": 3},
    "sync_k2": {"sync_replicas": 2},
    "async_none": {"staleness": "none"},
    "async_scale": {"staleness": "scale"},
}


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Step time and accuracy of k = 2 against k = 3; staleness and steps to accuracy, async."""
    samples: dict[str, list[float]] = {}
    details: dict[str, list[dict]] = {}
    for _ in range(max(1, reps // 2)):  # 2 rounds by default: each run is a whole job
        for name in sizes.straggler_runs:
            options = RUNS[name]
            figures, detail = cluster_run(sizes, options, workdir)
            note(f"  {name}: {figures} {detail}")
            for key, value in figures.items():
                samples.setdefault(f"{name}/{key}", []).append(value)
            details.setdefault(name, []).append(detail)
    figures = {name: statistics.median(values) for name, values in samples.items()}
    # Gradients per update over k: 1 when every take finds exactly k pushes.
    averaged = [d["replicas_averaged"] for d in details.get("sync_k2", [])]
    ratios = {"sync_k2 averaged/k": statistics.median(averaged) / 2} if averaged else {}
    steps_to_target = {}
    if "sync_k3" in details:
        target = figures["sync_k3/accuracy"]
        if "sync_k2" in details:
            ratios["sync_k2/sync_k3 step time"] = (
                figures["sync_k2/step_s"] / figures["sync_k3/step_s"]
            )
            ratios["sync_k2/sync_k3 accuracy"] = figures["sync_k2/accuracy"] / target
        steps_to_target = {
            name: [_first_at(d["eval_accuracy"], target) for d in details[name]]
            for name in ("async_none", "async_scale")
            if name in details
        }
    return result(
        "s/step, accuracy",
        figures,
        ratios,
        samples,
        runs=details,
        steps_to_k3_accuracy=steps_to_target,
    )


def cluster_run(sizes: Sizes, options: dict, workdir: str) -> tuple[dict, dict]:
    """One local cluster run of the digits job: its seconds per step and accuracy, and details.

    The details: eval accuracy by step, the last block's train figures, and the
    staleness histogram summed over the run (asynchronous runs).
    """
    model_dir = tempfile.mkdtemp(prefix="stragglers-", dir=workdir)
    flags = {
        **straggling.CONFIG,
        "train.steps": sizes.straggler_steps,
        "train.steps_per_loop": sizes.straggler_loop,
        # Async runs evaluate every loop (steps to an accuracy); sync runs time steps alone.
        "eval.every": 0 if options.get("sync_replicas") else sizes.straggler_loop,
        "train.checkpoint_every": 0,
        "train.export": False,
        "train.actions": "trainer.bench.clock:to_file",
        **{f"strategy.parameter_server.{k}": v for k, v in options.items()},
    }
    command = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--workers=3",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        *(f"--config.{k}={v}" for k, v in flags.items()),
    ]
    marks, log = model_dir + ".clock", model_dir + ".log"
    slow = {straggling.VARIABLE: f"2:{sizes.straggler_s}"}
    with child(command, log, marks, env=slow) as process:
        process.wait()
    if process.returncode:
        raise RuntimeError(f"cluster exited with {process.returncode}: {tail(log)}")
    with open(os.path.join(model_dir, "results.json")) as f:
        results = json.load(f)
    figures = {
        "step_s": 1.0 / clock.rate(clock.read(marks), 1.0),
        "accuracy": results["eval"]["accuracy"],
    }
    train = results["train"]
    detail = {
        "eval_accuracy": _eval_curve(model_dir),
        **{
            k: train[k]
            for k in ("staleness_mean", "replicas_averaged", "late_dropped")
            if k in train
        },
    }
    histogram = _staleness(model_dir)
    if histogram is not None:
        detail["staleness_histogram"] = histogram
    return figures, detail


def _eval_curve(model_dir: str) -> dict[int, float]:
    """Eval accuracy by step (TensorBoard's eval run)."""
    return {step: float(value) for step, value in _tensors(model_dir, "eval", "accuracy")}


def _staleness(model_dir: str) -> list | None:
    """The staleness histogram summed over the run's blocks (None when synchronous)."""
    blocks = _tensors(model_dir, "train", "staleness")
    if not blocks:
        return None
    # Rows (left edge, right edge, count), one per staleness 0, 1, ... (`Summaries.histograms`).
    counts = sum(histogram[:, 2] for _, histogram in blocks)
    return np.asarray(counts).round().astype(int).tolist()


def _tensors(model_dir: str, split: str, tag: str) -> list[tuple[int, object]]:
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(
        os.path.join(model_dir, split), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    if tag not in events.Tags()["tensors"]:
        return []
    return [(e.step, tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]


def _first_at(curve: dict[int, float], target: float) -> float:
    """The first step whose accuracy is at least `target` (inf: never)."""
    # TensorBoard holds float32, results.json float64: the same accuracy differs in the 8th digit.
    reached = (step for step, value in sorted(curve.items()) if value >= target - 1e-6)
    return next(reached, float("inf"))
