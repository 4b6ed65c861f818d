"""`train.profile_steps`: a TensorBoard profile of chosen steps (see `actions.Profile`)."""

from __future__ import annotations

import os

from towerflow.errors import UserError
from trainer.loop import actions, component


@component.register("profile")
class ProfileComponent(component.Component):
    """A TensorBoard profile of steps (start, stop) on the chief, into `model_dir/train`.

    The profiler itself is `actions.Profile`; this component checks the field and adds it.
    """

    fields = ("train.profile_steps",)

    def check(self, config, traits) -> None:
        steps = tuple(config.train.profile_steps)
        if steps and (
            len(steps) != 2
            or not all(isinstance(s, int) for s in steps)
            or not 0 <= steps[0] < steps[1]
        ):
            raise UserError(
                f"`train.profile_steps` ({steps}) must be (start, stop), the steps to profile, "
                "with 0 <= start < stop; e.g. `--config.train.profile_steps=(200,205)`, or () "
                "for none."
            )

    def build(self, context: component.Context) -> component.Feature | None:
        if not context.config.train.profile_steps:
            return None
        return _Profiled(context)


class _Profiled(component.Feature):
    # On every member: all end their blocks at the same steps; the chief alone profiles.
    slot = component.Slot.LAST

    def __init__(self, context: component.Context):
        self._context = context

    def actions(self, run: component.Run) -> list[actions.Action]:
        context = self._context
        logdir = os.path.join(context.model_dir, "train")  # TensorBoard's run "train"
        steps = tuple(context.config.train.profile_steps)
        is_chief = context.strategy.membership.is_chief
        return [actions.profile(steps, logdir, context.step, context.say, is_chief)]
