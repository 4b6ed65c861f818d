"""The benchmark's harness: a process per case, repetitions in turn, medians, paired ratios.

`benchmark` runs cases (each a module of this package named after the case,
with `run(sizes, reps, workdir) -> dict`), each in a child process set up as
the trainer sets up the case's strategy; `table` prints the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from towerflow import renamed
from towerflow.processes import member_identity
from trainer.bench import clock
from trainer.bench.sizes import FULL, LOGICAL_CPUS, QUICK, case_strategy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TimedRun = Callable[[], float]  # one timed repetition -> a rate (examples/s, or FLOP/s)


# --- repetitions and statistics ------------------------------------------------------------


def alternate(
    contenders: dict[str, TimedRun], reps: int, failed: dict[str, str] | None = None
) -> dict[str, list[float]]:
    """Runs the contenders in turn `reps` times, in another order each round (A B C, A C B, C A B).

    Each round starts one later, every other one backwards. Each contender
    first warms up once, unless it is `self_warming` (it leaves its own first
    loop out of every timing). The rounds give every contender another place,
    and another one before it: a rotation alone keeps each after the same one
    (and what that one leaves behind: threads, memory, caches). What a
    contender left for the collector is collected before the next starts. A
    contender that fails is left out, with the reason in `failed` (Keras `fit`
    cannot run some configurations at all).
    """
    contenders = dict(contenders)
    samples: dict[str, list[float]] = {name: [] for name in contenders}

    def attempt(name: str) -> float | None:
        try:
            return contenders[name]()
        except Exception as e:
            if failed is None:
                raise
            failed[name] = telling_line(e)
            note(f"  {name} failed, left out: {failed[name]}")
            del contenders[name], samples[name]
            return None

    for name in list(contenders):
        if not getattr(contenders[name], "self_warming", False):
            note(f"  warm-up {name}")
            attempt(name)
    for rep in range(reps):
        names = list(contenders)
        shift = rep % max(1, len(names))
        order = names[shift:] + names[:shift]
        for name in order[::-1] if rep % 2 else order:
            gc.collect()  # the one before's garbage (iterators, traces) is not this one's time
            rate = attempt(name)
            if rate is not None:
                samples[name].append(rate)
                note(f"  rep {rep + 1}/{reps} {name}: {rate:.4g}")
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """The median of each figure's repetitions."""
    return {name: statistics.median(values) for name, values in samples.items()}


