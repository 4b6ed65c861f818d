"""`parameter_server` on a `UnitStream`: one closure a unit, on whichever worker is free.

    python -m trainer.launch --workers=2 --ps=1 -- --strategy=parameter_server \\
        --config.data.follow=true --config.data.train_files='clicks/*.tfrecord'

A block of `n` steps is the units `stream.take(n, workers)` hands out; each
is scheduled as one closure that reads its records on the worker that runs it
(`stream.dataset`, traced once on the chief) and trains them step by step,
each step applying its own update as the asynchronous mode always does. The
coordinator gives each closure to the next free worker, and runs a closure
whose worker was lost before it returned again on another worker: its unit
trains whole on that worker, so no record is lost. The steps the lost worker
had applied train twice: a counter on a ps member adds the records of every
step applied (`records_trained`), and the block's `records_repeated` is what
it counted beyond the records of the units that finished (at most one unit
per worker lost).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from strategies.units import REPEATED, Unit, UnitStream


class UnitRunner:
    """Runs blocks of steps as units of a `UnitStream`, one closure a unit.

    Args:
      strategy: the chief's `tf.distribute.ParameterServerStrategy`.
      coordinator: its `ClusterCoordinator`.
      workers: the worker members (a block's units are cut in as many parts).
    """

    def __init__(self, strategy, coordinator, workers: int):
        self.strategy, self.coordinator, self.workers = strategy, coordinator, workers
        self._trained = None  # records trained, repeats included: an int64 on a ps member
        self._loops: dict = {}  # (step, stream) -> its traced unit loop

    def run(self, one_step: Callable, key, stream: UnitStream, n: int) -> dict:
        """Trains `n` steps from `stream`'s next units; the sums, and `records_repeated`.

        `one_step(batch)` is a step as the plugin's update mode runs it (it
        returns the step's sums); `key` names it for the cache of traced loops.
        """
        if self._trained is None:
            with self.strategy.scope():
                self._trained = tf.Variable(0, dtype=tf.int64, trainable=False, name="trained")
        if (key, id(stream)) not in self._loops:
            self._loops[key, id(stream)] = _unit_loop(one_step, stream, self._trained)
        loop = self._loops[key, id(stream)]
        units = stream.take(n, self.workers)
        before = int(self._trained.numpy())
        try:
            results = [self.coordinator.schedule(loop, args=_arguments(unit)) for unit in units]
            self.coordinator.join()
        except BaseException:
            stream.returned(units)
            raise
        stream.finished(units)
        sums = tf.nest.map_structure(lambda *parts: tf.add_n(parts), *[r.fetch() for r in results])
        repeated = int(self._trained.numpy()) - before - sum(unit.records for unit in units)
        return {**sums, REPEATED: tf.constant(float(repeated))}


def _arguments(unit: Unit) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    return (
        tf.constant(unit.file),
        tf.constant(unit.first, tf.int64),
        tf.constant(unit.records, tf.int64),
    )


def _unit_loop(one_step: Callable, stream: UnitStream, trained: tf.Variable):
    """A closure's work: the batches of one unit, a step each; returns their sums."""

    def counted_step(batch) -> dict:
        sums = one_step(batch)
        rows = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
        with tf.control_dependencies(tf.nest.flatten(sums)):
            counted = trained.assign_add(rows)
        with tf.control_dependencies([counted]):
            return tf.nest.map_structure(tf.identity, sums)

    @tf.function
    def loop(file, first, records):
        batches = iter(stream.dataset(file, first, records))
        totals = counted_step(next(batches))  # a unit holds one batch at least
        for batch in batches:
            totals = tf.nest.map_structure(tf.add, totals, counted_step(batch))
        return totals

    return loop
