"""The loop's actions in the order they run after a block, the features' in their slots.

First the features that move with every block trained (`Slot.FIRST`), then
blow-up recovery (it may roll the step back and skip the rest), the rates,
the features' metrics (`Slot.METRICS`), the summaries and progress line, the
checkpoint, what sees the state just saved (`Slot.SAVED`), preemption, the
watchdog, the rest of the features' (`Slot.LAST`), evaluation, and the
user's actions last, so they see the eval metrics of their block.
"""

from __future__ import annotations

from trainer.loop import actions, checks, controller, evaluation, faults
from trainer.loop.checkpoints import Checkpointer
from trainer.loop.component import Run, Slot
from trainer.loop.job import BuiltJob
from trainer.loop.progress import progress_line, say, tell
from trainer.loop.readings import Readings


def actions_of(
    job: BuiltJob, loop: Run, readings: Readings, evaluate: bool
) -> list[actions.Action]:
    """The loop's actions, in the order they run after a block, the features' in their slots.

    `readings` holds the learning rate as read with the step after the block.
    """
    config, member = job.config, job.strategy.membership
    slots: dict[Slot, list[actions.Action]] = {slot: [] for slot in Slot}
    for feature in job.features.values():
        slots[feature.slot] += feature.actions(loop)
    recoveries = []

    def recover(step: int, loss: float) -> None:
        recoveries.append(step)
        _recover(job, loop.checkpointer, step, loss, len(recoveries))

    def log(output: controller.Output) -> None:
        loop.summaries.scalars("train", output.step, output.metrics)
        total = output.total_steps if output.total_steps < checks.UNTIL_STOPPED else None
        tell(job.strategy, progress_line("train", output.step, output.metrics, total))

    handled = any(feature.handles_lost_members for feature in job.features.values())
    # A silent peer ends the step where a feature handles a lost member, else the process.
    give_up = faults.abort_step if handled else faults.exit_member_lost
    save = loop.checkpointer.save

    def blew_up(loss: float) -> bool:
        return faults.loss_blew_up(loss, config.train.loss_upper_bound)

    def evaluate_now() -> dict:
        return evaluation.evaluate(job, loop.summaries)

    return [
        *slots[Slot.FIRST],
        actions.recovery(blew_up, recover),
        actions.rates(config.train.global_batch_size, lambda: readings.learning_rate),
        *slots[Slot.METRICS],
        actions.every_block(log, "progress"),
        actions.checkpoint(save, config.train.checkpoint_every),
        *slots[Slot.SAVED],
        actions.preemption(loop.watch, save, say),
        # A single process has no other member to lose; the watchdog then never reports.
        actions.watchdog(faults.Watchdog(member.lost_members, say, give_up=give_up)),
        *slots[Slot.LAST],
        *([actions.evaluation(evaluate_now, config.eval.every)] if evaluate else []),
        *job.user_actions,
    ]


def _recover(
    job: BuiltJob, checkpointer: Checkpointer, step: int, loss: float, attempt: int
) -> int:
    """Restores the last good checkpoint after a loss blow-up; returns its step."""
    limit = job.config.train.max_recoveries
    good = checkpointer.latest
    if attempt > limit:
        raise faults.Diverged(
            f"loss {loss:.4g} at step {step} is non-finite or above `train.loss_upper_bound` "
            f"after {limit} recoveries; the last good checkpoint is {good}. Lower "
            "`optimizer.learning_rate` or set `optimizer.clip_global_norm`, then rerun."
        )
    checkpointer.restore(good)
    job.starts_at(job.step())  # `good` may be an earlier group's: the features' origin
    say(
        f"loss {loss:.4g} blew up by step {step}: restored {good} (step {job.step()}), "
        f"recovery {attempt} of {limit}; going on with fresh data"
    )
    return job.step()
