"""`data.follow`: training on files as they arrive, the position in them checkpointed.

The files and the position are the data's (`trainer.data.follow`); this
component checks the fields, puts the position in every checkpoint, runs
whole blocks once their files are there (`actions.follow`), and stops the
stream's wait for files however the run ends.
"""

from __future__ import annotations

from towerflow.errors import UserError
from trainer.data import follow
from trainer.loop import actions, component

BLOCK_STEPS = 100  # `data.follow` with `train.steps_per_loop=0`: steps of a block


@component.register("follow")
class Follow(component.Component):
    """Files of `data.train_files` trained on as they arrive, each once, in order."""

    fields = (
        "data.follow",
        "data.follow_poll_secs",
        "data.follow_max_wait_secs",
        "data.follow_horizon_files",
        "data.follow_marker",
    )

    def check(self, config, traits) -> None:
        if not config.data.get("follow", False):
            return
        if config.data.get("service", ""):
            raise UserError(
                f"`data.follow` reads its files in the trainer, and `data.service` is "
                f"'{config.data.service}'; set `--config.data.service=''`."
            )
        if config.train.epochs:
            raise UserError(
                f"`train.epochs` ({config.train.epochs}) counts passes over fixed data, and "
                "`data.follow` trains on files as they arrive; set `--config.train.epochs=0` and "
                "`train.steps` (0: until stopped)."
            )
        if not traits.ordered_input:
            raise UserError(
                f"`data.follow` trains on each record once, in order, and `strategy.name` "
                f"'{config.strategy.name}' lets workers take batches as they come, so records "
                "would train twice or never across restarts; use `multi_worker`, `mirrored` or "
                "`one_device`."
            )

    def build(self, context: component.Context) -> component.Feature | None:
        follower = follow.follower_of(context.dataset)
        return None if follower is None else _Following(context, follower)


class _Following(component.Feature):
    # First: the position moves on with every block trained, rolled back or not.
    slot = component.Slot.FIRST

    def __init__(self, context: component.Context, follower: follow.Follower):
        self._context = context
        self._follower = follower

    def checkpoint(self) -> dict:
        # The file being trained on and the records of it trained on.
        return {"input": self._follower.position}

    def actions(self, run: component.Run) -> list[actions.Action]:
        context = self._context
        config = context.config

        def while_waiting() -> None:  # SIGTERM while no file comes: save and stop as always
            actions.stop_if_preempted(run.watch, run.checkpointer.save, context.say, context.step())

        block = config.train.steps_per_loop or BLOCK_STEPS
        member = context.strategy.membership  # workers that step together start so, on one stream
        batch = config.train.global_batch_size
        return actions.follow(
            self._follower,
            batch,
            block,
            while_waiting,
            member.everyone,
            agree=member.agree,
            say=context.say,
        )

    def close(self) -> None:
        self._follower.close()  # the input stream stops waiting for files
