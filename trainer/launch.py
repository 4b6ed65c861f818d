"""`python -m trainer.launch`: a whole cluster of local processes, for development and tests.

    python -m trainer.launch --workers=2 -- --strategy=multi_worker
    python -m trainer.launch --workers=2 --ps=1 --evaluator -- \\
        --strategy=parameter_server --config=configs/ctr.py
    python -m trainer.launch --workers=2 --restarts=3 -- --strategy=multi_worker \\
        --model_dir=runs/mw

Every task runs `python -m trainer <the flags after -->` with its own
`TF_CONFIG`, on free ports of 127.0.0.1, in a network namespace of its own that
has only loopback (`towerflow.netns`; `--allow_network` runs it on the host's
network instead, reachable from other hosts). Topologies:

* `--ps=0` (collective all-reduce): worker:0 .. worker:N-1; worker 0 is the chief
  unless `--chief` adds a `chief` task.
* `--ps=M` (parameter servers): a `chief` (the coordinator), N workers and M ps.
* `--evaluator` adds an evaluator, which runs outside the training cluster.

Each output line is prefixed with its task (`[worker:1] ...`); the launcher's own
lines with `[launch]`. When the chief ends, the others get `--grace_s` seconds to
end too and are then stopped; when any task fails first, the chief gets a few
seconds to report it, then every task is stopped and the launcher exits with
that task's code. A task preempted by SIGTERM (exit 143) makes the others save
at the same step: they get `--grace_s` to finish. The exception is a worker of a
parameter-server cluster: it is started again (up to 3 times) and rejoins,
while the coordinator re-schedules the work it lost. `--restarts` starts a failed
cluster again; the trainer resumes from the checkpoint in its `model_dir`.
SIGINT (Ctrl-C) or SIGTERM to the launcher sends SIGTERM to the trainers (the
chief; under `multi_worker` every worker), which save a checkpoint at the step
reached and exit, within `--grace_s`; the ps and worker servers of a
parameter-server cluster are stopped only after that, as the chief's save
needs them. A second signal kills them all at once.
Beyond one machine, run `python -m trainer` on every host with the `TF_CONFIG`
that the scheduler gives each task.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from absl import app, flags

from strategies.cluster import tf_config as cluster
from towerflow import netns
from towerflow.errors import PREEMPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError, one_line
from towerflow.processes import (
    LOOPBACK,
    Console,
    Interrupt,
    pick_ports,
    signal_group,
    start_process,
    terminate,
)
from trainer import cli

GRACE_S = 15.0  # how long the other tasks may run on after the chief is done
KILL_AFTER_S = 5.0  # how long a task may take to exit after SIGTERM before SIGKILL
REPORT_S = 10.0  # how long the chief may take to report a failed task before the cluster stops
_POLL_S = 0.1
MAX_TASK_RESTARTS = 3  # a parameter-server worker that fails is started again this often

_WORKERS = flags.DEFINE_integer("workers", 1, "Number of worker tasks (at least 1).")
_PS = flags.DEFINE_integer(
    "ps", 0, "Number of parameter servers; more than 0 also adds a `chief` (the coordinator)."
)
_CHIEF = flags.DEFINE_bool("chief", False, "Add a `chief` task (always there when --ps > 0).")
_EVALUATOR = flags.DEFINE_bool("evaluator", False, "Add an `evaluator` task.")
_RESTARTS = flags.DEFINE_integer(
    "restarts", 0, "Start the whole cluster again this many times after it fails."
)
_PORT_BASE = flags.DEFINE_integer(
    "port_base", 0, "First of consecutive ports on 127.0.0.1; 0 picks free ports."
)
_GRACE_S = flags.DEFINE_float(
    "grace_s",
    GRACE_S,
    "Seconds the other tasks may run after the chief ends, before SIGTERM; also how long "
    "tasks may take to save and exit when the launcher is interrupted.",
)
_DATA_WORKERS = flags.DEFINE_integer(
    "data_workers",
    0,
    "Start a tf.data service dispatcher and this many data workers, and run every "
    "trainer's input on them (`--config.data.service=grpc://...`); 0 = input in the trainers.",
)
_ALLOW_NETWORK = flags.DEFINE_bool(
    "allow_network",
    False,
    "Run the cluster on this host's network, its servers reachable from other hosts; by "
    "default it runs in a network namespace of its own with only loopback (towerflow.netns).",
)
_MODULE = flags.DEFINE_string(
    "module", "trainer", "Module each task runs with `python -m` (for testing and advanced use)."
)


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a local cluster: a process (a TF_CONFIG "task").

    Attributes:
      type: "chief", "worker", "ps" or "evaluator".
      index: the task's index within its type.
      address: "127.0.0.1:port" of its server; None for the evaluator, which runs none.
      tf_config: the `TF_CONFIG` it runs with.
    """

    type: str
    index: int
    address: str | None
    tf_config: str

    @property
    def name(self) -> str:
        """How its output lines are prefixed: "chief", "worker:1", "ps:0", "evaluator"."""
        return self.type if self.type in ("chief", "evaluator") else f"{self.type}:{self.index}"

    @property
    def is_chief(self) -> bool:
        """Whether the cluster ends with this task."""
        return cluster.parse(self.tf_config).is_chief


