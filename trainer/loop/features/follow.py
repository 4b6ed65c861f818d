"""`data.follow`: training on files as they arrive, the position in them checkpointed.

The files and the position are the data's (`trainer.data.follow`); this
component checks the fields, puts the position in every checkpoint, runs
blocks once their files are there (`actions.follow`), and stops the
stream's wait for files however the run ends. Under a plugin whose workers
take work when free (`Traits.takes_units`: asynchronous `parameter_server`)
the files go to the steps in units (`trainer.data.follow_units`), and the
records a lost worker's unit trained twice are counted (`records_repeated`,
in the progress line, TensorBoard and results.json).
"""

from __future__ import annotations

from strategies.units import REPEATED
from towerflow.errors import UserError
from trainer.data import follow
from trainer.data.follow_units import FollowedUnits
from trainer.loop import actions, component, options, progress

BLOCK_STEPS = 100  # `data.follow` with `train.steps_per_loop=0`: steps of a block


@component.register("follow")
class Follow(component.Component):
    """Files of `data.train_files` trained on as they arrive, each once, in order."""

    section = options.BUILTIN["follow"]  # `data.follow*`

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
        if not (traits.ordered_input or traits.takes_units):
            raise UserError(_NO_UNITS.format(name=config.strategy.name))

    def build(self, context: component.Context) -> component.Feature | None:
        follower = follow.follower_of(context.dataset)
        if follower is None:
            return None
        traits = context.strategy.traits
        if traits.ordered_input:  # one stream, every worker its share of each global batch
            return _Following(context, follower)
        if not traits.takes_units:  # e.g. `parameter_server` with its options as set
            raise UserError(_NO_UNITS.format(name=context.strategy.name))
        batch = context.config.train.global_batch_size
        return _Following(context, follower, FollowedUnits(follower, context.dataset.decode, batch))


# A plugin whose workers take batches as they come, and no input in units either.
_NO_UNITS = (
    "`data.follow` trains each record once, and `strategy.name` '{name}' as set lets workers "
    "take batches as they come without taking input in units (e.g. `parameter_server` with "
    "`sync_replicas` or `warmup_steps`), so records would train twice or never across "
    "restarts; use `parameter_server` asynchronous (`sync_replicas=0`, `warmup_steps=0`), "
    "`multi_worker`, `mirrored` or `one_device`."
)


class _Following(component.Feature):
    # First: the position moves on with every block trained, rolled back or not.
    slot = component.Slot.FIRST

    def __init__(
        self,
        context: component.Context,
        follower: follow.Follower,
        units: FollowedUnits | None = None,
    ):
        self._context = context
        self._follower = follower
        self._units = units  # the files handed out in units, for workers that take work when free
        self._repeated = 0.0  # records a lost worker's unit trained twice, this run

    def input(self) -> FollowedUnits | None:
        return self._units

    def start(self, restored: str | None) -> None:
        if self._units is not None:  # the synchronous stream starts its follower itself
            self._follower.start()

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
        follow_actions = actions.follow(
            self._units or self._follower,
            batch,
            block,
            while_waiting,
            member.everyone,
            agree=member.agree,
            say=lambda line: progress.tell(context.strategy, line),  # the chief's
        )
        if self._units is None:
            return follow_actions
        return [*follow_actions, actions.every_block(self._count_repeated, "records repeated")]

    def _count_repeated(self, output) -> None:
        """The records trained twice so far (a unit whose worker was lost ran again)."""
        self._repeated += output.metrics.pop(REPEATED, 0.0)
        output.metrics[REPEATED] = self._repeated

    def results(self) -> dict:
        if self._units is None:
            return {}
        return {"follow": {REPEATED: int(self._repeated)}}

    def close(self) -> None:
        self._follower.close()  # the input stream stops waiting for files
