"""How long steps wait for their input: `input_wait_ms` in each block's metrics.

`TimedDataset` wraps any `Dataset` (in-process or on the tf.data service): its
training stream records, for each batch, the time from the moment its reader
asked for the batch to the moment the batch was there, and adds it up in a
variable of the trainer's host. A reader that finds the batch ready (the
pipeline keeps ahead of the steps) waits about nothing; when the input is the
bottleneck, the waits add up to the time steps stood idle. The reader is
whatever pulls batches from the pipeline's last stage: the step itself, or the
strategy's prefetch to the devices, which waits when the steps would.

The loop reports the waits of each block as milliseconds per step (the
progress line, TensorBoard's `train/input_wait_ms`, `results.json`), whether
the input runs in the trainer or on the tf.data service. Not under
`parameter_server`: its pipelines run on the workers, which would add to the
chief's variable with a remote call per batch; nor with `train.deterministic`,
under which TensorFlow refuses to read a clock.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from trainer.data.base import DatasetFn, TrainStreamWrapper


class InputWait:
    """Seconds spent waiting for training batches, added up until `take`."""

    def __init__(self) -> None:
        with tf.init_scope(), tf.device("/cpu:0"):  # the host, outside any strategy's scope
            self._seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="input_wait")

    def timed(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset`, its batches unchanged, each read timed."""
        asked = tf.data.Dataset.from_tensors(0).repeat().map(lambda _: tf.timestamp())

        def arrived(asked_at: tf.Tensor, batch):
            self._seconds.assign_add(tf.timestamp() - asked_at)
            return batch

        # Zip asks its inputs in order, in the reader's thread: first the time, then the batch.
        timed = tf.data.Dataset.zip((asked, dataset)).map(arrived)
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False  # else a thread reads, early
        return timed.with_options(options)

    def take(self) -> float:
        """The seconds waited since the last `take`."""
        seconds = float(self._seconds.numpy())
        self._seconds.assign_sub(seconds)
        return seconds


@dataclasses.dataclass(frozen=True)
class TimedDataset(TrainStreamWrapper):
    """`inner`, whose training stream adds its waits to `wait`."""

    wait: InputWait

    def train_fn(self, global_batch_size: int, seed: int, start_step: int = 0) -> DatasetFn:
        """The inner training stream, each read timed."""
        source = self.inner.train_fn(global_batch_size, seed, start_step)
        return lambda context: self.wait.timed(source(context))
