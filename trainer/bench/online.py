"""The `online` case: a run that follows files against the same run on them fixed, and freshness.

On the click files of `examples/online.py` (8 ids and a click a record, CSV)
and its model (`configs/ctr.py`'s), written once into the case's directory:

- records/s of a run with `data.follow=true` against the same job on the same
  files with `data.follow=false`, under `one_device`, `multi_worker` on 2 local
  workers and `parameter_server` on 2 workers and 1 ps (`Sizes.online_strategies`),
  each a fresh process or cluster timed over its blocks after the first
  (the chief's clock marks; `one_device` over `STEPS_SCALE` times the steps);
  the ratio's target is at least 0.9;
- seconds from a file landing to the first export that trained it (median,
  p95): the example's trainer (`mirrored`, an export every file) with
  `examples.online.landing_to_export` writing one file at a time;
- records trained twice when a worker is lost: a following `parameter_server`
  run whose worker 1 gets SIGKILL half a block after the chief's second
  progress line (the launcher restarts it); `results.json`'s
  `follow.records_repeated`, beside the records of one unit (the target: at
  most one unit's).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time

from examples import online as example
from towerflow.processes import member_pid
from trainer.bench import clock
from trainer.bench.harness import alternate, child, cluster_marks, note, paired, result, tail
from trainer.bench.sizes import Sizes

TOPOLOGY = {  # the launcher's flags of each strategy's run
    "one_device": ["--workers=1"],
    "multi_worker": ["--workers=2"],
    "parameter_server": ["--workers=2", "--ps=1"],
}
WORKERS = 2  # of the multi-member runs
# Timed steps of a run, in `Sizes.online_steps`: one process trains its steps several times
# faster than a cluster, and a window of a second or two moves with the machine's load.
STEPS_SCALE = {"one_device": 4}
RUN_TIMEOUT_S = 900  # one run; a loaded machine is slow, not stuck


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Records/s followed and fixed, landing-to-export seconds, records repeated per worker lost."""
    files = _write_files(sizes, os.path.join(workdir, "clicks"))
    batch = example.get_config().train.global_batch_size
    contenders = {}
    for strategy in sizes.online_strategies:
        for follow in (False, True):
            name = f"{strategy}/{'follow' if follow else 'fixed'}"
            contenders[name] = _timed(sizes, workdir, files, strategy, follow, batch)
    samples = alternate(contenders, reps)
    ratios = {
        f"{strategy} follow/fixed": paired(
            samples, lambda r, s=strategy: r[f"{s}/follow"] / r[f"{s}/fixed"]
        )
        for strategy in sizes.online_strategies
    }
    for name, ratio in ratios.items():
        note(f"  {name}: {ratio:.3f} (target >= 0.9)")
    figures = {name: statistics.median(values) for name, values in samples.items()}
    seconds = _landing_to_export(sizes, os.path.join(workdir, "latency"))
    figures["landing_to_export_median_s"], figures["landing_to_export_p95_s"] = (
        example.median_and_p95(seconds)
    )
    samples["landing_to_export_s"] = seconds
    lost = _worker_lost(sizes, workdir, files, batch)
    note(f"  worker lost: {lost}")
    return result("records/s, s", figures, ratios, samples, per_worker_lost=lost)


