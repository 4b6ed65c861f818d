"""The outer loop: a controller that runs blocks of steps and calls actions after each.

In the spirit of Orbit's `Controller`. The inner loop (a block of steps inside
one `tf.function`) belongs to the strategy (`Strategy.run_steps`); this outer
loop only decides how long each block is and what happens between blocks.

An *action* is a plain callable on the block's `Output` (the step reached,
the block's metrics, its timing), wrapped in `Action` with a schedule:
after every block, every N steps, and/or at the end. Checkpoints,
evaluation, summaries, the progress line, blow-up recovery, preemption and
the watchdog are actions (`trainer.loop.actions`); so are a user's own, given as
`module.path:function` in `train.actions`::

    def early_stop(output):
        if output.metrics["loss"] < 0.01:
            raise controller.StopTraining("loss below 0.01")

A block ends where the next scheduled action is due, so an action that runs
every 500 steps sees steps 500, 1000, ...

An action may also declare hooks: `loop()`, a context manager entered around
the whole loop (a preemption watch, a watchdog thread), and `block(step)`, a
context manager around each block (the watchdog times blocks this way, the
profiler starts and stops there). An action with hooks only has no `fn`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from trainer.loop.loop_length import LoopLength


class StopTraining(Exception):  # noqa: N818 - a signal, not an error
    """Raised by an action to end training after this block; the end-of-run actions still run."""


class SkipBlock(Exception):  # noqa: N818 - a signal, not an error
    """Raised by an action to skip the rest of this block's actions (e.g. after a rollback)."""


@dataclasses.dataclass
class Output:
    """What one block of steps produced; every action gets it.

    Attributes:
      step: the step reached after the block.
      total_steps: the step training ends at.
      steps: how many steps the block ran.
      seconds: the block's wall time.
      metrics: the block's train metrics (loss, accuracy, ..., rates); actions may add to it.
      eval_metrics: the eval metrics, when an evaluation ran after this block.
      stopped: why training ends early, when an action raised `StopTraining`.
    """

    step: int
    total_steps: int
    steps: int
    seconds: float
    metrics: dict[str, float]
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    stopped: str = ""

    @property
    def is_last(self) -> bool:
        """Whether training ends after this block."""
        return self.step >= self.total_steps or bool(self.stopped)


@dataclasses.dataclass
class Action:
    """A callable on each block's `Output`, with its schedule and optional hooks.

    Attributes:
      fn: `fn(output)`; its return value is ignored. None: nothing to do after
        a block (an action of hooks only).
      every: run when the step is a multiple of `every` (0: never on a schedule);
        None: after every block.
      at_end: also run after the last block.
      name: for messages.
      at_steps: also run when the step is one of these (blocks end there too).
      loop: `loop()` makes a context manager entered around the whole loop.
      block: `block(step)` makes a context manager around the block starting at `step`.
    """

    fn: Callable[[Output], Any] | None
    every: int | None = None
    at_end: bool = False
    name: str = ""
    at_steps: tuple[int, ...] = ()
    loop: Callable[[], contextlib.AbstractContextManager] | None = None
    block: Callable[[int], contextlib.AbstractContextManager] | None = None

    def due(self, output: Output) -> bool:
        """Whether the action runs after the block that produced `output`."""
        if self.fn is None:
            return False
        if self.every is None or (output.is_last and self.at_end) or output.step in self.at_steps:
            return True
        return self.every > 0 and output.step % self.every == 0


def steps_until_next_event(step: int, total: int, actions: Sequence[Action], longest: int) -> int:
    """The next block's length: up to `longest`, ending where a scheduled action is due."""
    n = min(longest, total - step)
    for action in actions:
        if action.every:
            n = min(n, action.every - step % action.every)
        n = min([n] + [at - step for at in action.at_steps if at > step])
    return n


class Controller:
    """Runs blocks of steps until `total_steps`, calling the actions after each.

    Args:
      run_block: `run_block(n)` runs `n` steps and returns their metrics.
      current_step: the step the model is at (read after every block and action,
        since an action may roll it back).
      total_steps: where training ends.
      actions: called in order after each block, as their schedules say.
      loop_length: the blocks' length (`train.steps_per_loop`, or measured).
      agree: makes a measured length the same on every member of a cluster.
    """

    def __init__(
        self,
        run_block: Callable[[int], dict[str, float]],
        current_step: Callable[[], int],
        total_steps: int,
        actions: Sequence[Action],
        loop_length: LoopLength,
        agree: Callable[[int], int] = lambda n: n,
    ):
        self._run_block = run_block
        self._current_step = current_step
        self.total_steps = total_steps
        self.actions = list(actions)
        self._loops = loop_length
        self._agree = agree

    def train(self) -> Output | None:
        """Trains to `total_steps` or until an action stops it; returns the last output."""
        output = None
        self._loops.start()
        with contextlib.ExitStack() as stack:
            for action in self.actions:
                if action.loop is not None:
                    stack.enter_context(action.loop())
            step = self._current_step()
            while step < self.total_steps:
                output = self._block(step)
                self._run_actions(output)
                if output.stopped:
                    break
                step = self._current_step()
        return output

    def _block(self, step: int) -> Output:
        longest = self._loops.next()
        if self._loops.auto:
            longest = self._agree(longest)  # workers' clocks differ; their blocks must not
        n = steps_until_next_event(step, self.total_steps, self.actions, longest)
        with contextlib.ExitStack() as stack:
            for action in self.actions:
                if action.block is not None:
                    stack.enter_context(action.block(step))
            tic = time.perf_counter()
            metrics = self._run_block(n)
            seconds = time.perf_counter() - tic
        self._loops.observe(n, seconds)
        return Output(self._current_step(), self.total_steps, n, seconds, metrics)

    def _run_actions(self, output: Output) -> None:
        ran = set()
        for i, action in enumerate(self.actions):
            if not action.due(output):
                continue
            try:
                action.fn(output)
            except SkipBlock:
                return
            except StopTraining as e:
                output.stopped = str(e) or (action.name or "an action") + " stopped training"
            ran.add(i)
        if output.stopped:  # the end-of-run actions that were not due before the stop
            for i, action in enumerate(self.actions):
                if i not in ran and action.at_end and action.fn is not None:
                    action.fn(output)
