"""What a `DynamicEmbedding`'s table knows of its ids' frequencies, and which ids it holds.

Read by retrieval (`trainer.retrieval`): its log-Q correction divides each
candidate's score by the probability that the stream shows it, and that
probability is the count the table already keeps for admission and eviction
(`trainer.layers.tables`). Its eval and export score every id held.

* A held id's count is the one in the index, decayed by 2**(-age /
  `half_life`) from the step it was last seen to now, as "lfu" eviction
  decays it; an id waiting for admission (`min_count` > 1) has the sketch's
  estimate (or the index's count, without a sketch); any other id 0.
* The total is the decayed mass of the table's training lookups: with `L`
  lookups a step on average over `t` steps, `L * (1 - 2**(-t / H)) /
  (1 - 2**(-1 / H))` (H the half-life), the sum every count would reach if
  no id were evicted.

Plain functions of a layer's parts, on each part's device (its ps member
under `parameter_server`), as `trainer.layers.dynamic_lookup`'s are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from trainer.layers import tables
from trainer.layers.table_encoding import COUNT_LIMIT, COUNT_ONE, count_of, last_seen

if TYPE_CHECKING:
    from trainer.layers.dynamic_parts import TablePart


def held_keys(parts: list[TablePart]) -> tf.Tensor:
    """The int64 keys of every id holding a row, over every part (in no particular order)."""
    keys = []
    for part in parts:
        with part.on_device():
            _, info = part.table.slot_info.export()
            keys.append(tf.reshape(info, [-1, 3])[:, 2])
    return tf.concat(keys, 0)


def frequencies(parts: list[TablePart], keys: tf.Tensor) -> tf.Tensor:
    """The share of the table's recent training lookups that were each of int64 `keys` (float32).

    See the module docstring: each key's decayed count over the decayed total.
    """
    if len(parts) == 1:
        counts = [_counts(parts[0], keys)]
        positions = [tf.range(tf.size(keys))]
    else:
        owners = tables.part_of(keys, len(parts))
        positions = tf.dynamic_partition(tf.range(tf.size(keys)), owners, len(parts))
        counts = [
            _counts(part, part_keys)
            for part, part_keys in zip(
                parts, tf.dynamic_partition(keys, owners, len(parts)), strict=True
            )
        ]
    count = tf.dynamic_stitch(positions, counts)
    return tf.cast(count / _total(parts), tf.float32)


def _counts(part: TablePart, keys: tf.Tensor) -> tf.Tensor:
    """The counts (float64, in lookups) of `keys` in `part`, decayed to now."""
    table = part.table
    with part.on_device():
        now = table.now()
        value = tf.reshape(table.index.lookup(keys), [-1])
        held = value >= 0
        info = tf.reshape(table.slot_info.lookup(table.slots_of(value)), [-1, 3])
        age = tf.cast(now - last_seen(info), tf.float64)
        decay = tf.pow(tf.constant(2.0, tf.float64), -tf.maximum(age, 0.0) / table.half_life)
        held_count = tf.cast(count_of(info), tf.float64) / COUNT_ONE * decay
        if table.sketch is not None:  # ids waiting for admission: the sketch's estimate
            # The sketch's own reads (its part's), so the estimate is the one admission uses.
            waiting = table.count_sketch.estimates(keys)
        else:  # the index's count of an id waiting, `-1 - (count + step * COUNT_LIMIT)`
            waiting = tf.where(held, tf.zeros_like(value), (-value - 1) % COUNT_LIMIT)
        return tf.where(held, held_count, tf.cast(waiting, tf.float64))


def _total(parts: list[TablePart]) -> tf.Tensor:
    """The decayed mass of the table's training lookups (float64, at least 1)."""
    table = parts[0].table
    lookups = []
    for part in parts:
        with part.on_device():
            lookups.append(part.table.counter("lookups"))
    with parts[0].on_device():
        steps = tf.cast(tf.maximum(table.now(), 1), tf.float64)
    per_step = tf.cast(tf.add_n(lookups), tf.float64) / steps
    half = tf.constant(2.0, tf.float64)
    mass = (1.0 - tf.pow(half, -steps / table.half_life)) / (1.0 - 2.0 ** (-1.0 / table.half_life))
    return tf.maximum(per_step * mass, 1.0)
