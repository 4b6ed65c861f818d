"""The held items' vectors for eval, computed once per evaluation pass and reused by its batches.

Eval ranks each query's item among every item the table holds, so each
batch needs every held item's vector. Nothing trains during a pass, so the
vectors are the same for all its batches: `HeldVectors.read(now)` computes
them at the first batch of a table step (`now`, the step of the item table's
clock) and keeps them with that step, padded to the table's capacity
(memory: capacity x width floats); the pass's other batches read them back.
A training step moves the clock, so the next pass computes them anew.

They are variables of each replica's own (`ON_READ`: a replica writes its
copy alone, which a mirrored variable would not let it; each replica
computes its copy once a pass), and not saved: no checkpoint or export
tracks them (they are no layer's weights).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


class HeldVectors:
    """Every held item's key and vector, kept per table step.

    Args:
      capacity: the most items the table holds.
      width: the item vectors' width.
      compute: `() -> (keys [n] int64, vectors [n, width] float32)`, the held
        items now (traced into the eval step).
    """

    def __init__(
        self, capacity: int, width: int, compute: Callable[[], tuple[tf.Tensor, tf.Tensor]]
    ):
        self._compute, self._capacity = compute, capacity
        local = {
            "trainable": False,
            # Each replica its own copy, written alone; read from outside, the first's.
            "synchronization": tf.VariableSynchronization.ON_READ,
            "aggregation": tf.VariableAggregation.ONLY_FIRST_REPLICA,
        }
        self._keys = tf.Variable(-tf.ones([capacity], tf.int64), dtype=tf.int64, **local)
        self._vectors = tf.Variable(tf.zeros([capacity, width]), dtype=tf.float32, **local)
        self._stamp = tf.Variable([-1, 0], dtype=tf.int64, **local)  # step, items

    def read(self, now: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The held items' keys `[n]` and vectors `[n, width]` at step `now` (int64 scalar)."""
        now = tf.cast(now, tf.int64)
        kept = self._stamp.read_value()
        return tf.cond(
            tf.equal(kept[0], now),
            lambda: (self._keys[: kept[1]], self._vectors[: kept[1]]),
            lambda: self._keep(now),
        )

    def _keep(self, now: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        keys, vectors = self._compute()
        vectors = tf.cast(vectors, tf.float32)
        n = tf.size(keys, out_type=tf.int64)
        padding = self._capacity - n
        kept = [
            self._keys.assign(tf.pad(keys, [[0, padding]], constant_values=-1)),
            self._vectors.assign(tf.pad(vectors, [[0, padding], [0, 0]])),
            self._stamp.assign(tf.stack([now, n])),
        ]
        with tf.control_dependencies(kept):
            return tf.identity(keys), tf.identity(vectors)
