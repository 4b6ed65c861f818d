"""What the loop does when a job is preempted, a member is lost or its loss blows up.

- Preemption: the strategy's watch (`strategies.cluster.preemption`) saves a checkpoint
  at the step reached, on every member at the same step, and raises
  `Preempted`; the process exits with `PREEMPTED_EXIT_CODE` (143 = 128 +
  SIGTERM), a code schedulers treat as "restart me". The restarted job
  resumes from that checkpoint and loses no steps.
- A lost member: a step that fails because another member of the cluster stopped
  answering becomes `MemberLost`, one line naming that member, and exit status
  `MEMBER_LOST_EXIT_CODE` (144, also in the 128-255 range schedulers retry).
  While a loop runs long, a `Watchdog` says which members do not answer, so a
  hang is never silent, and ends the process the same way when one stays
  silent for `GIVE_UP_S` (a hung member accepts connections but never replies,
  and a collective waits on it with no deadline).
- Loss blow-ups: a non-finite loss, or one above `train.loss_upper_bound`,
  makes the loop restore the last good checkpoint and go on with fresh data,
  up to `train.max_recoveries` times; then it stops with `Diverged`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import tensorflow as tf

from strategies import tf_private
from strategies.cluster.preemption import Preempted
from towerflow.errors import MEMBER_LOST_EXIT_CODE, MemberLost, Reform

__all__ = ["Preempted", "Reform", "MemberLost"]
WATCHDOG_AFTER_S = 10.0  # a loop running this long makes the watchdog look at the other members
# A member not answering the watchdog's probes this long, while the loop waits on it, ends
# the process: nothing else would (a collective has no timeout by default).
GIVE_UP_S = 20.0
_TF_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


class Diverged(Exception):
    """The loss stayed non-finite or too large after every allowed recovery."""


def loss_blew_up(loss: float, upper_bound: float) -> bool:
    """Whether `loss` is non-finite or above `upper_bound` (0 = no bound)."""
    return not math.isfinite(loss) or (upper_bound > 0 and loss > upper_bound)


def lost_member_error(
    error: tf.errors.OpError, lost: list[str], checkpoint_dir: str
) -> MemberLost | None:
    """A `MemberLost` for a step that failed as other members stopped answering; else None.

    Args:
      error: what the failed step raised.
      lost: the members that do not answer now (`Membership.lost_members()`).
      checkpoint_dir: where the restarted job will resume from.
    """
    lost = lost_members(error, lost)
    if lost is None:
        return None
    resume = tf.train.latest_checkpoint(checkpoint_dir) or "the start (no checkpoint yet)"
    return MemberLost(_lost_message(lost, type(error).__name__, resume))


def lost_members(error: tf.errors.OpError, lost: list[str]) -> list[str] | None:
    """The members whose loss made a step fail with `error`; None if it failed otherwise.

    Args:
      error: what the failed step raised.
      lost: the members that do not answer now (`Membership.lost_members()`).
    """
    if lost:
        return lost
    # None refuses a connection: fall back to the members TensorFlow names.
    if not isinstance(error, tf.errors.UnavailableError | tf.errors.DeadlineExceededError):
        return None
    named = sorted({f"{job}:{index}" for job, index in _TF_TASK.findall(error.message)})
    return named or ["a member of the cluster"]


def _lost_message(lost: list[str], why: str, resume: str) -> str:
    return (
        f"{', '.join(lost)} stopped answering ({why}); restart the whole cluster (the "
        "scheduler's restart policy, or `python -m trainer.launch --restarts=N`) and it "
        f"resumes from {resume}."
    )


def exit_member_lost(lost: list[str], waited_s: float) -> None:
    """Ends this process as `MemberLost` does: one line on stderr, exit status 144.

    For the watchdog, whose main thread waits inside a step that may never
    return (TensorFlow holds it in a collective with no deadline): no
    interpreter teardown, which could wait on the lost member too.
    """
    why = f"no reply to the watchdog's probes for {waited_s:.0f} s"
    print(
        f"error: {_lost_message(lost, why, 'its newest checkpoint')}", file=sys.stderr, flush=True
    )
    sys.stdout.flush()
    os._exit(MEMBER_LOST_EXIT_CODE)


def abort_step(lost: list[str], waited_s: float) -> None:
    """Ends the step waiting on a silent member with an error, so the loop goes on to handle it.

    For elastic training (`trainer.loop.elastic`), where the survivors save the
    step they completed before they exit: TensorFlow's collectives abort, and the
    step raises `UnavailableError` in the main thread.
    """
    message = f"{', '.join(lost)}: no reply to the watchdog's probes for {waited_s:.0f} s"
    tf_private.abort_collective_ops(message)


class Watchdog:
    """Says which members do not answer while a loop runs longer than `after_s`.

    A context manager around training; `loop(step)` marks each loop. One
    thread probes the cluster (`probe()`, e.g. `Membership.lost_members`) every
    `after_s` seconds while a loop is overdue, and reports what it finds.
    When the probes have found members not answering for `give_up_s`, it calls
    `give_up(lost, seconds)`, by default `exit_member_lost`.
    """

    def __init__(
        self,
        probe: Callable[[], list[str]],
        report: Callable[[str], None],
        after_s: float = WATCHDOG_AFTER_S,
        give_up_s: float = GIVE_UP_S,
        give_up: Callable[[list[str], float], None] = exit_member_lost,
    ):
        self._probe = probe
        self._report = report
        self._after_s = after_s
        self._give_up_s = give_up_s
        self._give_up = give_up
        self._loop: tuple[int, float] | None = None  # (first step, start time) of the running loop
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="towerflow-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    @contextmanager
    def loop(self, step: int) -> Iterator[None]:
        """Marks one loop, which starts at `step`."""
        self._loop = (step, time.monotonic())
        try:
            yield
        finally:
            self._loop = None

    def _watch(self) -> None:
        silent_since = None  # when the probes began to find a member not answering
        while not self._done.wait(self._after_s):
            running = self._loop
            if running is None or time.monotonic() - running[1] < self._after_s:
                silent_since = None
                continue
            lost = self._probe()
            if not lost:
                silent_since = None
                continue
            now = time.monotonic()
            silent_since = silent_since or now
            self._report(
                f"watchdog: the loop from step {running[0]} has run {now - running[1]:.0f} s; "
                f"not answering: {', '.join(lost)}"
            )
            if now - silent_since >= self._give_up_s and not self._done.is_set():
                self._give_up(lost, now - silent_since)
                return
