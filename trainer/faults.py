"""What the loop does when a job is preempted or its loss blows up.

- Preemption: SIGTERM (what Kubernetes and Slurm send before they stop a
  task) sets a flag; the loop saves a checkpoint at the step it has reached
  and the process exits with `PREEMPTED_EXIT_CODE` (143 = 128 + SIGTERM), a
  code schedulers treat as "restart me" (e.g. a TFJob's `ExitCode` restart
  policy retries 128-255). The restarted job resumes from that checkpoint and
  loses no steps.
- Loss blow-ups: a non-finite loss, or one above `train.loss_upper_bound`,
  makes the loop restore the last good checkpoint and go on with fresh data,
  up to `train.max_recoveries` times; then it stops with `Diverged`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator

PREEMPTED_EXIT_CODE = 143
DIVERGED_EXIT_CODE = 3


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint holds the step reached. Exit with 143."""


class Diverged(Exception):
    """The loss stayed non-finite or too large after every allowed recovery."""


class SigtermWatch:
    """A flag that SIGTERM sets; the loop reads it between loops."""

    def __init__(self):
        self.requested = False

    def _handler(self, signum, frame) -> None:
        self.requested = True


@contextlib.contextmanager
def watch_sigterm() -> Iterator[SigtermWatch]:
    """Catches SIGTERM for the duration (main thread only; elsewhere a no-op flag)."""
    watch = SigtermWatch()
    if threading.current_thread() is not threading.main_thread():
        yield watch
        return
    previous = signal.signal(signal.SIGTERM, watch._handler)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGTERM, previous)


def loss_blew_up(loss: float, upper_bound: float) -> bool:
    """Whether `loss` is non-finite or above `upper_bound` (0 = no bound)."""
    return not math.isfinite(loss) or (upper_bound > 0 and loss > upper_bound)
