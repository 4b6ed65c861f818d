"""`python -m trainer.launch`: a whole cluster of local processes, for development and tests.

    python -m trainer.launch --workers=2 -- --strategy=multi_worker
    python -m trainer.launch --workers=2 --ps=1 --evaluator -- \\
        --strategy=parameter_server --config=configs/ctr.py
    python -m trainer.launch --workers=2 --restarts=3 -- --strategy=multi_worker \\
        --model_dir=runs/mw
    python -m trainer.launch --workers=2:4 -- --strategy=multi_worker --model_dir=runs/el

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

`--workers=MIN:MAX` runs an elastic `multi_worker` job (docs/elastic.md): its
members (`member:0` ...) train as one group; when one is lost the others save
the step they completed and exit 145, and the launcher starts the next group
from the members that are left (at least MIN); a lost member comes back after
a cool-down, and the running group saves at a block boundary to take it in.

Beyond one machine, run `python -m trainer` on every host with the `TF_CONFIG`
that the scheduler gives each task; for an elastic job, the agent
`python -m trainer.elastic` on every host (`trainer/elastic.py`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from absl import app, flags

import configs.default
from strategies.cluster import tf_config as cluster
from strategies.cluster.roster import REFORM_VARIABLE, Roster
from towerflow import netns
from towerflow.errors import (
    MEMBER_LOST_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    REFORM_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    UserError,
    one_line,
)
from towerflow.processes import (
    LOOPBACK,
    Console,
    Interrupt,
    pick_ports,
    reap,
    signal_group,
    start_process,
    terminate,
)
from trainer import cli

GRACE_S = 15.0  # how long the other tasks may run on after the chief is done
KILL_AFTER_S = 5.0  # how long a task may take to exit after SIGTERM before SIGKILL
REPORT_S = 10.0  # how long the chief may take to report a failed task before the cluster stops
_POLL_S = 0.1
MAX_MEMBER_RESTARTS = 3  # a parameter-server worker that fails is started again this often
REFORM_WAIT_S = 60.0  # how long an elastic group's survivors may take to save and exit
SETTLE_S = 15.0  # still running this long after a survivor saved: hung (> watchdog probes)
_PROGRESS = "train | step: "  # the chief's progress line: the group trains

_WORKERS = flags.DEFINE_string(
    "workers",
    "1",
    "Number of worker members (at least 1), or MIN:MAX: an elastic `multi_worker` job that "
    "trains with MIN to MAX members and re-forms as they come and go (docs/elastic.md).",
)
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
    # The launcher's and the sweep's flag mean the same; a process may import both.
    allow_override=True,
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
    label: str = ""  # an elastic job's name for it, the same in every group ("member:2")

    @property
    def name(self) -> str:
        """How its output lines are prefixed: "chief", "worker:1", "ps:0", "evaluator"."""
        if self.label:
            return self.label
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
        env: dict[str, str] | None = None,
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
          env: more environment variables for every task.
        """
        self.tasks = list(tasks)
        self.command = list(command)
        self.console = console or Console()
        self.grace_s = grace_s
        self.kill_after_s = kill_after_s
        self.report_s = report_s
        self.interrupt = interrupt or Interrupt()
        self.env = dict(env or {})
        self.max_task_restarts = MAX_MEMBER_RESTARTS
        self._procs: dict[Member, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._member_restarts: dict[Member, int] = {}

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
        reap(list(self._procs.values()), self._pumps)
        self._procs.clear()
        self._pumps.clear()
        atexit.unregister(self.stop)

    def _servers(self) -> set[Member]:
        """The tasks that only serve the chief: the ps and workers of a parameter-server cluster."""
        if not any(task.type == "ps" for task in self.tasks):
            return set()
        return {task for task in self.tasks if task.type in ("ps", "worker")}

    def _start(self, task: Member) -> None:
        env = {**os.environ, **self.env, "TF_CONFIG": task.tf_config}
        proc, pump = start_process(self.command, env, self._writer(task))
        self._procs[task] = proc
        self._pumps.append(pump)

    def _writer(self, task: Member) -> Callable[[str], None]:
        """Where `task`'s output lines go: the console, prefixed with its name."""
        return functools.partial(self.console.write, task.name)

    def _restartable(self, task: Member) -> bool:
        """A parameter-server cluster tolerates a lost worker: start it again, a few times."""
        has_ps = any(t.type == "ps" for t in self.tasks)
        if task.type != "worker" or not has_ps:
            return False
        self._member_restarts[task] = self._member_restarts.get(task, 0) + 1
        return self._member_restarts[task] <= self.max_task_restarts

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
                        f"{self._member_restarts[task]} of {self.max_task_restarts}); the "
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


class ElasticGroup(Cluster):
    """One group of an elastic `multi_worker` job: it trains until the job ends or it re-forms.

    A member that fails makes the others save the step they all completed and
    exit with `REFORM_EXIT_CODE` (`trainer.loop.elastic`); a member of the
    roster that becomes ready again (its cool-down over), once the group has
    trained a block, makes the group save at its next block boundary (SIGTERM
    to every member: they agree on the step, exit 143). Either way `run`
    returns `REFORM_EXIT_CODE`, with `lost` the members to cool down and `why`
    the change, for the launcher to form the next group.
    """

    def __init__(self, tasks, command, roster: Roster, console, grace_s, interrupt, env):
        super().__init__(tasks, command, console, grace_s, interrupt=interrupt, env=env)
        self.roster = roster
        self.lost: list[str] = []
        self.why = ""
        self.changed_at = 0.0  # time.time() when the change began
        self._trained = threading.Event()  # the chief reported a block

    def _writer(self, task: Member) -> Callable[[str], None]:
        write = super()._writer(task)

        def watched(line: str) -> None:
            if task is self.tasks[0] and _PROGRESS in line:
                self._trained.set()
            write(line)

        return watched

    def _wait(self) -> int:
        chief, growing = self.tasks[0], False
        while (code := self._procs[chief].poll()) != 0:
            if self._interrupted():
                return self.interrupt.code
            ended = {task: proc.returncode for task, proc in self._procs.items() if proc.poll()}
            if ended:
                return self._reformed(ended, growing)
            back = self._returning()
            if back and not growing and self._trained.is_set():
                growing, self.why, self.changed_at = True, f"{back[0]} returned", time.time()
                self.console.log(
                    f"{', '.join(back)} ready again: the group saves at its next block "
                    "boundary and re-forms larger"
                )
                for proc in self._procs.values():
                    signal_group(proc, signal.SIGTERM)
            time.sleep(_POLL_S)
        self.console.log(f"{chief.name} (the chief) {_ended(code)}")
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs.values()):
            time.sleep(_POLL_S)
        return 0

    def _running(self) -> int:
        return sum(proc.poll() is None for proc in self._procs.values())

    def _settled(self, since: float) -> bool:
        """Whether survivors saved and nobody else ended for `SETTLE_S`: the rest are hung."""
        saved = any(proc.poll() == REFORM_EXIT_CODE for proc in self._procs.values())
        return saved and time.monotonic() - since >= SETTLE_S

    def _returning(self) -> list[str]:
        """Ready members of the roster that are not in this group."""
        members = {task.name for task in self.tasks}
        return [name for name in self.roster.ready() if name not in members]

    def _reformed(self, ended: dict[Member, int], growing: bool) -> int:
        """A member ended: the others save and exit (bounded); who was lost, and why."""
        if not growing:
            self.changed_at = time.time()
        first, code = next(iter(ended.items()))
        self.console.log(
            f"{first.name} {_ended(code)}; waiting up to {REFORM_WAIT_S:g} s for the others "
            "to save the step they completed"
        )
        deadline = time.monotonic() + REFORM_WAIT_S
        settled = time.monotonic()  # when the last member ended
        while time.monotonic() < deadline and self._running() and not self._settled(settled):
            if self._interrupted():
                return self.interrupt.code
            running = self._running()
            time.sleep(_POLL_S)
            if self._running() < running:
                settled = time.monotonic()
        codes = {task: proc.poll() for task, proc in self._procs.items()}
        if USER_ERROR_EXIT_CODE in codes.values():
            return USER_ERROR_EXIT_CODE
        saved = (REFORM_EXIT_CODE, PREEMPTED_EXIT_CODE)
        self.lost = [task.name for task, code in codes.items() if code not in saved]
        if self.lost:
            self.why = f"{', '.join(self.lost)} lost"
        return REFORM_EXIT_CODE


