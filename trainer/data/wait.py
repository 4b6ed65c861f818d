"""How long steps wait for their input: `input_wait_ms` in each block's metrics.

`InputWait.timed(iterator)` wraps the training iterator the loop of steps
reads: each `next` (traced into the loop's graph) notes the time before it
asks for the batch and after the batch is there, and adds the difference up
in a variable of the trainer's host. A pipeline that keeps ahead of the steps
(its last stage prefetches) hands a batch over at once; when the input is the
bottleneck, the waits add up to the time steps stood idle. The pipeline
itself is untouched: timing it inside tf.data (a clock zipped with the batches,
and no prefetch at its end so that the clock ran in the reader's thread) cost
about 0.2 ms of CPU a step, where a loop of steps that only read small_mlp's
batches took 1.0 ms.

The loop reports the waits of each block as milliseconds per step (the
progress line, TensorBoard's `train/input_wait_ms`, `results.json`), whether
the input runs in the trainer or on the tf.data service. Not under
`parameter_server`: its pipelines run on the workers, which would add to the
chief's variable with a remote call per batch; nor with `train.deterministic`,
under which TensorFlow refuses to read a clock.
"""

from __future__ import annotations

import tensorflow as tf

from strategies import tf_private


class InputWait:
    """Seconds spent waiting for training batches, added up until `take`."""

    def __init__(self) -> None:
        with tf.init_scope(), tf.device("/cpu:0"):  # the host, outside any strategy's scope
            self._seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="input_wait")
        self._taken = 0.0  # the variable's total at the last `take`

    def timed(self, iterator):
        """`iterator` (the strategy's distributed one), each `next` timed into this variable."""
        return TimedIterator(iterator, self._seconds)

    @property
    def variable(self) -> tf.Variable:
        """The seconds waited in all, in float64: the timed iterators keep adding to it."""
        return self._seconds

    def take(self, total: float | None = None) -> float:
        """The seconds waited since the last `take` (the variable keeps adding up).

        `total`: the variable's value, where the caller read it already (the
        loop reads it with the step, `trainer.loop.readings`); else it is read.
        """
        if total is None:
            total = float(self._seconds.numpy())
        seconds, self._taken = total - self._taken, total
        return seconds


class TimedIterator(tf_private.WrappedComposite):
    """An iterator whose `next`, traced into the loop's graph, adds its wait to a variable.

    The clock reads and the batch's fetch are ordered by control dependencies:
    the first read before the fetch, the second once the batch is there.

    A composite value around the iterator it wraps: a `tf.function` given one
    takes the inner iterator as its input. A plain Python object would be
    traced anew for each iterator and hold it in the trace as a capture, with
    its pipelines' threads, for as long as the process lives.
    """

    def __init__(self, inner, seconds: tf.Variable):
        super().__init__(inner, seconds)

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self):
        asked = tf.timestamp()
        with tf.control_dependencies([asked]):
            batch = next(self.inner)
        with tf.control_dependencies(tf.nest.flatten(batch)):
            self.state.assign_add(tf.timestamp() - asked)
        return batch
