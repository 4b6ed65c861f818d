"""The `gradients` case: what bfloat16 transfer, packing and accumulation buy `multi_worker`.

    python -m trainer.bench --cases=gradients        # ~10 min here

Two local workers (`TF_CONFIG` on 127.0.0.1), each pinned to a core of its
own with `taskset`, train the `dense_large` MLP (about 15M parameters, 59 MB
of float32 gradients) at a global batch of `large_batch`; one worker alone on
one core (`one_device`, half that batch) is the unit of scaling efficiency:
examples/s of the 2 workers over 2 x the one worker's.

- transfer: float32 or bfloat16 gradients (`gradient_dtype`), in one pack or
  16 MB packs (`bytes_per_pack`): examples/s, and the milliseconds one
  all-reduce of the model's gradients takes alone (`allreduce.py`);
- accumulation: k micro-batches of the same size per step
  (`train.accumulation_steps`, the global batch k times larger), so a step's
  all-reduce serves k times the examples; its efficiency is over one worker
  that accumulates as much (its optimizer updates as rarely);
- accuracy: the default digits job on 2 workers (`trainer.launch`), float32
  against bfloat16 transfer.

examples/s come from the chief's clock action (`clock.to_file`), the first
loop (tracing) and the end-of-run checkpoint left out. The runs alternate
`max(1, reps // 2)` times; the scaling efficiency is also given from each
run's fastest repetition, the one other load on the machine slowed least.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys

from towerflow.processes import pick_ports
from trainer.bench import allreduce, clock
from trainer.bench.harness import child, note, paired, result, tail
from trainer.bench.sizes import Sizes

RUN_TIMEOUT_S = 900  # one run; a loaded machine is slow, not stuck


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """examples/s of each transfer and accumulation, their scaling efficiency, all-reduce times."""
    runs = {"one_worker": (1, _flags(sizes, sizes.large_batch // 2, 1))}
    for name in sizes.transfers:
        runs[f"2_workers/{name}"] = (2, _flags(sizes, sizes.large_batch, 1, name))
    for k in sizes.accumulation:
        if k > 1:  # the one worker accumulates as much: its update is as rare
            runs[f"one_worker/k{k}"] = (1, _flags(sizes, sizes.large_batch // 2 * k, k))
            runs[f"2_workers/float32/k{k}"] = (2, _flags(sizes, sizes.large_batch * k, k))
    samples: dict[str, list[float]] = {}
    all_reduce: dict[str, list[float]] = {}
    for rep in range(max(1, reps // 2)):
        for name, (workers, flags) in runs.items():
            stem = os.path.join(workdir, "gradients", f"{name.replace('/', '-')}-{rep}")
            rate = _rate(workers, flags, stem)
            samples.setdefault(name, []).append(rate)
            note(f"  rep {rep + 1} {name}: {rate:.4g} examples/s")
        stem = os.path.join(workdir, "gradients", f"all_reduce-{rep}")
        for name, seconds in _all_reduce_seconds(sizes, stem).items():
            all_reduce.setdefault(name, []).append(seconds * 1e3)
    figures = {name: statistics.median(values) for name, values in samples.items()}
    ratios = {
        f"scaling_efficiency/{name.removeprefix('2_workers/')}": paired(
            samples, lambda r, name=name: r[name] / (2 * r[_one_worker(name)])
        )
        for name in samples
        if name.startswith("2_workers/")
    }
    for name in samples:
        if name.startswith("2_workers/") and name != "2_workers/float32":
            ratios[f"{name.removeprefix('2_workers/')}/float32"] = paired(
                samples, lambda r, name=name: r[name] / r["2_workers/float32"]
            )
    # The fastest repetition of each run is the one other load on the machine slowed least.
    best = {name: max(values) for name, values in samples.items()}
    return result(
        "examples/s",
        figures,
        ratios,
        samples,
        best_scaling_efficiency={
            name.removeprefix("2_workers/"): best[name] / (2 * best[_one_worker(name)])
            for name in best
            if name.startswith("2_workers/")
        },
        all_reduce_ms={name: statistics.median(v) for name, v in all_reduce.items()},
        all_reduce_ms_samples=all_reduce,
        digits_eval_accuracy=_accuracies(sizes, workdir),
        cores="one per worker (taskset)",
        global_batch=f"{sizes.large_batch} (k x that with k micro-batches)",
    )


def _one_worker(name: str) -> str:
    """The run of one worker alone that a 2-worker run `name` scales: the same accumulation."""
    k = name.rsplit("/", 1)[-1]
    return f"one_worker/{k}" if k.startswith("k") else "one_worker"


def _flags(sizes: Sizes, batch: int, k: int, transfer: str = "float32") -> list[str]:
    """The trainer's flags for the dense MLP at global batch `batch` in `k` micro-batches."""
    steps = max(4, sizes.gradient_steps // k)
    dtype, pack = allreduce.TRANSFERS[transfer]
    return [
        "--config.data.name=synthetic",
        f"--config.data.synthetic.input_shape=({sizes.large_input},)",
        f"--config.data.synthetic.num_examples={sizes.examples}",
        f"--config.model.hidden_units=({','.join(map(str, sizes.large_hidden))},)",
        "--config.model.dropout=0.0",
        f"--config.train.global_batch_size={batch}",
        f"--config.train.accumulation_steps={k}",
        f"--config.strategy.multi_worker.gradient_dtype={dtype}",
        f"--config.strategy.multi_worker.bytes_per_pack={pack}",
        "--config.devices.intra_op_threads=1",  # the core it is pinned to
        # One step more, untimed: the end-of-run checkpoint comes after it.
        f"--config.train.steps={steps + 1}",
        f"--config.train.steps_per_loop={max(1, steps // 4)}",
        "--config.train.checkpoint_every=0",
        "--config.train.export=False",
        "--config.eval.every=0",
        "--config.train.actions=trainer.bench.clock:to_file",
        "--mode=train",
    ]


def _rate(workers: int, flags: list[str], stem: str) -> float:
    """examples/s of one run: `one_device` alone, or `multi_worker` on `workers` workers."""
    strategy = "one_device" if workers == 1 else "multi_worker"
    command = [sys.executable, "-m", "trainer", f"--strategy={strategy}", f"--model_dir={stem}"]
    marks = stem + ".clock"
    _pinned_cluster([*command, *flags], workers if workers > 1 else 0, stem, marks)
    steps = int(_value(flags, "train.steps")) - 1
    return clock.rate(clock.read(marks), int(_value(flags, "train.global_batch_size")), steps)


def _all_reduce_seconds(sizes: Sizes, stem: str) -> dict[str, float]:
    """Seconds one all-reduce of the dense MLP's gradients takes, per transfer (2 workers)."""
    widths = [sizes.large_input, *sizes.large_hidden, 10]  # synthetic data: 10 classes
    shapes = [s for i, o in zip(widths[:-1], widths[1:]) for s in ([i, o], [o])]
    out = stem + ".json"
    reps = max(2, sizes.gradient_steps)
    command = [sys.executable, "-m", "trainer.bench.allreduce", out, json.dumps(shapes), str(reps)]
    _pinned_cluster(command, 2, stem)
    with open(out) as f:
        figures = json.load(f)
    return {name: figures[name] for name in sizes.transfers}


def _pinned_cluster(command: list[str], workers: int, stem: str, marks: str | None = None):
    """Runs `command` as each of `workers` workers of a local cluster (0: alone), one core each."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    addresses = [f"127.0.0.1:{port}" for port in pick_ports(workers)]
    members = [
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}}
            )
        }
        for i in range(workers)
    ] or [{}]
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                child(
                    ["taskset", "-c", str(cores[i % len(cores)]), *command],
                    f"{stem}-{i}.log",
                    marks,
                    env,
                )
            )
            for i, env in enumerate(members)
        ]
        for i, proc in enumerate(procs):
            if proc.wait(timeout=RUN_TIMEOUT_S):
                raise RuntimeError(
                    f"{stem} member {i} exited with {proc.returncode}:\n{tail(f'{stem}-{i}.log')}"
                )


def _accuracies(sizes: Sizes, workdir: str) -> dict[str, float] | str:
    """The default digits job's eval accuracy on 2 workers, float32 and bfloat16 transfer."""
    if not sizes.accuracy_steps:
        return "not run at these sizes (`Sizes.accuracy_steps`)"
    accuracy = {}
    for dtype in ("float32", "bfloat16"):
        model_dir = os.path.join(workdir, "gradients", f"digits-{dtype}")
        command = [sys.executable, "-m", "trainer.launch", "--workers=2", "--"]
        command += ["--strategy=multi_worker", f"--model_dir={model_dir}"]
        command += [f"--config.train.steps={sizes.accuracy_steps}", "--config.train.export=False"]
        command += [f"--config.strategy.multi_worker.gradient_dtype={dtype}"]
        with child(command, model_dir + ".log") as process:
            if process.wait(timeout=RUN_TIMEOUT_S):
                raise RuntimeError(
                    f"digits {dtype} exited with {process.returncode}:\n{tail(model_dir + '.log')}"
                )
        with open(os.path.join(model_dir, "results.json")) as f:
            accuracy[dtype] = json.load(f)["eval"]["accuracy"]
        note(f"  digits, {dtype} transfer: eval accuracy {accuracy[dtype]:.4f}")
    accuracy["bfloat16_minus_float32"] = accuracy["bfloat16"] - accuracy["float32"]
    return accuracy


def _value(flags: list[str], field: str) -> str:
    prefix = f"--config.{field}="
    return next(f.removeprefix(prefix) for f in flags if f.startswith(prefix))