def _write_files(sizes: Sizes, directory: str) -> str:
    """The eval file and enough train files for every run; their glob."""
    batch = example.get_config().train.global_batch_size
    steps = sizes.online_steps * max(STEPS_SCALE.values())
    records = (steps + 1) * batch  # the runs train one step past the timed ones
    for k in range(-(-records // sizes.online_file_records)):
        path = os.path.join(directory, "train", f"clicks-{k:05d}.csv")
        example.write_csv(path, k * sizes.online_file_records, sizes.online_file_records)
    example.write_csv(os.path.join(directory, "eval.csv"), example.EVAL_FIRST, example.EVAL_ROWS)
    return os.path.join(directory, "train", "*.csv")


def _flags(strategy: str, files: str, follow: bool) -> tuple[list[str], dict]:
    """The trainer's flags and config overrides of one run of the example's job on `files`."""
    args = ["--config=examples/online.py", f"--strategy={strategy}"]
    overrides = {
        "data.train_files": files,
        "data.eval_files": os.path.join(os.path.dirname(os.path.dirname(files)), "eval.csv"),
        "data.follow": follow,
        "export.every_steps": 0,
    }
    return args, overrides


def _timed(sizes: Sizes, workdir: str, files: str, strategy: str, follow: bool, batch: int):
    """One fresh run (`online_steps`, scaled): records/s over its whole blocks after the first."""

    steps = sizes.online_steps * STEPS_SCALE.get(strategy, 1)

    def once() -> float:
        model_dir = tempfile.mkdtemp(prefix=f"{strategy}-", dir=workdir)
        args, overrides = _flags(strategy, files, follow)
        marks = cluster_marks(
            TOPOLOGY[strategy],
            [*args, "--config.train.checkpoint_every=0"],
            overrides,
            model_dir,
            steps,
            sizes.online_loop,
        )
        return clock.rate(marks, per_step=batch, until=steps)

    once.self_warming = True  # a fresh process each time; its first block is left out
    return once


def _landing_to_export(sizes: Sizes, directory: str) -> list[float]:
    """The example's trainer following `directory`: each file's seconds from landing to export."""
    example.write(directory, 0, 1, 0.0)  # the eval file and file 0, before the trainer starts
    steps_per_file = example.ROWS // example.get_config().train.global_batch_size
    command = [sys.executable, "-m", "trainer", "--config=examples/online.py"]
    command += [
        f"--model_dir={os.path.join(directory, 'run')}",
        f"--config.data.train_files={os.path.join(directory, 'train', '*.csv')}",
        f"--config.data.eval_files={os.path.join(directory, 'eval.csv')}",
        f"--config.export.every_steps={steps_per_file}",
        f"--config.train.steps={steps_per_file * (1 + sizes.online_latency_files)}",
    ]
    log = os.path.join(directory, "run.log")
    with child(command, log) as trainer:
        try:
            seconds = example.landing_to_export(
                directory,
                os.path.join(directory, "run", "export"),
                1,
                sizes.online_latency_files,
                RUN_TIMEOUT_S,
            )
        except TimeoutError as e:
            raise RuntimeError(f"{e}: {' '.join(command)}\n{tail(log)}") from None
        trainer.wait(RUN_TIMEOUT_S)
    if trainer.returncode:
        raise RuntimeError(f"the trainer exited with {trainer.returncode}\n{tail(log)}")
    return seconds


def _worker_lost(sizes: Sizes, workdir: str, files: str, batch: int) -> dict:
    """A following `parameter_server` run whose worker 1 gets SIGKILL mid-run: what repeats.

    Returns `records_repeated` (`results.json`'s), `unit_records` (a unit: a
    block's steps cut in a part per worker, at most a file) and their ratio.
    """
    model_dir = tempfile.mkdtemp(prefix="worker-lost-", dir=workdir)
    args, overrides = _flags("parameter_server", files, True)
    overrides.update(
        {
            "train.steps": sizes.online_steps,
            "train.steps_per_loop": sizes.online_loop,
            "train.checkpoint_every": 0,
            "train.export": False,
            "eval.every": 0,
        }
    )
    command = [sys.executable, "-m", "trainer.launch", *TOPOLOGY["parameter_server"], "--"]
    command += [*args, f"--model_dir={model_dir}"]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    log = model_dir + ".log"
    with child(command, log) as launcher:
        _kill_at(launcher, log, "[chief] train | step:", model_dir)
        launcher.wait(RUN_TIMEOUT_S)
    with open(log, errors="replace") as f:
        killed = "worker:1 was killed by SIGKILL" in f.read()
    if launcher.returncode or not killed:
        output = tail(log, 3000)
        raise RuntimeError(
            f"the run exited with {launcher.returncode}: {' '.join(command)}\n{output}"
        )
    with open(os.path.join(model_dir, "results.json")) as f:
        repeated = json.load(f)["follow"]["records_repeated"]
    unit = min(-(-sizes.online_loop // WORKERS) * batch, sizes.online_file_records)
    return {"records_repeated": repeated, "unit_records": unit, "units_repeated": repeated / unit}


def _kill_at(launcher, log: str, trigger: str, model_dir: str) -> None:
    """SIGKILLs worker 1 of the cluster of `model_dir` in the middle of its third block.

    The first two lines of `log` holding `trigger` (the chief's progress
    lines) time a block; the kill comes half a block after the second, while
    the workers are inside their units rather than between blocks.
    """
    deadline, seen = time.monotonic() + RUN_TIMEOUT_S, []
    while len(seen) < 2:
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no two {trigger!r} lines before the run ended\n{tail(log)}")
        if tail(log, 100_000).count(trigger) > len(seen):
            seen.append(time.monotonic())
        time.sleep(0.02)
    time.sleep((seen[1] - seen[0]) / 2)
    pid = member_pid("worker", 1, model_dir)
    if pid is None:
        raise RuntimeError(f"worker 1 of {model_dir} not found")
    os.kill(pid, signal.SIGKILL)
