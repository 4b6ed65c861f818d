"""`data.follow` for workers that take work when free: the follower's files as units.

Under a plugin whose workers step asynchronously (`parameter_server`,
`Traits.takes_units`) there is no one ordered stream to keep a place in.
`FollowedUnits` hands the follower's files out in units (a run of whole global
batches of one file; a file's last records may be a short batch, whose loss is
still divided by the global batch, so it weighs what it holds). The plugin
gives each unit to whichever worker is free, and tells which finished: the
follower marks their records done, and the position in the checkpoint is which
records are done, as under the synchronous plugins. A unit handed out and not
finished at a checkpoint is not in it: a restart hands it out again.

So no remainder waits for a whole batch: a file's records train as soon as it
is admitted, its tail as a short step (`data.follow_max_wait_secs` has nothing
to wait for).
"""

from __future__ import annotations

import time

import tensorflow as tf

from strategies.units import Unit, UnitStream, steps_of
from trainer.data.base import Decode
from trainer.data.follow import Follower

# A unit's dataset: nothing to rewrite or tune, so nothing to set up a unit.
_STARTS_AT_ONCE = tf.data.Options()
_STARTS_AT_ONCE.experimental_optimization.apply_default_optimizations = False
_STARTS_AT_ONCE.autotune.enabled = False


class FollowedUnits(UnitStream):
    """The follower's admitted files as units of whole global batches.

    Args:
      follower: the run's `Follower` (started).
      decode: a batch of the source's records -> `(features, labels[, weights])`.
      batch: the global batch (records a step trains).
    """

    def __init__(self, follower: Follower, decode: Decode, batch: int):
        self.follower, self._decode, self.batch = follower, decode, batch
        self._ids: dict[Unit, int] = {}  # a unit handed out -> the follower's id of it
        self._trained = 0  # records of the units finished since `advance` last asked

    # What the follow actions ask of the input (`trainer.loop.actions.follow`), as the
    # follower's synchronous stream answers it. One process takes the units (the
    # coordinator): nothing to agree on with other workers.

    def steps_ready(self, most: int, global_batch: int, *_) -> int:
        """Admits the files found; the steps their records not done nor out make, at most `most`."""
        self.follower.admit()
        return min(most, self.follower.unit_steps(global_batch))

    def wait(self, records: int, global_batch: int, still_waiting, *_) -> None:
        """Returns once the records not done nor out make `records // global_batch` steps."""
        while self.steps_ready(records // global_batch, global_batch) < records // global_batch:
            still_waiting()
            time.sleep(self.follower.poll_secs)
            self.follower.refresh()

    def advance(self, records: int) -> int:
        """The records of the units finished since the last call (`records`: the steps' batches).

        A unit's records are done when the plugin says it finished (`finished`);
        a file's short last step counts what it holds.
        """
        trained, self._trained = self._trained, 0
        return trained

    def look_if_due(self) -> None:
        self.follower.look_if_due()

    def figures(self) -> dict[str, float]:
        return self.follower.figures()

    def close(self) -> None:
        self.follower.close()

    @property
    def say(self):
        return self.follower.say

    @say.setter
    def say(self, say) -> None:
        self.follower.say = say

    def take(self, steps: int, parts: int) -> list[Unit]:
        """Units of `steps` steps in all, each at most `ceil(steps / parts)` steps, oldest first."""
        per_unit = steps_of(steps, max(1, parts))
        units = []
        while steps > 0:
            taken = self.follower.take_unit(min(per_unit, steps) * self.batch)
            if taken is None:
                break
            unit = Unit(taken.file, taken.first, taken.records)
            self._ids[unit] = taken.id
            units.append(unit)
            steps -= steps_of(unit.records, self.batch)
        return units

    def dataset(self, file: tf.Tensor, first: tf.Tensor, records: tf.Tensor) -> tf.data.Dataset:
        """The unit's records, not decoded (`decode` decodes a step's batch in the step).

        Made anew for every unit on its worker: no `map` function and no tf.data
        optimization or autotuning to set up each time.
        """
        return self.follower.read(file).skip(first).take(records).with_options(_STARTS_AT_ONCE)

    def decode(self, records) -> tuple:
        """A batch of the unit's records decoded: `(features, labels[, weights])`."""
        # A tuple's parts are the decoder's arguments, as `Dataset.map` would give them.
        return self._decode(*records) if isinstance(records, tuple) else self._decode(records)

    def finished(self, units: list[Unit]) -> None:
        """Their records are done: the follower writes the position the checkpoint saves."""
        for unit in units:
            self.follower.unit_done(self._ids.pop(unit))
            self._trained += unit.records

    def returned(self, units: list[Unit]) -> None:
        """Not trained: the follower hands their records out again."""
        for unit in units:
            self.follower.unit_returned(self._ids.pop(unit))
