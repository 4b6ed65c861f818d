"""The benchmark's clock: a loop action that notes when each block of the loop is done.

The towerflow contender passes a `Clock` to `train.run(..., extra_actions=)`;
a trainer in another process (the `startup` case, a local cluster) gets one
through `train.actions` (`--config.train.actions=trainer.bench.clock:to_file`)
and writes its marks to the file named by `$TOWERFLOW_BENCH_CLOCK`.

The clock runs after the loop's other actions, so from one mark to the next
is one whole loop: the block's steps and its actions (metrics, summaries,
progress line). The last block's actions also hold the end-of-run checkpoint,
so a timing ends at a block before the last (`rate(..., until=)`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import ml_collections

from strategies.cluster import tf_config as cluster
from trainer.loop.controller import Action, Output

FILE_VARIABLE = "TOWERFLOW_BENCH_CLOCK"  # where `to_file`'s clock appends its marks

Mark = tuple[int, float]  # (step reached, seconds once the block's actions were done)


class Clock:
    """A loop action: `marks` holds `(output.step, time)` once each block's actions are done.

    Args:
      now: the clock read (`time.perf_counter`; `time.time` to compare with
        another process).
      on_mark: also called with each mark as it is taken.
    """

    def __init__(
        self,
        now: Callable[[], float] = time.perf_counter,
        on_mark: Callable[[Mark], None] | None = None,
    ):
        self.marks: list[Mark] = []
        self._now = now
        self._on_mark = on_mark

    def __call__(self, output: Output) -> None:
        mark = (output.step, self._now())
        self.marks.append(mark)
        if self._on_mark:
            self._on_mark(mark)

    def action(self) -> Action:
        """This clock as an action after every block, for `extra_actions`."""
        return Action(self, name="bench clock")


def rate(marks: list[Mark], per_step: float, until: int | None = None) -> float:
    """`per_step` x steps per second from the first of `marks` to the last at or before `until`.

    Raises:
      RuntimeError: fewer than two marks to time between.
    """
    marks = [m for m in marks if until is None or m[0] <= until]
    if len(marks) < 2:
        raise RuntimeError(f"need two blocks to time loops, got {len(marks)}")
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (s1 - s0) * per_step / (t1 - t0)


def to_file(config: ml_collections.ConfigDict) -> Action:
    """For `train.actions`: the chief's marks, in wall-clock seconds, to `$TOWERFLOW_BENCH_CLOCK`.

    Only the chief writes (under `multi_worker` every worker runs the loop);
    each mark is one line, "step seconds", written whole as it is taken.
    """
    del config  # the file comes from the environment, which a launcher passes to every member
    path = os.environ[FILE_VARIABLE]
    spec = cluster.from_env()
    if spec is not None and not spec.is_chief:
        return Action(lambda output: None, name="bench clock (not the chief)")

    def append(mark: Mark) -> None:
        # One write of one whole line: a reader polling the file never sees half a mark.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{mark[0]} {mark[1]!r}\n".encode())
        finally:
            os.close(fd)

    return Clock(time.time, append).action()


def read(path: str) -> list[Mark]:
    """The whole marks `to_file` wrote to `path` so far (none if it has none yet)."""
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        lines = f.read().split("\n")[:-1]  # the last is empty, or a line still being written
        return [(int(step), float(seconds)) for step, seconds in (li.split() for li in lines)]
    return []
