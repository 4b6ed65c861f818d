"""A step's scalar sums carried through a loop of steps as one vector.

A loop of steps inside one `tf.function` adds up each step's sums (loss,
weight, examples, correct, ...). Each value carried round TensorFlow's
`while` loop costs a handful of control-flow ops per step besides its add,
and on a small model, whose step is a few hundred ops, a few dozen more are
a few percent of the step (`python -m trainer.bench --cases=small_mlp`). So
the float32 scalars travel packed in one vector (one stack and one add a
step), and at the end of the loop, once reduced, they are unpacked into the
step's own keys. Other sums (vectors such as histograms, other dtypes) are
carried as they are.
"""

from __future__ import annotations

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

    def unpack(self, totals: dict) -> dict:
        """The loop's totals with the packed vector back under the step's keys."""
        if _PACKED not in totals:
            return totals
        rest = {k: v for k, v in totals.items() if k != _PACKED}
        return {**rest, **dict(zip(self._keys, tf.unstack(totals[_PACKED])))}


def _packable(value) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype == tf.float32 and value.shape.rank == 0
