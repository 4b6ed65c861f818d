"""Running a planned local cluster: its members as processes until the chief ends or one fails.

`Cluster` runs one attempt of a `trainer.launch.plan.LaunchPlan`'s members,
`ElasticGroup` one group of an elastic job, `run_attempts` a plan with its
restarts. Each member runs in its own process group (`towerflow.processes`).
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from strategies.cluster.roster import Roster
from towerflow import forkserver
from towerflow.errors import (
    PREEMPTED_EXIT_CODE,
    REFORM_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
)
from towerflow.processes import (
    Console,
    Interrupt,
    reap,
    signal_group,
    terminate,
)
from trainer.cli import MEMBER_MODULES
from trainer.launch.plan import LaunchPlan, Member

GRACE_S = 15.0  # how long the other members may run on after the chief is done
KILL_AFTER_S = 5.0  # how long a member may take to exit after SIGTERM before SIGKILL
REPORT_S = 10.0  # how long the chief may take to report a failed member before the cluster stops
_POLL_S = 0.1
MAX_MEMBER_RESTARTS = 3  # a parameter-server worker that fails is started again this often
REFORM_WAIT_S = 60.0  # how long an elastic group's survivors may take to save and exit
SETTLE_S = 15.0  # still running this long after a survivor saved: hung (> watchdog probes)
_PROGRESS = "train | step: "  # the chief's progress line: the group trains
# How members start: forked from one process that imported TensorFlow and what a trainer
# imports, when the launcher turns it on (`towerflow.forkserver`); else each as a process
# of its own.
MEMBERS = forkserver.Client(preload=MEMBER_MODULES)


class Cluster:
    """Runs one set of members as local processes until the chief ends or a member fails.

    Each member runs in its own process group, so stopping it stops its children too.
    """

    def __init__(
        self,
        members: Sequence[Member],
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
          members: from `plan_cluster`.
          command: what every member runs, e.g. `[sys.executable, "-m", "trainer", ...]`.
          console: where the members' prefixed output goes (default: stdout).
          grace_s: how long the other members may run on after the chief ends.
          kill_after_s: how long a member may take to exit after SIGTERM before SIGKILL.
          report_s: how long the chief may take to report a failed member before the stop.
          interrupt: a signal recorded here stops the cluster; `run` then returns its code.
          env: more environment variables for every member.
        """
        self.members = list(members)
        self.command = list(command)
        self.console = console or Console()
        self.grace_s = grace_s
        self.kill_after_s = kill_after_s
        self.report_s = report_s
        self.interrupt = interrupt or Interrupt()
        self.env = dict(env or {})
        self.max_member_restarts = MAX_MEMBER_RESTARTS
        self._procs: dict[Member, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._member_restarts: dict[Member, int] = {}

    def run(self) -> int:
        """Starts every member and waits; returns the chief's exit status, or the failed member's.

        Every process is stopped on the way out, whatever happens.
        """
        atexit.register(self.stop)
        try:
            for member in self.members:
                self._start(member)
            return self._wait()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stops every member and its children: SIGTERM, then SIGKILL after `kill_after_s`.

        The trainers go first (the chief; under `multi_worker` every worker, as
        they save at one agreed step), then the servers of a parameter-server
        cluster (its ps and worker members), once the trainers have exited or
        their time is up: the chief's final save reads the variables from the
        ps members and may still run steps on the workers. Stopped by a signal,
        the trainers get `grace_s` instead (if longer) to save. A second signal
        kills them all at once. If an exception cuts this short, the `atexit`
        hook, still registered, runs it again.
        """
        wait_s = self.kill_after_s
        running = [member.name for member, proc in self._procs.items() if proc.poll() is None]
        if running and self.interrupt.signal is not None:
            wait_s = max(wait_s, self.grace_s)
            self.console.log(
                f"stopping {', '.join(running)}: up to {wait_s:g} s to save and exit "
                "(signal again to kill them now)"
            )
        elif running:
            self.console.log(f"stopping {', '.join(running)}")
        servers = self._servers()
        trainers = [proc for member, proc in self._procs.items() if member not in servers]
        rest = [proc for member, proc in self._procs.items() if member in servers]
        killed = not terminate(trainers, wait_s, self.interrupt, self.console)
        if not killed and rest:
            terminate(rest, self.kill_after_s, self.interrupt, self.console)
        reap(list(self._procs.values()), self._pumps)
        self._procs.clear()
        self._pumps.clear()
        atexit.unregister(self.stop)

    def _servers(self) -> set[Member]:
        """The members that only serve the chief: a parameter-server cluster's ps and workers."""
        if not any(member.type == "ps" for member in self.members):
            return set()
        return {member for member in self.members if member.type in ("ps", "worker")}

    def _start(self, member: Member) -> None:
        env = {**os.environ, **self.env, "TF_CONFIG": member.tf_config}
        proc, pump = MEMBERS.start(self.command, env, self._writer(member))
        self._procs[member] = proc
        self._pumps.append(pump)

    def _writer(self, member: Member) -> Callable[[str], None]:
        """Where `member`'s output lines go: the console, prefixed with its name."""
        return functools.partial(self.console.write, member.name)

    def _restartable(self, member: Member) -> bool:
        """A parameter-server cluster tolerates a lost worker: start it again, a few times."""
        has_ps = any(m.type == "ps" for m in self.members)
        if member.type != "worker" or not has_ps:
            return False
        self._member_restarts[member] = self._member_restarts.get(member, 0) + 1
        return self._member_restarts[member] <= self.max_member_restarts

    def _wait(self) -> int:
        chief = next(member for member in self.members if member.is_chief)
        others = {member: proc for member, proc in self._procs.items() if member != chief}
        while (code := self._procs[chief].poll()) is None:
            if self._interrupted():
                return self.interrupt.code
            for member, proc in list(others.items()):
                if not proc.poll():  # running, or ended well
                    continue
                if self._restartable(member):
                    self.console.log(
                        f"{member.name} {_ended(proc.returncode)}; restarting it (attempt "
                        f"{self._member_restarts[member]} of {self.max_member_restarts}); the "
                        "coordinator re-schedules its work"
                    )
                    self._start(member)
                    others[member] = self._procs[member]
                    continue
                return self._after_failure(member, proc.returncode, chief)
            time.sleep(_POLL_S)
        label = chief.name if chief.type == "chief" else f"{chief.name} (the chief)"
        self.console.log(f"{label} {_ended(code)}")
        if code == 0 and any(proc.poll() is None for proc in others.values()):
            self.console.log(f"waiting up to {self.grace_s:g} s for the other members to end")
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

    def _after_failure(self, member: Member, code: int, chief: Member) -> int:
        """A member other than the chief failed: let the chief end on its own first, briefly.

        A preempted member (exit 143) is saving with the others at one agreed step:
        they get `grace_s` to finish. Otherwise the chief gets `report_s` to
        notice the loss and say which member it lost, before the cluster is stopped.
        """
        preempted = code == PREEMPTED_EXIT_CODE
        wait_s = self.grace_s if preempted else self.report_s
        action = "letting the others save" if preempted else "letting the chief report"
        self.console.log(f"{member.name} {_ended(code)}; {action} (up to {wait_s:g} s)")
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

    def __init__(self, members, command, roster: Roster, console, grace_s, interrupt, env):
        super().__init__(members, command, console, grace_s, interrupt=interrupt, env=env)
        self.roster = roster
        self.lost: list[str] = []
        self.why = ""
        self.changed_at = 0.0  # time.time() when the change began
        self._trained = threading.Event()  # the chief reported a block

    def _writer(self, member: Member) -> Callable[[str], None]:
        write = super()._writer(member)

        def watched(line: str) -> None:
            if member is self.members[0] and _PROGRESS in line:
                self._trained.set()
            write(line)

        return watched

    def _wait(self) -> int:
        chief, growing = self.members[0], False
        while (code := self._procs[chief].poll()) != 0:
            if self._interrupted():
                return self.interrupt.code
            ended = {member: proc.returncode for member, proc in self._procs.items() if proc.poll()}
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
        in_group = {member.name for member in self.members}
        return [name for name in self.roster.ready() if name not in in_group]

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
        codes = {member: proc.poll() for member, proc in self._procs.items()}
        if USER_ERROR_EXIT_CODE in codes.values():
            return USER_ERROR_EXIT_CODE
        saved = (REFORM_EXIT_CODE, PREEMPTED_EXIT_CODE)
        self.lost = [member.name for member, code in codes.items() if code not in saved]
        if self.lost:
            self.why = f"{', '.join(self.lost)} lost"
        return REFORM_EXIT_CODE


def _ended(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    """A child's return code as a shell reports it: 128 + N for death by signal N."""
    return 128 - code if code < 0 else code


def run_attempts(
    plan: LaunchPlan, console: Console, interrupt: Interrupt, grace_s: float, report_s: float
) -> int:
    """Runs `plan`'s cluster up to `plan.restarts` + 1 times, while it fails; the last status.

    A user error (exit status 2) or an interrupt is not retried.
    """
    attempts = plan.restarts + 1
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            console.log(f"restarting cluster (attempt {attempt} of {attempts})")
        attempt_cluster = Cluster(
            plan.members(),
            plan.command,
            console,
            grace_s,
            report_s=report_s,
            interrupt=interrupt,
        )
        code = attempt_cluster.run()
        if code in (0, USER_ERROR_EXIT_CODE) or interrupt.signal is not None:
            break
    return code
