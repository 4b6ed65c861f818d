"""`train.warm_start`: a new run begins from another run's variables (`trainer.loop.warm_start`).

Every run records its variables beside `config.json` (`variables.json`, what
a later warm start or resume reads); a resumed run's tables must read their
fallback rows as they trained; a fresh run with `train.warm_start` loads
what the plan found, checked at build, before anything is written.
"""

from __future__ import annotations

from trainer.loop import component, options, warm_start


@component.register("warm_start")
class WarmStart(component.Component):
    """Loads another run's variables into a fresh run; a resume wins."""

    section = options.BUILTIN["warm_start"]  # `train.warm_start`, `train.warm_start_include`

    def build(self, context: component.Context) -> component.Feature:
        warm_start.check_resumed(context.model, context.model_dir)  # both before any write
        plan = warm_start.plan(context.config, context.model, list(context.model.variables))
        return _Start(context, plan)


class _Start(component.Feature):
    def __init__(self, context: component.Context, plan: warm_start.WarmStartPlan | None):
        self._context = context
        self.plan = plan  # None: no `train.warm_start`

    def start(self, restored: str | None) -> None:
        if self.plan is None:
            return
        if restored:
            self._context.say(
                "`train.warm_start` left aside: this run resumes from its own checkpoint"
            )
        else:
            self._context.say(warm_start.apply(self.plan))

    def record(self) -> None:
        context = self._context
        warm_start.record(context.model, list(context.model.variables), context.model_dir)