def paired(samples: dict[str, list[float]], fn: Callable[[dict[str, float]], float]) -> float:
    """The median over rounds of `fn(that round's figures)`.

    Contenders of one round ran back to back, so a ratio within a round is
    less disturbed by load that comes and goes than a ratio of medians.
    """
    rounds = max(len(v) for v in samples.values())  # some figures run fewer rounds (clusters)
    return statistics.median(
        fn({k: v[i] for k, v in samples.items() if i < len(v)}) for i in range(rounds)
    )


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` takes."""
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def result(unit: str, figures: dict, ratios: dict, samples: dict, **extra) -> dict:
    """A case's result: its figures (medians), ratios, every repetition, and details."""
    return {"unit": unit, "figures": figures, "ratios": ratios, "samples": samples, **extra}


def telling_line(error: BaseException) -> str:
    """The telling line of an error: TF's first root error if there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    root = [line for line in lines if re.match(r"\(0\) [A-Z_]+:", line)]
    return f"{type(error).__name__}: {(root or lines or [''])[0][:300]}"


def note(line: str) -> None:
    """Progress of the benchmark, on stderr (stdout holds the table)."""
    print(line, file=sys.stderr, flush=True)


# --- other processes -------------------------------------------------------------------


@contextlib.contextmanager
def child(
    command: list[str], log: str, marks: str | None = None, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """Runs `command` from the repository, its output to the file `log`; killed on the way out.

    Args:
      command: the command line.
      log: the file its stdout and stderr go to (`tail` reads it for errors).
      marks: where a trainer given `train.actions=trainer.bench.clock:to_file`
        writes its clock's marks.
      env: more environment variables (e.g. a cluster member's `TF_CONFIG`).
    """
    extra = env or {}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    if marks:
        env[clock.FILE_VARIABLE] = marks
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def cluster_marks(
    topology: list[str],
    args: list[str],
    overrides: dict,
    model_dir: str,
    steps: int,
    loop: int,
    cpu: dict[str, float] | None = None,
) -> list:
    """The chief's clock marks of a local cluster (`python -m trainer.launch`) run to its end.

    The trainer runs `steps` + 1 steps (the end-of-run checkpoint comes after
    the last, untimed) in loops of `loop`, without checkpoints, exports or evals.

    Args:
      topology: the launcher's flags (`--workers=2`, `--ps=1`).
      args: the trainer's flags (`--model_dir` is added).
      overrides: more "a.b.c": value config overrides.
      model_dir: the run's model_dir; its clock marks and log go beside it.
      steps: the steps to time.
      loop: steps per loop.
      cpu: if given, filled with the CPU milliseconds per step of each task
        type (`cluster_cpu_ms`).

    Raises:
      RuntimeError: the cluster failed (with the end of its output).
    """
    overrides = {
        **overrides,
        "train.steps": steps + 1,
        "train.steps_per_loop": loop,
        "train.checkpoint_every": 0,
        "train.export": False,
        "eval.every": 0,
        "train.actions": "trainer.bench.clock:to_file",
    }
    command = [sys.executable, "-m", "trainer.launch", *topology, "--", *args]
    command += [f"--model_dir={model_dir}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    marks, log = model_dir + ".clock", model_dir + ".log"
    with child(command, log, marks) as process:
        if cpu is None:
            process.wait()
        else:
            cpu.update(cluster_cpu_ms(process, marks, steps))
    if process.returncode:
        raise RuntimeError(
            f"cluster exited with {process.returncode}: {' '.join(command)}\n{tail(log)}"
        )
    return clock.read(marks)


def cluster_cpu_ms(process: subprocess.Popen, marks: str, steps: int) -> dict[str, float]:
    """CPU milliseconds per step of each task type of a local cluster, once it has ended.

    Between the chief's first marks past 1/4 and 3/4 of `steps` (steady state:
    no start-up), each task type's processes summed (`chief`, `worker`,
    `ps`: by their `TF_CONFIG`), polled while `process` (the launcher) runs.
    Empty if the run ended before both.
    """
    samples = []
    while process.poll() is None:
        done = clock.read(marks)
        if len(samples) < 2 and done and done[-1][0] >= steps * (1 + 2 * len(samples)) // 4:
            samples.append((done[-1][0], cluster_cpu_s(process.pid)))
        time.sleep(0.05)
    if len(samples) < 2:
        return {}
    (first, before), (last, after) = samples
    return {kind: (after[kind] - before.get(kind, 0.0)) * 1e3 / (last - first) for kind in after}


def cluster_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds of the cluster's members descended from process `root`, by task type."""
    seconds: dict[str, float] = {}
    for pid, (_, used, _) in descendants_cpu_s(root).items():
        kind = _task_type(pid)
        if kind:
            seconds[kind] = seconds.get(kind, 0.0) + used
    return seconds


def _task_type(pid: int) -> str | None:
    """The type (chief, worker, ps, evaluator) of the cluster member `pid` is, or None."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return (member_identity(pid) or {}).get("type")
    return None


def descendants_cpu_s(root: int) -> dict[int, tuple[list[bytes], float, int]]:
    """The argv, CPU seconds (user + system) and parent of each process descended from `root`."""
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            parents[int(entry)] = int(fields[1])
            ticks = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
            commands[int(entry)] = (argv, ticks / os.sysconf("SC_CLK_TCK"))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return {pid: (*command, parents[pid]) for pid, command in commands.items() if descends(pid)}


def tail(log: str, chars: int = 500) -> str:
    """The end of a child's output."""
    with open(log, errors="replace") as f:
        return f.read()[-chars:]


# --- running the cases -------------------------------------------------------------------


def benchmark(cases: list[str], quick: bool, reps: int, in_process: bool = False) -> dict:
    """Runs `cases`; returns the machine, the sizes and every case's figures.

    Each case runs in a process of its own, set up (logical CPUs, threads per
    op) as the trainer sets up that case's strategy: `dense_large` as
    `one_device`, the others as the default strategy, whose towers share the
    cores. The setup holds for the whole process, so every contender of a case
    runs with it. `in_process` runs `cases` here instead, set up for the first.
    """
    if not in_process:
        return _in_children(cases, quick, reps)
    import strategies
    from strategies import devices

    replicas = strategies.local_replicas(
        strategies.plugin(case_strategy(cases[0])), None, LOGICAL_CPUS
    )
    devices.configure(LOGICAL_CPUS, replicas=replicas)
    sizes = QUICK if quick else FULL
    results = {"machine": machine(), "quick": quick, "reps": reps, "cases": {}}
    results["sizes"] = dataclasses.asdict(sizes)
    workdir = tempfile.mkdtemp(prefix="towerflow-bench-")
    try:
        for case in cases:
            note(f"{case}:")
            run = importlib.import_module(f"trainer.bench.{case}").run
            tic = time.perf_counter()
            results["cases"][case] = run(sizes, reps, workdir)
            results["cases"][case]["case_wall_s"] = time.perf_counter() - tic
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _in_children(cases: list[str], quick: bool, reps: int) -> dict:
    """`benchmark` of each case in a child process; their notes stream to stderr.

    With `quick` (a smoke test), neighbouring cases set up alike share a child,
    so that it spends its time in the cases rather than in starting TensorFlow.
    """
    if quick:
        groups = [",".join(group) for _, group in itertools.groupby(cases, case_strategy)]
    else:
        groups = list(cases)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="towerflow-bench-") as scratch:
        for i, group in enumerate(groups):
            path = os.path.join(scratch, f"{i}.json")
            command = [sys.executable, "-m", "trainer.bench", "--in_process", f"--cases={group}"]
            command += [f"--reps={reps}", f"--json={path}", *(["--quick"] if quick else [])]
            code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
            if code:  # its own error is on stderr already
                sys.exit(f"error: the {group} case exited with {code}: {' '.join(command)}")
            with open(path) as f:
                part = json.load(f)
            if results:  # the first case's machine and sizes stand for all
                results["cases"].update(part["cases"])
            else:
                results = part
    return results


# --- reporting -------------------------------------------------------------------------


def machine() -> dict:
    """What the figures were measured on."""
    import keras
    import tensorflow as tf

    model = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return {
        "cpu": model,
        "cpu_cores": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "load_average_at_start": os.getloadavg()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": sys.version.split()[0],
    }


def table(results: dict) -> str:
    """The figures and ratios of every case, as Markdown tables.

    `spread` is (max - min) / median of a figure's repetitions.
    """
    lines = []
    for case, case_result in results["cases"].items():
        lines += ["", f"### {case} ({case_result['unit']})", ""]
        lines += ["| figure | median | spread |", "| --- | --- | --- |"]
        for name, value in case_result["figures"].items():
            runs = case_result["samples"].get(name, [])
            spread = f"{(max(runs) - min(runs)) / statistics.median(runs):.0%}" if runs else "-"
            lines.append(f"| {name} | {_fmt(value)} | {spread} |")
        lines += [f"| **{k}** | **{_fmt(v)}** | |" for k, v in case_result["ratios"].items()]
        for key, value in case_result.items():
            if key not in ("unit", "figures", "ratios", "samples"):
                lines.append(f"\n{key}: {_fmt(value)}")
    return "\n".join(lines).strip() + "\n"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(_fmt(v) for v in value) or "-"
    return str(value)


__getattr__ = renamed.old_names(__name__, {"Run": "TimedRun"}, globals())
