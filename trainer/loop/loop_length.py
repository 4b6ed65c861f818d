"""How many steps each loop runs: `train.steps_per_loop`, or with 0 ("auto") a measured length.

A loop is one `tf.function` call and one progress line. Its fixed cost (the
call, reading back the sums, the summaries and the progress line) is a few
milliseconds on a CPU (`python -m trainer.bench`), so a loop of `AUTO_LOOP_S`
keeps it well under 2% of the time. Auto starts with one step, then sizes
each loop from the time per step of the loop before: as many steps as fill
`AUTO_LOOP_S`, rounded down to 1, 2 or 5 times a power of ten, growing at
most `AUTO_GROWTH` times per loop. The first loop of each run (`start`)
also starts an input pipeline and traces the step: its time says nothing of
a step's, so it sizes nothing, and a later run of the same job starts at the
length the one before reached instead of at one step again.
"""

from __future__ import annotations

import math

AUTO_LOOP_S = 1.0  # target seconds per loop under auto
AUTO_GROWTH = 10  # a loop is at most this many times longer than the one before
AUTO_MAX_STEPS = 10_000  # longest loop under auto


class LoopLength:
    """The length of the next loop; `observe` each loop's time to let auto adapt."""

    def __init__(self, steps_per_loop: int):
        self.auto = steps_per_loop == 0
        self._steps = 1 if self.auto else steps_per_loop
        self._warming_up = False

    def start(self) -> None:
        """A run starts: its first loop, slowed by the run's start, is not observed."""
        self._warming_up = True

    def next(self) -> int:
        """Steps the next loop runs (before stopping at checkpoints and evals)."""
        return self._steps

    def observe(self, steps: int, seconds: float) -> None:
        """Records that a loop of `steps` steps took `seconds`."""
        warming_up, self._warming_up = self._warming_up, False
        if not self.auto or warming_up or steps < 1 or seconds <= 0:
            return
        fits = AUTO_LOOP_S * steps / seconds
        limit = min(AUTO_GROWTH * max(steps, self._steps), AUTO_MAX_STEPS)
        self._steps = _round_down_125(min(fits, limit))


def _round_down_125(x: float) -> int:
    """The largest of 1, 2, 5, 10, 20, 50, ... that is at most `x` (at least 1)."""
    if x < 1:
        return 1
    power = 10 ** math.floor(math.log10(x))
    return max(m * power for m in (1, 2, 5) if m * power <= x)
