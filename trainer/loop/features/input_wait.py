"""How long steps waited for their input: `input_wait_ms` in each block's metrics.

The clock is the data's (`trainer.data.wait`). Not under a strategy whose
workers take batches as they come (their pipelines run elsewhere), nor with
`train.deterministic` (TensorFlow refuses a clock under op determinism).
"""

from __future__ import annotations

from trainer.data import wait
from trainer.loop import actions, component
from trainer.loop.controller import Output


@component.register("input_wait")
class InputWaitComponent(component.Component):
    """Each block's wait for input, in milliseconds per step; the clock is `wait.InputWait`."""

    fields = ("train.deterministic",)

    def build(self, context: component.Context) -> component.Feature | None:
        timed = context.strategy.traits.ordered_input and not context.config.train.deterministic
        return _Timed() if timed else None


class _Timed(component.Feature):
    slot = component.Slot.METRICS

    def __init__(self):
        self.clock = wait.InputWait()

    def wrap_input(self, iterator):
        return self.clock.timed(iterator)  # each batch's wait, as the loop of steps reads it

    def reads(self) -> dict:
        return {"input_wait": self.clock.variable}

    def actions(self, run: component.Run) -> list[actions.Action]:
        def input_wait(output: Output) -> None:
            # How long each step waited for its batches, on average over the block.
            waited = self.clock.take(run.read("input_wait"))
            output.metrics["input_wait_ms"] = 1000 * waited / output.steps

        return [actions.every_block(input_wait, "input wait")]
