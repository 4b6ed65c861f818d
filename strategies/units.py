"""Input handed out in units to whichever worker is free: what asynchronous plugins train on.

A synchronous plugin's workers step together, each keeping its share of every
global batch of one record stream, so the position in the input is one number
(the records trained). Asynchronous workers (`parameter_server`) take steps as
they come: a stream shared by position would train a record twice or never
across a restart. So the input of such a run is a `UnitStream`: it hands out
*units* (a file, or a run of whole batches of one file) and learns which of
them finished; the plugin schedules each unit on whichever worker is free, and
a unit whose worker was lost before it finished runs again on another worker.

A plugin that takes a `UnitStream` in `run_steps(step_fn, stream, n)` trains
exactly `n` steps from the units `stream.take(n, workers)` gives it: a unit of
`r` records is `ceil(r / batch)` steps (the file's last batch may be short; its
loss is still divided by the global batch, so it weighs what it holds), each
step `stream.decode` of the next batch of the unit's records (`stream.dataset(...)`).
"""

from __future__ import annotations

import abc
import dataclasses

import tensorflow as tf

# The sum a plugin adds to a block's for the records that trained twice (a unit whose
# worker was lost ran again on another): the block's metric of that name.
REPEATED = "records_repeated"


@dataclasses.dataclass(frozen=True)
class Unit:
    """A run of records of one file: `records` records from the file's record `first` on.

    Attributes:
      file: the file's path.
      first: the first record of the unit (records of the file before it).
      records: records in the unit.
    """

    file: str
    first: int
    records: int


def steps_of(records: int, batch: int) -> int:
    """Steps that train `records` records at `batch` a step (the last may be short)."""
    return -(-records // batch)


class UnitStream(abc.ABC):
    """The training input as units, for a plugin whose workers step asynchronously.

    Attributes:
      batch: records a step trains (the global batch).
    """

    batch: int

    @abc.abstractmethod
    def take(self, steps: int, parts: int) -> list[Unit]:
        """The next units, `steps` steps in all, each at most `ceil(steps / parts)` steps.

        The caller has waited until the input holds them. Units taken and not
        yet `finished` are not handed out again, unless `returned`.
        """

    @abc.abstractmethod
    def dataset(self, file: tf.Tensor, first: tf.Tensor, records: tf.Tensor) -> tf.data.Dataset:
        """The records of one unit, not decoded (traced once, run on a worker).

        A worker makes one such dataset a unit, and reads it whole at once, so
        it should cost little to start: each `Dataset.map` function and each
        tf.data optimization pass is set up anew with it, so the decoding is
        left to `decode`, which runs in the step's own function.
        """

    @abc.abstractmethod
    def decode(self, records) -> tuple:
        """A batch of `dataset`'s records -> `(features, labels[, weights])`, in the step."""

    @abc.abstractmethod
    def finished(self, units: list[Unit]) -> None:
        """`units` trained whole: the position moves past them."""

    @abc.abstractmethod
    def returned(self, units: list[Unit]) -> None:
        """`units` did not finish (the block failed): they are handed out again."""
