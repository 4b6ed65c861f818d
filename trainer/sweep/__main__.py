"""`python -m trainer.sweep`: a hyper-parameter sweep, one trial per device.

    python -m trainer.sweep --config=configs/default.py \\
        --sweep.optimizer.learning_rate=1e-3,3e-3,1e-2 \\
        --sweep.model.hidden_units="(128,),(256,256)" \\
        [--search=grid|random --trials=N --seed=S] [--parallel=auto|N] \\
        [--metric=eval/accuracy --mode=auto|max|min] [--sweep_dir=runs/sweep-default] \\
        -- <any trainer flags, e.g. --strategy=one_device --config.train.steps=500>

Each trial is an ordinary `python -m trainer` job with its own `--model_dir`
under the sweep directory, so it is resumable, inspectable and exportable like
any run, and it writes its hyper-parameters for TensorBoard's HParams
dashboard: `tensorboard --logdir <sweep dir>` compares the trials. Trials start
as forks of one process that imported TensorFlow once (`towerflow.forkserver`,
as a local cluster's members do; `--nofork_trials`: an interpreter each).

Placement: each trial runs in a slot of its own (`trainer.sweep.plan.plan_slots`):
on GPUs it sees its GPU(s) only (`CUDA_VISIBLE_DEVICES`); its process is pinned
to its share of the CPU cores, so TensorFlow sizes its thread pools to that
share (`devices.intra_op_threads=0`, auto) and `--parallel` trials do not
oversubscribe the cores. `--parallel=auto` is one trial per GPU, or one at a
time on a machine without GPUs (trials side by side only split its cores).

At the end, a table (one row per trial, ranked by `--metric`, the best one
named), `sweep.json` and `sweep.csv` in the sweep directory. A failed trial is
reported in its row with its one-line error and the others go on (the exit
status is 1 when a trial did not finish). Ctrl-C sends SIGTERM to the running
trials, which save a checkpoint and exit within `--grace_s` (a second Ctrl-C
kills them at once).
Running the same command again resumes: finished trials are not run again,
interrupted ones resume from their checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from absl import app, flags

from towerflow import forkserver, netns, processes, storage
from towerflow.errors import PREEMPTED_EXIT_CODE, UserError, one_line
from trainer import cli
from trainer.sweep import plan as sweep_plan
from trainer.sweep import results as sweep_results
from trainer.sweep.plan import Trial, TrialSlot
from trainer.sweep.results import FAILED, FINISHED, INTERRUPTED, Row

GRACE_S = 15.0  # how long interrupted trials may take to save a checkpoint and exit

_CONFIG = flags.DEFINE_string(
    "config", None, "Config file every trial runs (default: configs/default.py)."
)
_SEARCH = flags.DEFINE_enum("search", "grid", ["grid", "random"], "How trials are chosen.")
_TRIALS = flags.DEFINE_integer(
    "trials", 0, "Number of trials: grid, the first N combinations (0 = all); random, N drawn."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random search.")
_PARALLEL = flags.DEFINE_string(
    "parallel", "auto", "Trials at once: auto (one per GPU; 1 without GPUs) or a count."
)
_METRIC = flags.DEFINE_string("metric", "eval/accuracy", "Ranks the trials: train/<m> or eval/<m>.")
_MODE = flags.DEFINE_enum(
    "mode", "auto", list(sweep_results.MODES), "max, min, or auto (min for a loss, else max)."
)
_SWEEP_DIR = flags.DEFINE_string(
    "sweep_dir",
    None,
    "Where the trials' model_dirs and the results go (default: runs/sweep-<config>).",
)
# `trainer.launch` has a `--grace_s` of its own; a process that imports both (a
# test run) keeps one definition instead of failing, and each program reads its own.
_GRACE_S = flags.DEFINE_float(
    "grace_s",
    GRACE_S,
    "Seconds interrupted trials get to save a checkpoint and exit.",
    allow_override=True,
)
_SHARE_INPUT = flags.DEFINE_bool(
    "share_input",
    False,
    "Run the trials' input on one tf.data service (a dispatcher and a data worker the sweep "
    "starts); trials with identical pipelines read one shared stream, made once.",
)
_ALLOW_NETWORK = flags.DEFINE_bool(
    "allow_network",
    False,
    "With --share_input: run the service on this host's network, reachable from other hosts; "
    "by default the sweep moves into a network namespace with only loopback (towerflow.netns).",
    # The launcher's and the sweep's flag mean the same; a process may import both.
    allow_override=True,
)
_FORK_TRIALS = flags.DEFINE_bool(
    "fork_trials",
    True,
    "Start each trial (and --share_input's servers) as a fork of one process that imported "
    "TensorFlow once (about 3 s of CPU less per trial, towerflow.forkserver), on its slot's "
    "cores; --nofork_trials starts each with an interpreter of its own.",
)
# The trials' server: started with the first trial, ended with the sweep.
TRIALS = forkserver.Client(preload=cli.MEMBER_MODULES)
_SWEEP_VALUES: dict[str, str] = {}  # `--sweep.<field>=<values>`, taken out before absl parses


class _Log:
    """A trial's log in the sweep directory, appended to line by line by its output pump."""

    def __init__(self, path: str):
        self._file = storage.open_file(path, "a")
        # Each flush of a file in a bucket uploads it whole: there the log is written
        # when the trial ends; a local one can be followed as it grows.
        self._flush = storage.is_local(path)
        self._lock = threading.Lock()  # the pump writes while `_finish` may close

    def write(self, line: str) -> None:
        """Appends `line`; does nothing once closed (a pump that outlived its join)."""
        with self._lock:
            if self._file is None:
                return
            self._file.write(line + "\n")
            if self._flush:
                self._file.flush()

    def close(self) -> None:
        """Writes out what is left; later lines are dropped."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclasses.dataclass
class _Running:
    """A trial's process while it runs."""

    trial: Trial
    slot: TrialSlot
    proc: subprocess.Popen
    pump: threading.Thread
    log: _Log
    started: float
    last_error: list[str]


