"""Checkpoint writes through one traced function, where TensorFlow would trace one a save.

Where a checkpoint's variables live on several members (parameter servers),
TensorFlow writes them eagerly through a function it traces anew at every
save (`MultiDeviceSaver.save`), and each member keeps every function it ran:
a ps member's memory grew by about 0.45 MB a save of the ctr job (2 workers
+ 2 ps), without end in a job that saves every few minutes for days.
`TracedWrite` traces the write once, the prefix and the caller's tensors its
arguments, and again only when the objects saved change (an optimizer's
slots, made at its first update, after a first save). A SavedModel's
variables are a checkpoint too: exports write theirs the same way
(`trainer.loop.export`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import tensorflow as tf

from strategies.base import variable_devices

_TASK = re.compile(r"/job:[^/]+/replica:\d+/task:\d+")


class TracedWrite:
    """`checkpoint.write(prefix)` in a traced function, kept while the objects saved stay the same.

    `prepare(*tensors)`, if given, runs in the function before the write, on
    the tensors of the call (a delta gathers its changed rows there); what
    it gathers may change shape from call to call without a new trace.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        device: str | None = None,
        options: tf.train.CheckpointOptions | None = None,
        prepare: Callable[..., None] | None = None,
    ):
        """Args:
        checkpoint: what is written.
        device: where what the write makes itself (the object graph) is placed:
          with this member's variables (a checkpoint's save counter), into their
          shard, as an eager write places it; None: not placed.
        options: the write's options.
        prepare: run in the traced function before the write, on the call's tensors.
        """
        self.checkpoint, self._device, self._options = checkpoint, device, options
        self._prepare = prepare
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
        with tf.device(self._device):
            if self._prepare is not None:
                self._prepare(*tensors)
            return self.checkpoint.write(prefix, options=self._options)


def all_here(variables: list, here: str | None = None) -> bool:
    """Whether every variable lives on this member (`here`: a device of it), or names none.

    `here` None: where an eager op runs in this process.
    """
    member = _TASK.match(tf.constant(0).device if here is None else here)
    for variable in variables:
        for device in variable_devices(variable):
            there = _TASK.match(device or "")
            if there and (not member or there[0] != member[0]):
                return False
    return True