def launch_elastic(
    command: Sequence[str],
    low: int,
    high: int,
    port_base: int = 0,
    grace_s: float = GRACE_S,
    console: Console | None = None,
    interrupt: Interrupt | None = None,
) -> int:
    """Runs an elastic `multi_worker` job of `low` to `high` members until it ends.

    Each group is a local cluster of the ready members (`strategies.cluster.roster`);
    when it re-forms, the next group starts from the step the last one saved.
    `cluster.elastic.rendezvous_timeout`, `max_restarts` and `cooldown_s` are
    read from the trainer flags in `command` (else configs/default.py's).

    Returns:
      0 when the job trained to its end; the members' 2 for a bad config;
      `MEMBER_LOST_EXIT_CODE` when fewer than `low` members were ready for
      `rendezvous_timeout`; 128 + the signal number after an interrupt.
    """
    console = console or Console()
    interrupt = interrupt or Interrupt()
    roster = Roster(low, high, **elastic_settings(command))
    command = elastic_command(command, low, high)
    change = None  # what made the last group re-form, for the next group's record
    while True:
        names = roster.form(stop=lambda: interrupt.signal is not None)
        if names is None:
            if interrupt.signal is not None:
                return interrupt.code
            console.log(
                f"stopping: fewer than `min_workers` ({low}) members ready for "
                f"{roster.rendezvous_timeout:g} s; missing: {', '.join(roster.missing())}; "
                "the state is saved in model_dir: start the job again to resume"
            )
            return MEMBER_LOST_EXIT_CODE
        tasks = [
            dataclasses.replace(task, label=name)
            for task, name in zip(plan_cluster(len(names), port_base=port_base), names, strict=True)
        ]
        console.log(
            f"group of {len(tasks)}: "
            + ", ".join(f"{task.name} as worker:{task.index}" for task in tasks)
        )
        env = {REFORM_VARIABLE: json.dumps({**change, "to": len(tasks)})} if change else {}
        group = ElasticGroup(tasks, command, roster, console, grace_s, interrupt, env)
        code = group.run()
        if code != REFORM_EXIT_CODE:
            return code
        for name in group.lost:
            console.log(f"{name} lost: {roster.lost(name)}")
        change = {"from": len(tasks), "why": group.why, "at": group.changed_at}