def run_sweep(
    trials: Sequence[Trial],
    trainer_args: Sequence[str],
    config_path: str,
    sweep_dir: str,
    slots: Sequence[TrialSlot],
    console: processes.Console,
    interrupt: processes.Interrupt,
    grace_s: float = GRACE_S,
) -> list[Row]:
    """Runs the trials not finished yet, `len(slots)` at a time; returns one row per trial.

    Args:
      trials: from `sweep_plan.plan_trials`.
      trainer_args: the trainer flags every trial gets.
      config_path: the `--config` every trial runs.
      sweep_dir: the trials' `model_dir`s go under it, their logs in its `logs/`.
      slots: where trials run (`sweep_plan.plan_slots`); one trial per slot at a time.
      console: where the trials' prefixed output goes.
      interrupt: a signal recorded here stops every trial (SIGTERM, `grace_s`, SIGKILL).
      grace_s: how long interrupted trials may take to save and exit.
    """
    rows = {t.name: Row(t.name, dict(t.overrides)) for t in trials}
    pending = []
    for trial in trials:
        row = rows[trial.name]
        row.model_dir = os.path.join(sweep_dir, trial.name)
        if _finished_before(trial, row):
            console.log(
                f"{trial.name}: finished in an earlier run (step {row.step}); not run again"
            )
        else:
            pending.append(trial)
    storage.makedirs(os.path.join(sweep_dir, "logs"))
    running: dict[int, _Running] = {}  # by slot index: slots may share cores, so look alike
    try:
        while pending or running:
            if interrupt.signal is not None:
                console.log(f"got {signal.Signals(interrupt.signal).name}")
                break
            for i in [i for i in range(len(slots)) if i not in running][: len(pending)]:
                trial = pending.pop(0)
                running[i] = _start(trial, slots[i], trainer_args, config_path, sweep_dir, console)
            for i, run in list(running.items()):
                if run.proc.poll() is not None:
                    del running[i]
                    _finish(run, rows[run.trial.name], console)
            time.sleep(processes.POLL_S)
    finally:
        _stop(list(running.values()), rows, console, interrupt, grace_s)
    return list(rows.values())


def _finished_before(trial: Trial, row: Row) -> bool:
    """Whether the trial's `results.json` already holds its final step (it is not run again).

    With `train.epochs` the final step depends on the data: such a trial is run
    again, and its trainer, resumed at the end, only evaluates.
    """
    results = sweep_results.read_results(row.model_dir)
    if results is None or trial.config.train.epochs:
        return False
    if results.get("step", 0) < trial.config.train.steps:
        return False
    row.status, row.step = FINISHED, results["step"]
    row.train, row.eval = results.get("train", {}), results.get("eval", {})
    row.wall_time_s = results.get("wall_time_s", 0.0)
    return True


