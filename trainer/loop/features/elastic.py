"""`cluster.elastic`: a `multi_worker` group that re-forms at another size (docs/elastic.md).

The mechanics are `trainer.loop.elastic`'s; this component checks the
section, gives the group its batches, counts the steps every variable holds,
reports the membership each block, and turns a lost member into a re-form.
Whatever the config, a run resumes from a survivor's save that is newer than
the newest checkpoint (a rerun of an elastic job's `model_dir`).
"""

from __future__ import annotations

from towerflow.errors import UserError
from trainer.loop import actions, component, elastic, options

STRATEGIES = ("multi_worker",)  # whose group re-forms at another size


@component.register("elastic")
class Elastic(component.Component):
    """A lost worker is a membership change: the survivors save and the group re-forms."""

    section = options.BUILTIN["elastic"]  # `cluster.elastic`, its counts and values checked

    def check(self, config, traits) -> None:
        section = self.read(config)
        if section.max_workers and config.strategy.name not in STRATEGIES:
            raise UserError(
                f"elastic training (`cluster.elastic.max_workers` {section.max_workers}) needs "
                f"`--strategy=multi_worker`, and `{config.strategy.name}` cannot re-form its "
                "group at another size (docs/elastic.md); use `multi_worker`, or set "
                "`--config.cluster.elastic.max_workers=0`."
            )
        if section.max_workers and section.batch == "per_replica" and config.train.epochs:
            raise UserError(
                f"`train.epochs` ({config.train.epochs}) would give each group size of "
                "`cluster.elastic.batch=per_replica` another number of steps (its global batch "
                "follows the group); set `--config.train.steps` and `--config.train.epochs=0`."
            )

    def adapt(self, config, strategy, say):
        if not elastic.enabled(config):
            return config
        cluster = strategy.membership.cluster
        workers = cluster.num_workers if cluster else 1
        batches = elastic.group_batches(config, strategy.num_replicas_in_sync, workers, say)
        return elastic.for_group(config, batches)

    def build(self, context: component.Context) -> component.Feature:
        config = context.config
        if config.get("cluster"):  # a resumed run's input position is read as it was written
            elastic.check_batch_kept(config, context.model_dir)
        if elastic.enabled(config):
            return _Group(context)
        return _Survivors(context)


class _Survivors(component.Feature):
    """Any run: a survivor's save newer than the newest checkpoint is the state to resume."""

    def __init__(self, context: component.Context):
        self._context = context

    def newer_state(self, latest: str | None) -> str | None:
        return elastic.newer_save(self._context.model_dir, latest)


class _Group(_Survivors):
    """An elastic group: its step counted, its input position kept, its membership reported."""

    slot = component.Slot.METRICS
    # A silent peer ends the step (the survivors then save), not the process.
    handles_lost_members = True

    def __init__(self, context: component.Context):
        super().__init__(context)
        # `batch=per_replica`: the input position in per-replica batches, checkpointed.
        self._position = elastic.InputPosition() if elastic.per_replica(context.config) else None
        self._counted: elastic.CountedStep | None = None

    def checkpoint(self) -> dict:
        # The stream's batches before the group's first step.
        return {"elastic_input": self._position} if self._position else {}

    def starts_at(self, step: int) -> int | None:
        if self._position is None:
            return None
        # After a restore, that state may be an earlier group's: this group's origin.
        return self._position.start(step, self._context.strategy.num_replicas_in_sync)

    def wrap_step(self, step, first_step: int):
        # A survivor saves the step its variables hold.
        local = len(self._context.strategy.tf_strategy.extended.worker_devices)  # here
        self._counted = elastic.CountedStep(step, first_step, local)
        return self._counted

    def actions(self, run: component.Run) -> list[actions.Action]:
        context = self._context
        member, config = context.strategy.membership, context.config
        membership = elastic.membership(
            member.cluster.num_workers if member.cluster else 1,
            context.strategy.num_replicas_in_sync,
            config.train.global_batch_size,
            config.optimizer.learning_rate,
            context.model_dir,
            member.is_chief,
            run.checkpointer.save,
            context.say,
        )
        return [membership]

    def lost_member(self, run: component.Run, lost: list[str], error: Exception) -> BaseException:
        """Every survivor saves the step it completed; the error that ends it (exit 145)."""
        context = self._context
        why = f"{', '.join(lost)} stopped answering ({type(error).__name__})"
        step = self._counted.completed if self._counted else context.step()
        name = context.strategy.membership.cluster.member_name
        checkpoint = run.checkpointer.checkpoint
        return elastic.reform(
            why, checkpoint, context.model_dir, step, name, context.optimizer.iterations
        )

    def results(self) -> dict:
        config, model_dir = self._context.config, self._context.model_dir
        return {
            "elastic": {
                "batch": "per_replica" if elastic.per_replica(config) else "global",
                "global_batch": config.train.global_batch_size,  # this, the last group's
                "learning_rate": config.optimizer.learning_rate,  # its peak rate
                "reforms": elastic.reforms(model_dir),
            }
        }