def elastic_command(command: Sequence[str], low: int, high: int) -> list[str]:
    """`command` with the elastic job's size (`cluster.elastic.min_workers`, `max_workers`)."""
    return [
        *command,
        f"--config.cluster.elastic.min_workers={low}",
        f"--config.cluster.elastic.max_workers={high}",
    ]


def elastic_settings(command: Sequence[str]) -> dict:
    """`cluster.elastic`'s launcher settings: from `--config.cluster.elastic.X=V`, else defaults."""
    defaults = configs.default.get_config().cluster.elastic
    settings = {
        "max_restarts": defaults.max_restarts,
        "cooldown_s": defaults.cooldown_s,
        "rendezvous_timeout": defaults.rendezvous_timeout,
    }
    for arg in command:
        name, _, value = arg.removeprefix("--config.cluster.elastic.").partition("=")
        if arg.startswith("--config.cluster.elastic.") and name in settings:
            try:
                settings[name] = type(settings[name])(value)
            except ValueError:
                raise UserError(
                    f"`cluster.elastic.{name}` ({value!r}) must be a number; e.g. "
                    f"`--config.cluster.elastic.{name}={settings[name]}`."
                ) from None
    return settings


def parse_workers(text: str) -> tuple[int, int, bool]:
    """`--workers`: "N", or "MIN:MAX" for an elastic job; (low, high, elastic).

    Raises:
      UserError: not a count or a range of counts, or MIN > MAX.
    """
    low, colon, high = text.partition(":")
    try:
        counts = (int(low), int(high) if colon else int(low))
    except ValueError:
        raise UserError(
            f"`--workers` ({text!r}) must be a count (`--workers=3`) or MIN:MAX for an elastic "
            "job (`--workers=2:4`)."
        ) from None
    if colon and not 1 <= counts[0] <= counts[1]:
        raise UserError(
            f"`--workers` ({text}) must be MIN:MAX with 1 <= MIN <= MAX (an elastic job trains "
            f"with at least MIN members, at most MAX); pass e.g. `--workers={counts[1]}:"
            f"{max(counts)}`."
        )
    return counts[0], counts[1], bool(colon)


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
        from trainer.data import service_client

    servers = stack.enter_context(service_client.serving_locally(workers, console))
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
        args = argv[1:]
        command = [sys.executable, "-m", _MODULE.value, *args]
        low, high, elastic = parse_workers(_WORKERS.value)
        if elastic and (_PS.value or _CHIEF.value or _EVALUATOR.value or _DATA_WORKERS.value):
            raise UserError(
                f"`--workers={_WORKERS.value}` (elastic) runs `multi_worker` members only; "
                "drop `--ps`, `--chief`, `--evaluator` and `--data_workers`, or pass a count."
            )
        netns.loopback_only(
            "the local cluster", "--allow_network", args, _ALLOW_NETWORK.value, console.log
        )
        with Interrupt().catching() as interrupt:
            if elastic:
                code = launch_elastic(
                    command, low, high, _PORT_BASE.value, _GRACE_S.value, console, interrupt
                )
            else:
                code = launch(
                    command,
                    workers=low,
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