def plan_cluster(
    workers: int, ps: int = 0, chief: bool = False, evaluator: bool = False, port_base: int = 0
) -> list[Member]:
    """The tasks of a local cluster, each with its address and `TF_CONFIG`.

    Args:
      workers: number of `worker` tasks (at least 1).
      ps: number of parameter servers; more than 0 also adds a `chief` (the coordinator).
      chief: add a `chief` task even without parameter servers.
      evaluator: add an `evaluator`. It runs no server, but it is listed in every
        task's `TF_CONFIG` so that the trainers know a sidecar evaluates for them.
      port_base: 0 picks free ports on 127.0.0.1; otherwise the first of consecutive ports.

    Raises:
      UserError: a count is out of range, or a port given by `port_base` is in use.
    """
    if workers < 1:
        raise UserError(f"`--workers` ({workers}) must be at least 1; pass e.g. `--workers=2`.")
    if ps < 0:
        raise UserError(f"`--ps` ({ps}) must be 0 or more; pass 0 for no parameter servers.")
    servers = [("chief", 0)] if chief or ps else []
    servers += [("worker", i) for i in range(workers)] + [("ps", i) for i in range(ps)]
    ports = pick_ports(len(servers) + evaluator, port_base)
    addresses = [f"{LOOPBACK}:{port}" for port in ports]
    jobs: dict[str, list[str]] = {}
    for (task_type, _), address in zip(servers, addresses, strict=False):
        jobs.setdefault(task_type, []).append(address)
    if evaluator:
        jobs["evaluator"] = [addresses[-1]]
    tasks = [
        Member(task_type, index, address, cluster.make_tf_config(jobs, task_type, index))
        for (task_type, index), address in zip(servers, addresses, strict=False)
    ]
    if evaluator:
        tasks.append(Member("evaluator", 0, None, cluster.make_tf_config(jobs, "evaluator", 0)))
    return tasks


