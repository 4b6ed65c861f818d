"""`train.profile_steps`: a TensorBoard profile of chosen steps (see `actions.Profile`)."""

from __future__ import annotations

import os

from trainer.loop import actions, component, options


@component.register("profile")
class ProfileComponent(component.Component):
    """A TensorBoard profile of steps (start, stop) on the chief, into `model_dir/train`.

    The profiler itself is `actions.Profile`; this component adds it for the steps of
    `train.profile_steps` (declared, with its rule, in `trainer.loop.options`).
    """

    section = options.BUILTIN["profile"]

    def build(self, context: component.Context) -> component.Feature | None:
        steps = self.read(context.config).profile_steps
        return _Profiled(context, steps) if steps else None


class _Profiled(component.Feature):
    # On every member: all end their blocks at the same steps; the chief alone profiles.
    slot = component.Slot.LAST

    def __init__(self, context: component.Context, steps: tuple[int, int]):
        self._context = context
        self._steps = steps

    def actions(self, run: component.Run) -> list[actions.Action]:
        context = self._context
        logdir = os.path.join(context.model_dir, "train")  # TensorBoard's run "train"
        steps = self._steps
        is_chief = context.strategy.membership.is_chief
        return [actions.profile(steps, logdir, context.step, context.say, is_chief)]
