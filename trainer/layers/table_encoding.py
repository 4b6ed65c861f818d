"""What the parts of a dynamic table share: its hash, and how its index packs counts and steps.

`trainer.layers.tables` (the index, the initial rows, the split by id) and
`trainer.layers.table_policy` (admission, the sketch, eviction) both read
and write these encodings; `tables` re-exports the constants.

* SplitMix64's finaliser (`splitmix64`) hashes ids, in TF's uint64
  arithmetic: the same on every device, shard and run.
* A held id's (decayed) count shares the int64 of its last-seen step in the
  index's `slot_info`: the step in the low `STEP_BITS` bits, the count in
  units of 1 / `COUNT_ONE` lookups above them (no byte per id); `last_seen`
  and `count_of` read them back.
* The count of an id not admitted yet stops at `COUNT_LIMIT - 1`; without a
  sketch, the index holds it as `-1 - (count + last-seen step * COUNT_LIMIT)`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

COUNT_LIMIT = 2**16  # counts of ids not admitted yet stop at COUNT_LIMIT - 1
# A held id's (decayed) count shares the int64 of its last-seen step: the step in the low
# STEP_BITS bits, the count in units of 1 / COUNT_ONE lookups above them (no byte per id).
STEP_BITS = 40
COUNT_ONE = 16
COUNT_MAX = 2 ** (63 - STEP_BITS) - 1

GOLDEN = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def u64(value: int | list[int]) -> tf.Tensor:
    """`value` (an int or a list of ints in [0, 2**64)) as a uint64 constant, exactly.

    Through a uint64 array: in a traced function, `tf.constant` of a list of
    Python ints goes through NumPy's own type for the list, which is float64
    where the list mixes values over and under 2**63 (their low bits lost),
    while eagerly it is exact.
    """
    return tf.constant(np.array(value, np.uint64))


def u64_as_traced(values: list[int]) -> tf.Tensor:
    """`values` as `tf.constant(values, tf.uint64)` gives them in a traced function.

    That is through NumPy's type for the list: float64 (the low bits lost)
    where it mixes values over and under 2**63, else exact. The fallback rows'
    salts (`tables.buckets_of`) were always built so in the traced steps that
    trained them; built so everywhere, an eager lookup reads the rows that
    training wrote.
    """
    return tf.constant(np.asarray(values).astype(np.uint64))


def splitmix64(x: tf.Tensor) -> tf.Tensor:
    """SplitMix64's finaliser on uint64 (multiplication wraps modulo 2**64)."""
    shift = tf.bitwise.right_shift
    x = (x ^ shift(x, u64(30))) * u64(_MIX[0])
    x = (x ^ shift(x, u64(27))) * u64(_MIX[1])
    return x ^ shift(x, u64(31))


def last_seen(info: tf.Tensor) -> tf.Tensor:
    """The last-seen steps of slots' (stamp, seen, id) `info` rows (their counts left out)."""
    return tf.bitwise.bitwise_and(info[:, 1], 2**STEP_BITS - 1)


def count_of(info: tf.Tensor) -> tf.Tensor:
    """The counts (at their last-seen step, in 1 / `COUNT_ONE` lookups) of slots' `info`."""
    return tf.bitwise.right_shift(info[:, 1], STEP_BITS)
