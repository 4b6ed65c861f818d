"""Checkpoint writes through one traced function, where TensorFlow would trace one a save.

Where a checkpoint's variables live on several members (parameter servers),
TensorFlow writes them eagerly through a function it traces anew at every
save (`MultiDeviceSaver.save`), and each member keeps every function it ran:
a ps member's memory grew by about 0.45 MB a save of the ctr job (2 workers
+ 2 ps), without end in a job that saves every few minutes for days.
`TracedWrite` traces the write once, the prefix and the caller's tensors its
arguments, and again only when the objects saved change (an optimizer's
slots, made at its first update, after a first save).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tensorflow as tf


class TracedWrite:
    """`checkpoint.write(prefix)` in a traced function, kept while the objects saved stay the same.

    `prepare(*tensors)`, if given, runs in the function before the write, on
    the tensors of the call (a delta gathers its changed rows there); what
    it gathers may change shape from call to call without a new trace.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        options: tf.train.CheckpointOptions | None = None,
        prepare: Callable[..., None] | None = None,
    ):
        self.checkpoint, self._options, self._prepare = checkpoint, options, prepare
        self._function: tuple[tuple, Callable] | None = None  # (the objects saved, the function)

    def __call__(self, prefix: str, *tensors: tf.Tensor) -> str:
        """Writes the checkpoint at `prefix`; returns its path."""
        saved = tuple(map(id, tf.train.TrackableView(self.checkpoint).descendants()))
        if self._function is None or self._function[0] != saved:
            write = tf.function(self._write, autograph=False)
            self._function = (saved, write)
        tf.io.gfile.makedirs(os.path.dirname(prefix))
        return self._function[1](tf.constant(prefix), *tensors).numpy().decode()

    def _write(self, prefix: tf.Tensor, *tensors: tf.Tensor) -> tf.Tensor:
        # Where an eager write places them: what the write makes itself (the object
        # graph) goes with this member's variables (the save counter's), in one shard.
        with tf.device(self.checkpoint.save_counter.device):
            if self._prepare is not None:
                self._prepare(*tensors)
            return self.checkpoint.write(prefix, options=self._options)
