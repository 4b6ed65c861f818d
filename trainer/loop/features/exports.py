"""`export.every_steps` / `export.every_secs`: numbered SavedModel versions while training.

Each version goes to `model_dir/export/<step>/` (`trainer.loop.export.export_version`:
written under a hidden name, then renamed), the newest `export.keep` kept; the
run's own end-of-training export (`train.export`) is then a version too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainer.loop import actions, component, options
from trainer.loop.export import export_version


@component.register("exports")
class Exports(component.Component):
    """Exports while training, on every member (some strategies save collectively)."""

    section = options.BUILTIN["exports"]  # `export.*`: every_steps, every_secs, keep

    def build(self, context: component.Context) -> component.Feature | None:
        every = self.read(context.config)
        if not (every.every_steps or every.every_secs):
            return None
        return _Versions(context, every)


class _Versions(component.Feature):
    # After the checkpoint: an export is the model of the checkpoint at its step.
    slot = component.Slot.SAVED

    def __init__(self, context: component.Context, every: options.ExportOptions):
        self._context = context
        self._every = every

    def actions(self, run: component.Run) -> list[actions.Action]:
        every = self._every
        agree = self._context.strategy.membership.agree  # the chief's clock decides for all
        return actions.exports(
            lambda step: run.export(), every.every_steps, every.every_secs, agree
        )

    def write_export(self, path: str, write: Callable[[str], None]) -> bool:
        """`model_dir/export` holds versions: this one is `export/<step>/`."""
        context = self._context
        step, keep, tic = context.step(), self._every.keep, time.perf_counter()
        if export_version(path, step, keep, write):
            seconds = time.perf_counter() - tic
            context.say(f"exported SavedModel version {step} to {path}/{step} in {seconds:.1f} s")
        return True
