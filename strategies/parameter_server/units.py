"""`parameter_server` on a `UnitStream`: one closure a unit, on whichever worker is free.

    python -m trainer.launch --workers=2 --ps=1 -- --strategy=parameter_server \\
        --config.data.follow=true --config.data.train_files='clicks/*.tfrecord'

A block of `n` steps is the units `stream.take(n, workers)` hands out; each
is scheduled as one closure that reads its records on the worker that runs it,
all at once (`stream.dataset`, traced once on the chief; no iterator or read-ahead
thread to start a unit), and trains them a batch a step,
each step applying its own update as the asynchronous mode always does. The
coordinator gives each closure to the next free worker, and runs a closure
whose worker was lost before it returned again on another worker: its unit
trains whole on that worker, so no record is lost. The steps the lost worker
had applied train twice. They are counted from two counters, as no update
and counter move together: the optimizer's step counter (exact: each update
counts itself) gives the steps applied beyond the units' own, and a counter
on a ps member of the records of each unit started, added before its first
step, gives the records of the units that ran again. A unit's steps are
whole batches but its last, so the steps a lost worker applied of its unit
hold `steps x batch` of its records, or all of them where it applied the
last (the smaller of the two counts holds). The block's `records_repeated` is
at most one unit per worker lost. (One count a unit, not a step: a step's
own round trip to the ps before it starts would cost every step. The chief
reads both counters in one round trip before a block and one after.)
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from strategies.units import REPEATED, Unit, UnitStream, steps_of


class UnitRunner:
    """Runs blocks of steps as units of a `UnitStream`, one closure a unit.

    Args:
      strategy: the chief's `tf.distribute.ParameterServerStrategy`.
      coordinator: its `ClusterCoordinator`.
      workers: the worker members (a block's units are cut in as many parts).
    """

    def __init__(self, strategy, coordinator, workers: int):
        self.strategy, self.coordinator, self.workers = strategy, coordinator, workers
        self._started = None  # records of the units started, repeats included: an int64 on a ps
        self._loops: dict = {}  # (step, stream) -> its traced unit loop
        self._reads: dict = {}  # step -> its traced read of the two counters

    def run(self, one_step: Callable, step, stream: UnitStream, n: int) -> dict:
        """Trains `n` steps from `stream`'s next units; the sums, and `records_repeated`.

        `one_step(batch)` is a step as the plugin's update mode runs `step` (it
        returns the step's sums, `stale_dropped` among them where updates may be
        dropped); `step.iterations` counts the updates applied.
        """
        if self._started is None:
            with self.strategy.scope():
                self._started = tf.Variable(0, dtype=tf.int64, trainable=False, name="started")
        if (step, id(stream)) not in self._loops:
            self._loops[step, id(stream)] = _unit_loop(one_step, stream, self._started)
        loop = self._loops[step, id(stream)]
        units = stream.take(n, self.workers)
        records, steps = self._counters(step)
        try:
            results = [self.coordinator.schedule(loop, args=_arguments(unit)) for unit in units]
            self.coordinator.join()
        except BaseException:
            stream.returned(units)
            raise
        stream.finished(units)
        sums = tf.nest.map_structure(lambda *parts: tf.add_n(parts), *[r.fetch() for r in results])
        records_now, steps_now = self._counters(step)
        applied = steps_now - steps + float(sums.get("stale_dropped", 0.0))
        extra_steps = applied - sum(steps_of(unit.records, stream.batch) for unit in units)
        extra_records = records_now - records - sum(u.records for u in units)
        repeated = max(0.0, min(extra_records, extra_steps * stream.batch))
        return {**sums, REPEATED: tf.constant(float(repeated))}

    def _counters(self, step) -> tuple[int, int]:
        """Records of the units started, and steps applied: the two counters on the ps.

        Both in one function, so one round trip to the ps (each `.numpy()` is one).
        """
        if step not in self._reads:
            counters = (self._started, step.iterations)
            self._reads[step] = tf.function(lambda: [tf.convert_to_tensor(c) for c in counters])
        records, steps = self._reads[step]()
        return int(records), int(steps)


def _arguments(unit: Unit) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    return (
        tf.constant(unit.file),
        tf.constant(unit.first, tf.int64),
        tf.constant(unit.records, tf.int64),
    )


def _unit_loop(one_step: Callable, stream: UnitStream, started: tf.Variable):
    """A closure's work: the records of one unit, read at once, a batch a step; their sums."""

    @tf.function
    def loop(file, first, records):
        # One read a unit, no iterator: nothing to start (thread, buffer) on the worker
        # each unit, and no round trip to the reader each step.
        unit = stream.dataset(file, first, records).batch(records).get_single_element()
        batch = tf.constant(stream.batch, tf.int64)
        # Each step's next batch is decoded beside it (nothing between them), while the
        # step waits on the ps: the decoding is off the step's path, as a pipeline's is.
        ahead = stream.decode(_rows(unit, batch, batch))  # empty past the unit's end
        with tf.control_dependencies([started.assign_add(records)]):  # before a step applies
            totals = one_step(stream.decode(_rows(unit, 0, batch)))
        for at in tf.range(2 * batch, records + batch, batch):
            now, ahead = ahead, stream.decode(_rows(unit, at, batch))
            totals = tf.nest.map_structure(tf.add, totals, one_step(now))
        return totals

    return loop


def _rows(records, first: tf.Tensor, n: tf.Tensor):
    """Records `first, ..., first + n - 1` of a unit's (fewer at its end): one step's batch."""

    def rows(tensor):
        if isinstance(tensor, tf.SparseTensor):
            rest = tensor.dense_shape[1:]
            start, size = tf.concat([[first], rest * 0], 0), tf.concat([[n], rest], 0)
            return tf.sparse.slice(tensor, start, size)
        return tensor[first : first + n]

    return tf.nest.map_structure(rows, records)