def _start(
    trial: Trial,
    slot: TrialSlot,
    trainer_args: Sequence[str],
    config_path: str,
    sweep_dir: str,
    console: processes.Console,
) -> _Running:
    model_dir = os.path.join(sweep_dir, trial.name)
    command = [
        sys.executable,
        "-m",
        "trainer",
        f"--config={config_path}",
        *trainer_args,
        *trial.flags,
        f"--model_dir={model_dir}",
    ]
    log = _Log(os.path.join(sweep_dir, "logs", f"{trial.name}.log"))
    last_error: list[str] = []
    prefix = f"{trial.index:02d}"

    def on_line(line: str) -> None:
        if line.startswith("error: "):
            last_error[:] = [line.removeprefix("error: ")]
        log.write(line)
        console.write(prefix, line)

    console.log(f"{prefix}: starting {trial.name} on {slot.describe()}")
    # Its thread pools are its share of the cores: a trial started anew inherits them, a
    # forked one is given them.
    with _pinned(slot.cores):
        proc, pump = TRIALS.start(command, {**os.environ, **slot.env()}, on_line, slot.cores)
    return _Running(trial, slot, proc, pump, log, time.monotonic(), last_error)


@contextlib.contextmanager
def _pinned(cores: Sequence[int]) -> Iterator[None]:
    """Runs the block on `cores` only; a process started in it inherits them.

    The affinity is the calling thread's (Linux), so the sweep's other threads
    keep every core; it is restored afterwards. (The trial's output pump, a
    thread started in the block, keeps the trial's cores: it only reads a pipe.)
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _finish(run: _Running, row: Row, console: processes.Console) -> None:
    """Fills the trial's row from its exit status and `results.json`."""
    processes.signal_group(run.proc, signal.SIGKILL)  # anything the trial left behind
    run.pump.join(timeout=5.0)  # its pipe closed with the last process of the group
    run.log.close()
    code = run.proc.returncode
    row.wall_time_s = round(time.monotonic() - run.started, 2)
    results = sweep_results.read_results(row.model_dir) or {}
    row.step = results.get("step", 0)
    if code == 0:
        row.status = FINISHED
        row.train, row.eval = results.get("train", {}), results.get("eval", {})
    elif code in (-signal.SIGTERM, PREEMPTED_EXIT_CODE):
        row.status = INTERRUPTED
    else:
        row.status = FAILED
        ended = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        row.error = run.last_error[0] if run.last_error else f"the trainer ended with {ended}"
    console.log(f"{run.trial.index:02d}: {row.status}" + (f": {row.error}" if row.error else ""))


def _stop(
    runs: list[_Running],
    rows: dict[str, Row],
    console: processes.Console,
    interrupt: processes.Interrupt,
    grace_s: float,
) -> None:
    """Stops the running trials as `trainer.launch` stops its members: SIGTERM, a grace, SIGKILL."""
    if not runs:
        return
    console.log(
        f"stopping {len(runs)} trial(s): up to {grace_s:g} s to save a checkpoint and exit "
        "(signal again to kill them now)"
    )
    procs = [run.proc for run in runs]
    processes.terminate(procs, grace_s, interrupt, console)
    processes.reap(procs)
    for run in runs:
        _finish(run, rows[run.trial.name], console)
        row = rows[run.trial.name]
        if row.status == FAILED and run.proc.returncode < 0:  # killed at the end of its grace
            row.status, row.error = INTERRUPTED, ""


def main(argv: list[str]) -> None:
    """Plans the sweep, runs it, writes and prints the results; exits 1 unless all finished."""
    console = processes.Console(own="sweep")
    try:
        with processes.Interrupt().catching() as interrupt:
            if _SHARE_INPUT.value:  # before TensorFlow starts a thread
                values = [*argv[1:], _SWEEP_DIR.value or ""]
                what = "the sweep's shared input"
                netns.loopback_only(
                    what, "--allow_network", values, _ALLOW_NETWORK.value, console.log
                )
            code = sweep(argv[1:], console, interrupt)
    except UserError as e:
        cli.fail(one_line(e))
    sys.exit(code)