class Cluster:
    """Runs one set of tasks as local processes until the chief ends or a task fails.

    Each task runs in its own process group, so stopping it stops its children too.
    """

    def __init__(
        self,
        tasks: Sequence[Member],
        command: Sequence[str],
        console: Console | None = None,
        grace_s: float = GRACE_S,
        kill_after_s: float = KILL_AFTER_S,
        report_s: float = REPORT_S,
        interrupt: Interrupt | None = None,
    ):
        """Creates the cluster; nothing starts before `run`.

        Args:
          tasks: from `plan_cluster`.
          command: what every task runs, e.g. `[sys.executable, "-m", "trainer", ...]`.
          console: where the tasks' prefixed output goes (default: stdout).
          grace_s: how long the other tasks may run on after the chief ends.
          kill_after_s: how long a task may take to exit after SIGTERM before SIGKILL.
          report_s: how long the chief may take to report a failed task before the stop.
          interrupt: a signal recorded here stops the cluster; `run` then returns its code.
        """
        self.tasks = list(tasks)
        self.command = list(command)
        self.console = console or Console()
        self.grace_s = grace_s
        self.kill_after_s = kill_after_s
        self.report_s = report_s
        self.interrupt = interrupt or Interrupt()
        self.max_task_restarts = MAX_TASK_RESTARTS
        self._procs: dict[Member, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._task_restarts: dict[Member, int] = {}

    def run(self) -> int:
        """Starts every task and waits; returns the chief's exit status, or the failed task's.

        Every process is stopped on the way out, whatever happens.
        """
        atexit.register(self.stop)
        try:
            for task in self.tasks:
                self._start(task)
            return self._wait()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stops every task and its children: SIGTERM, then SIGKILL after `kill_after_s`.

        The trainers go first (the chief; under `multi_worker` every worker, as
        they save at one agreed step), then the servers of a parameter-server
        cluster (its ps and worker tasks), once the trainers have exited or
        their time is up: the chief's final save reads the variables from the
        ps tasks and may still run steps on the workers. Stopped by a signal,
        the trainers get `grace_s` instead (if longer) to save. A second signal
        kills them all at once. If an exception cuts this short, the `atexit`
        hook, still registered, runs it again.
        """
        wait_s = self.kill_after_s
        running = [task.name for task, proc in self._procs.items() if proc.poll() is None]
        if running and self.interrupt.signal is not None:
            wait_s = max(wait_s, self.grace_s)
            self.console.log(
                f"stopping {', '.join(running)}: up to {wait_s:g} s to save and exit "
                "(signal again to kill them now)"
            )
        elif running:
            self.console.log(f"stopping {', '.join(running)}")
        servers = self._servers()
        trainers = [proc for task, proc in self._procs.items() if task not in servers]
        rest = [proc for task, proc in self._procs.items() if task in servers]
        killed = not terminate(trainers, wait_s, self.interrupt, self.console)
        if not killed and rest:
            terminate(rest, self.kill_after_s, self.interrupt, self.console)
        for proc in self._procs.values():
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        for pump in self._pumps:
            pump.join(timeout=1.0)  # its pipe closed with the last process of the group
        self._procs.clear()
        self._pumps.clear()
        atexit.unregister(self.stop)

    def _servers(self) -> set[Member]:
        """The tasks that only serve the chief: the ps and workers of a parameter-server cluster."""
        if not any(task.type == "ps" for task in self.tasks):
            return set()
        return {task for task in self.tasks if task.type in ("ps", "worker")}

    def _start(self, task: Member) -> None:
        env = {**os.environ, "TF_CONFIG": task.tf_config}
        proc, pump = start_process(
            self.command, env, functools.partial(self.console.write, task.name)
        )
        self._procs[task] = proc
        self._pumps.append(pump)

    def _restartable(self, task: Member) -> bool:
        """A parameter-server cluster tolerates a lost worker: start it again, a few times."""
        has_ps = any(t.type == "ps" for t in self.tasks)
        if task.type != "worker" or not has_ps:
            return False
        self._task_restarts[task] = self._task_restarts.get(task, 0) + 1
        return self._task_restarts[task] <= self.max_task_restarts

    def _wait(self) -> int:
        chief = next(task for task in self.tasks if task.is_chief)
        others = {task: proc for task, proc in self._procs.items() if task != chief}
        while (code := self._procs[chief].poll()) is None:
            if self._interrupted():
                return self.interrupt.code
            for task, proc in list(others.items()):
                if not proc.poll():  # running, or ended well
                    continue
                if self._restartable(task):
                    self.console.log(
                        f"{task.name} {_ended(proc.returncode)}; restarting it (attempt "
                        f"{self._task_restarts[task]} of {self.max_task_restarts}); the "
                        "coordinator re-schedules its work"
                    )
                    self._start(task)
                    others[task] = self._procs[task]
                    continue
                return self._after_failure(task, proc.returncode, chief)
            time.sleep(_POLL_S)
        label = chief.name if chief.type == "chief" else f"{chief.name} (the chief)"
        self.console.log(f"{label} {_ended(code)}")
        if code == 0 and any(proc.poll() is None for proc in others.values()):
            self.console.log(f"waiting up to {self.grace_s:g} s for the other tasks to end")
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and any(p.poll() is None for p in others.values()):
                if self._interrupted():
                    return self.interrupt.code
                time.sleep(_POLL_S)
        return _exit_status(code)

    def _interrupted(self) -> bool:
        if self.interrupt.signal is None:
            return False
        self.console.log(f"got {signal.Signals(self.interrupt.signal).name}")
        return True

    def _after_failure(self, task: Member, code: int, chief: Member) -> int:
        """A task other than the chief failed: let the chief end on its own first, briefly.

        A preempted task (exit 143) is saving with the others at one agreed step:
        they get `grace_s` to finish. Otherwise the chief gets `report_s` to
        notice the loss and say which task it lost, before the cluster is stopped.
        """
        preempted = code == PREEMPTED_EXIT_CODE
        wait_s = self.grace_s if preempted else self.report_s
        action = "letting the others save" if preempted else "letting the chief report"
        self.console.log(f"{task.name} {_ended(code)}; {action} (up to {wait_s:g} s)")
        deadline = time.monotonic() + wait_s
        while self._procs[chief].poll() is None and time.monotonic() < deadline:
            if self._interrupted():
                return self.interrupt.code
            time.sleep(_POLL_S)
        chief_code = self._procs[chief].poll()
        if chief_code is not None:
            self.console.log(f"{chief.name} {_ended(chief_code)}")
            if preempted:
                return _exit_status(chief_code)
        return _exit_status(code)


def _ended(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    """A child's return code as a shell reports it: 128 + N for death by signal N."""
    return 128 - code if code < 0 else code


def launch(
    command: Sequence[str],
    workers: int,
    ps: int = 0,
    chief: bool = False,
    evaluator: bool = False,
    restarts: int = 0,
    port_base: int = 0,
    grace_s: float = GRACE_S,
    console: Console | None = None,
    report_s: float = REPORT_S,
    interrupt: Interrupt | None = None,
    data_workers: int = 0,
) -> int:
    """Runs a local cluster, starting it again after a failure up to `restarts` times.

    Args:
      command: what every task runs, e.g. `[sys.executable, "-m", "trainer", ...]`.
      workers, ps, chief, evaluator, port_base: the topology, as in `plan_cluster`.
      restarts: how many times to start a failed cluster again, on fresh ports. A
        user error (exit status 2) is not retried: it would fail the same way.
      grace_s: how long the other tasks may run on after the chief ends.
      console: where the prefixed output goes (default: stdout).
      report_s: how long the chief may take to report a failed task before the stop.
      interrupt: a signal recorded here stops the cluster, with no restart.
      data_workers: more than 0 starts a tf.data service (a dispatcher and this many
        workers, prefixed `[data:...]`) for the whole run, restarts included, and
        points every task's input at it.

    Returns:
      The exit status of the last attempt: the chief's, that of the task that failed,
      or 128 + the signal number after an interrupt.

    Raises:
      UserError: a flag is out of range or a port is in use.
    """
    if restarts < 0:
        raise UserError(f"`--restarts` ({restarts}) must be 0 or more; pass 0 for no restarts.")
    if grace_s < 0:
        raise UserError(f"`--grace_s` ({grace_s}) must be 0 or more seconds; pass e.g. 15.")
    if data_workers < 0:
        raise UserError(
            f"`--data_workers` ({data_workers}) must be 0 (input in the trainers) or more."
        )
    console = console or Console()
    interrupt = interrupt or Interrupt()
    with contextlib.ExitStack() as stack:
        if data_workers:
            address = _start_data_service(data_workers, console, stack)
            command = [*command, f"--config.data.service={address}"]
        return _attempts(
            command, workers, ps, chief, evaluator, restarts, port_base, grace_s, console,
            report_s, interrupt,
        )  # fmt: skip


def _start_data_service(workers: int, console: Console, stack: contextlib.ExitStack) -> str:
    """A dispatcher and `workers` data workers, stopped with `stack`; the dispatcher's address."""
    with cli.native_stderr_silenced():  # it imports TensorFlow: only when asked for
        from trainer.data import service

    servers = stack.enter_context(service.LocalService(pick_ports(workers + 1), console))
    service.wait_until_served(servers.address, servers, service.TIMEOUT_S)
    console.log(f"tf.data service at {servers.address}, data workers: {workers}")
    return servers.address


def _attempts(
    command: Sequence[str],
    workers: int,
    ps: int,
    chief: bool,
    evaluator: bool,
    restarts: int,
    port_base: int,
    grace_s: float,
    console: Console,
    report_s: float,
    interrupt: Interrupt,
) -> int:
    """Runs the cluster up to `restarts` + 1 times, while it fails; the last exit status."""
    attempts = restarts + 1
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            console.log(f"restarting cluster (attempt {attempt} of {attempts})")
        tasks = plan_cluster(workers, ps, chief, evaluator, port_base)
        attempt_cluster = Cluster(
            tasks, command, console, grace_s, report_s=report_s, interrupt=interrupt
        )
        code = attempt_cluster.run()
        if code in (0, USER_ERROR_EXIT_CODE) or interrupt.signal is not None:
            break
    return code


def main(argv: list[str]) -> None:
    console = Console()
    try:
        with Interrupt().catching() as interrupt:
            args = argv[1:]
            netns.loopback_only(
                "the local cluster", "--allow_network", args, _ALLOW_NETWORK.value, console.log
            )
            code = launch(
                [sys.executable, "-m", _MODULE.value, *args],
                workers=_WORKERS.value,
                ps=_PS.value,
                chief=_CHIEF.value,
                evaluator=_EVALUATOR.value,
                restarts=_RESTARTS.value,
                port_base=_PORT_BASE.value,
                grace_s=_GRACE_S.value,
                console=console,
                interrupt=interrupt,
                data_workers=_DATA_WORKERS.value,
            )
    except UserError as e:
        cli.fail(one_line(e))
    sys.exit(code)


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=cli.parse_own_flags)
