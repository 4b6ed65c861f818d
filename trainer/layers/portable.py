"""The `Portable` protocol: a layer whose variables are split into parts.

A checkpoint holds each part of a `Portable` layer (a shard of rows, a part of
a dynamic table) as its own variable; `trainer.loop.portable` reads one
written with another split through the protocol's twins and logical content.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

Slots = Callable[[keras.Variable], list[tuple]]
"""A trainable variable -> its optimizer slots, as `(slot variable, initial value)`."""


class Portable(abc.ABC):
    """A layer whose variables are split into parts, restorable under any other split.

    The layer's *logical* content (a whole table, kernel, or the rows of every
    id, with their optimizer slots) does not depend on how many parts hold it.
    `trainer.loop.portable` restores a checkpoint written with another split by
    building a `twin` with that split, restoring the checkpoint into it, and
    moving `export_logical()` of the twin into `import_logical()` of the layer.
    """

    @property
    @abc.abstractmethod
    def num_parts(self) -> int:
        """How many parts the layer's variables are split into."""

    @abc.abstractmethod
    def split_shapes(self, parts: int) -> list[tuple[int, ...]] | None:
        """The shapes of `self.variables` when split into `parts`; None if it cannot be."""

    @abc.abstractmethod
    def twin(self, parts: int) -> keras.layers.Layer:
        """A built copy of this layer split into `parts`, its variables zeros on this host."""

    @abc.abstractmethod
    def export_logical(self, slots: Slots) -> dict[str, np.ndarray]:
        """The content of this layer and of its optimizer `slots`, whatever its split."""

    @abc.abstractmethod
    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        """Sets this layer and its `slots` to `content` (another split's export); warnings."""

    def indexes(self) -> list[tf.Module]:
        """The lookup tables this layer checkpoints beside its variables."""
        return []


def with_slots(variable: keras.Variable, slots: Slots, name: str) -> list[tuple]:
    """`(name, variable, 0.0)`, then `(f"{name}/slot{k}", slot, initial)` for each of its slots."""
    found = enumerate(slots(variable))
    return [(name, variable, 0.0), *((f"{name}/slot{k}", s, init) for k, (s, init) in found)]
