"""A step's scalar sums carried through a loop of steps as one vector.

A loop of steps inside one `tf.function` adds up each step's sums (loss,
weight, examples, correct, ...). Each value carried round TensorFlow's
`while` loop costs a handful of control-flow ops per step besides its add,
and on a small model, whose step is a few hundred ops, a few dozen more are
a few percent of the step (`python -m trainer.bench --cases=small_mlp`). So
the float32 scalars travel packed in one vector (one stack and one add a
step), and at the end of the loop, once reduced, they are unpacked into the
step's own keys.

Two ways: `BufferedSums` starts the totals from zeros, so a loop traces its
step once (float32 sums of known shapes, vectors such as histograms too);
`PackedSums` starts them from a first step traced on its own, for other sums
(carried as they are besides the packed scalars) and for a loop that counts
its step's ops before it (`strategies.unrolled`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

_PACKED = "__packed_scalars__"  # the key of the packed vector inside the loop


class PackedSums:
    """Packs a step's float32 scalar sums into one vector, and unpacks the loop's totals.

    The keys packed are learned when the step is traced (`pack`); `unpack`,
    traced after the steps of the same loop, uses the last step's.
    """

    def __init__(self):
        self._keys: tuple[str, ...] = ()

    def pack(self, sums: dict) -> dict:
        """`sums` with its float32 scalars (2 or more) replaced by one vector."""
        keys = tuple(sorted(k for k, v in sums.items() if _packable(v)))
        if len(keys) < 2:  # nothing to gain
            keys = ()
        self._keys = keys
        if not keys:
            return sums
        rest = {k: v for k, v in sums.items() if k not in keys}
        return {**rest, _PACKED: tf.stack([sums[k] for k in keys])}

    def add(self, totals: dict, sums: dict) -> dict:
        return tf.nest.map_structure(tf.add, totals, self.pack(sums))

    def unpack(self, totals: dict) -> dict:
        """The loop's totals with the packed vector back under the step's keys."""
        if _PACKED not in totals:
            return totals
        rest = {k: v for k, v in totals.items() if k != _PACKED}
        return {**rest, **dict(zip(self._keys, tf.unstack(totals[_PACKED])))}


def _packable(value) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype == tf.float32 and value.shape.rank == 0


class Unbuffered(Exception):
    """Sums that do not fit a `BufferedSums` (another dtype, an unknown shape, too many)."""


class BufferedSums:
    """A step's sums carried round a loop in one float32 vector, from zeros.

    A loop of steps whose totals exist before its step is traced traces the step
    once, where it runs; totals that are the first step's own sums need that step
    traced once more before the loop, only to learn what it returns (on the
    default job, a quarter of the time to its first block). So the totals start
    as `zeros()`, `capacity` zeros of no fixed length, and each step adds its
    sums, float32 of known shapes (the objectives' are), laid out in their order
    in one vector: from the first step on the totals are as long as the sums.
    `add` raises `Unbuffered` for other sums, for a loop that carries them as
    they are.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._layout: tuple[Any, list[tf.TensorShape]] = ({}, [])  # the step's structure, shapes

    def zeros(self) -> tf.Tensor:
        """Zeros for any step's sums: `capacity` of them, their length left unknown."""
        return tf.compat.v1.placeholder_with_default(tf.zeros([self.capacity]), [None])

    def add(self, total: tf.Tensor, sums) -> tf.Tensor:
        """`total` with `sums` added (`total`'s first values are the sums so far).

        Slicing `total` waits only on the step before, so as in `total + sums`
        one op waits on this step's sums: the loop adds nothing to a step's path.

        Raises:
          Unbuffered: a sum that is not float32, of an unknown shape, or more
            values than `capacity`.
        """
        leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(sums)]
        if any(v.dtype != tf.float32 or not v.shape.is_fully_defined() for v in leaves):
            raise Unbuffered("a sum that is not float32 of a known shape")
        shapes = [v.shape for v in leaves]
        used = _length(shapes)
        if used > self.capacity:
            raise Unbuffered(f"{used} sums, over {self.capacity}")
        self._layout = (sums, shapes)
        if not leaves:
            return total[:0]
        if all(s.rank == 0 for s in shapes):  # the usual case: one op
            values = tf.stack(leaves)
        else:
            values = tf.concat([tf.reshape(v, [-1]) for v in leaves], 0)
        return values + total[:used]

    def trim(self, total: tf.Tensor) -> tf.Tensor:
        """`total` of the length of the step's sums (its shape known again)."""
        used = _length(self._layout[1])
        return tf.reshape(total[:used], [used])

    def unpack(self, total: tf.Tensor):
        """The step's sums read back from `total`, in the structure the step traced."""
        structure, shapes = self._layout
        leaves, start = [], 0
        for shape in shapes:
            size = shape.num_elements()
            leaves.append(tf.reshape(total[start : start + size], shape))
            start += size
        return tf.nest.pack_sequence_as(structure, leaves)


def _length(shapes: list[tf.TensorShape]) -> int:
    """How many values sums of `shapes` take laid out in one vector."""
    return sum(s.num_elements() for s in shapes)