def sweep(
    trainer_args: Sequence[str], console: processes.Console, interrupt: processes.Interrupt
) -> int:
    """The whole command once its flags are parsed; returns its exit status.

    Raises:
      UserError: a bad sweep flag, field or value; no trial has started.
    """
    mode = sweep_results.check_metric(_METRIC.value, _MODE.value)
    config_path = cli.resolve_config_arg(
        ["sweep", f"--config={_CONFIG.value or cli.CONFIG_DIR / 'default.py'}"]
    )[1].split("=", 1)[1]
    trials = sweep_plan.plan_trials(
        config_path, _SWEEP_VALUES, trainer_args, _SEARCH.value, _TRIALS.value, _SEED.value
    )
    per_trial = max(sweep_plan.devices_per_trial(t.config) for t in trials)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    slots = sweep_plan.plan_slots(_PARALLEL.value, per_trial, sweep_plan.visible_gpus(), cores)
    name = os.path.splitext(os.path.basename(config_path))[0]
    sweep_dir = _SWEEP_DIR.value or os.path.join("runs", f"sweep-{name}")
    with processes.native_stderr_silenced():  # the first file access loads TensorFlow: no chatter
        check_sweep_dir(sweep_dir)
    console.log(
        f"{len(trials)} trial(s) in {sweep_dir}, {len(slots)} at a time "
        f"({'; '.join(s.describe() for s in slots)})"
    )
    with contextlib.ExitStack() as stack:
        TRIALS.enabled = _FORK_TRIALS.value
        stack.callback(TRIALS.close)  # after the trials and the servers: they were forked from it
        if _SHARE_INPUT.value:
            trials = _sharing_input(trials, stack, console)
        rows = run_sweep(
            trials, trainer_args, config_path, sweep_dir, slots, console, interrupt, _GRACE_S.value
        )
    rows = sweep_results.ranked(rows, _METRIC.value, mode)
    sweep_results.write(sweep_dir, rows, _METRIC.value, mode)
    print(sweep_results.table(rows, _METRIC.value), flush=True)
    print(
        f"results: {os.path.join(sweep_dir, 'sweep.json')}, sweep.csv; "
        f"tensorboard --logdir {sweep_dir}",
        flush=True,
    )
    if interrupt.signal is not None:
        return interrupt.code
    return 0 if all(r.status == FINISHED for r in rows) else 1


def _sharing_input(
    trials: Sequence[Trial], stack: contextlib.ExitStack, console: processes.Console
) -> list[Trial]:
    """`trials` reading their input from one tf.data service, started here until `stack` ends.

    Trials whose pipelines are identical (the same `data` config, seed, global
    batch and task) name the same tf.data service job (`data.service_job`), so
    the data worker makes their batches once and each of them reads every batch
    (TF's cross-trainer cache). A trial joins the stream where it is when it starts: trials that run
    side by side read the same batches; one started later reads on from there.
    """
    from trainer.data import service_client  # TensorFlow, only when asked for

    servers = stack.enter_context(service_client.serving_locally(1, console, TRIALS))
    groups: dict[str, list[Trial]] = {}
    for trial in trials:
        groups.setdefault(_pipeline_key(trial.config), []).append(trial)
    shared = []
    for key, group in groups.items():
        service_job = f"input-{key}" if len(group) > 1 else ""
        names = ", ".join(f"{t.index:02d}" for t in group)
        console.log(
            f"trials {names}: one shared input stream ({service_job})"
            if service_job
            else f"trial {names}: an input stream of its own"
        )
        extra = (("data.service", servers.address), ("data.service_job", service_job))
        shared += [dataclasses.replace(t, settings=(*t.settings, *extra)) for t in group]
    console.log(f"input on the tf.data service at {servers.address}")
    return sorted(shared, key=lambda t: t.index)


def _pipeline_key(config) -> str:
    """The same for trials whose training input pipelines are identical."""
    import hashlib

    parts = (config.data, config.seed, config.train.global_batch_size, config.task.name)
    return hashlib.sha1(repr([str(p) for p in parts]).encode()).hexdigest()[:10]


def check_sweep_dir(sweep_dir: str) -> None:
    """`--sweep_dir`, local or remote (see `towerflow.storage`), must not be a file.

    Raises:
      UserError: it is a file, or TensorFlow has no file system for its scheme.
    """
    storage.check_scheme(sweep_dir, "--sweep_dir")
    if storage.is_file(sweep_dir):
        raise UserError(
            f"`--sweep_dir` '{sweep_dir}' is a file, not a directory; give a directory."
        )


def _parse_flags(argv: list[str]) -> list[str]:
    """absl parsing of the sweep's own flags, after taking out `--sweep.<field>=` ones."""
    try:
        rest, sweeps = sweep_plan.split_sweep_args(argv)
    except UserError as e:
        cli.fail(one_line(e))
    _SWEEP_VALUES.update(sweeps)
    return cli.parse_own_flags(rest)


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_parse_flags)
