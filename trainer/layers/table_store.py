"""The hash tables of a dynamic table's index, and the reads and writes its parts share.

`IndexStore` holds the four hash tables of a `trainer.layers.tables.DynamicTable`'s
index (which the table also holds as its attributes, so that checkpoints
keep their keys), with the few operations on them that the table and its
policies (`trainer.layers.table_policy`) all use: the counters, a slot's
(stamp, last-seen step and count, id), the code an id's entry holds, and
marking slots seen or releasing them. It decides nothing: what to admit or
evict is the policies'.

* `index`: id -> its code: `held_code` of its stamp where it holds a row
  (`capacity + stamp`, plus `WRITTEN` once its row is written), a slot alone
  (below the capacity, as checkpoints written before stamps hold it), or,
  below 0, the count of an id not admitted yet
  (`-1 - (count + last-seen step * COUNT_LIMIT)`).
* `slot_info`: slot -> (stamp, last-seen step and count, id); `NO_SLOT` where free.
* `free`: a stack of freed slots (position -> slot).
* `counters`: `COUNTERS` by position.
"""

from __future__ import annotations

import tensorflow as tf

from trainer.layers.table_encoding import COUNT_MAX, STEP_BITS

COUNTERS = (
    "fresh",
    "free",
    "calls",
    "swept",
    "admitted",
    "evicted",
    "refused",
    "lookups",
    "defaults",
    "sketched",
)
POSITION = {name: index for index, name in enumerate(COUNTERS)}
NO_SLOT = (-1, -1, 0)  # what `slot_info` gives for a free slot
# Added to a held id's code in the index once its row is written for it (`mark_written`): bit
# 62, above every stamp (`capacity * (step + 1) < 2**62`), below the sign of ids waiting.
WRITTEN = 2**62


def hash_table(default) -> tf.lookup.experimental.MutableHashTable:
    """An empty int64 -> int64 hash table whose missing keys read `default`."""
    return tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default)


class IndexStore:
    """A dynamic table's index: its hash tables and their shared operations (module docstring).

    Args:
      capacity: the table's slots.
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.index = hash_table(-1)
        self.slot_info = hash_table(tf.constant(NO_SLOT, tf.int64))
        self.free = hash_table(-1)
        self.counters = hash_table(0)

    def counter(self, name: str) -> tf.Tensor:
        """The counter `name` (one of `COUNTERS`)."""
        return tf.reshape(self.counters.lookup(tf.constant([POSITION[name]], tf.int64)), [])

    def set(self, name: str, value: tf.Tensor):
        """Sets the counter `name` to `value`."""
        return self.counters.insert(tf.constant([POSITION[name]], tf.int64), tf.reshape(value, [1]))

    def add(self, **amounts: tf.Tensor):
        """Adds each of `amounts` to its counter, in one lookup and one insert."""
        keys = tf.constant([POSITION[name] for name in amounts], tf.int64)
        totals = tf.reshape(self.counters.lookup(keys), [-1])
        added = tf.stack([tf.cast(amount, tf.int64) for amount in amounts.values()])
        return self.counters.insert(keys, totals + added)

    def info(self, slots: tf.Tensor) -> tf.Tensor:
        """The (stamp, last-seen step, id) of each of `slots`; `NO_SLOT` where free."""
        return tf.reshape(self.slot_info.lookup(slots), [-1, 3])

    def keys_of(self, slots: tf.Tensor) -> tf.Tensor:
        """The id each slot holds."""
        return self.info(slots)[:, 2]

    def held(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Every held slot and its (stamp, last-seen step, id)."""
        slots, info = self.slot_info.export()
        return tf.reshape(slots, [-1]), tf.reshape(info, [-1, 3])

    def held_code(self, stamps: tf.Tensor, written: tf.Tensor | None = None) -> tf.Tensor:
        """What the index holds for an id of stamp `stamps`: `capacity + stamp` (+ `WRITTEN`).

        At least the capacity, which tells it from a slot alone (as the index held
        before) and from the count of an id not admitted yet (below 0); plus
        `WRITTEN` where `written` (None: nowhere), its row written for it.
        """
        codes = stamps + self.capacity
        if written is None:
            return codes
        return codes + tf.where(written, tf.constant(WRITTEN, tf.int64), 0)

    def slots_of(self, codes: tf.Tensor) -> tf.Tensor:
        """The slot of each of the index's values `codes` (held or older), -1 where none."""
        return tf.where(codes >= 0, tf.bitwise.bitwise_and(codes, WRITTEN - 1) % self.capacity, -1)

    def touch(
        self,
        slots: tf.Tensor,
        stamps: tf.Tensor,
        keys: tf.Tensor,
        step: tf.Tensor,
        counts: tf.Tensor,
    ):
        """Marks `slots` (holding `stamps` of `keys`) seen at `step`, with `counts` then."""
        packed = step + tf.bitwise.left_shift(tf.minimum(counts, COUNT_MAX), STEP_BITS)
        return self.slot_info.insert(slots, tf.stack([stamps, packed, keys], 1))

    def release(self, slots: tf.Tensor, counter: str):
        """Forgets the ids of `slots` (they are counted from zero if they come back).

        And adds how many to the counter `counter`.
        """
        return tf.group(
            self.index.remove(self.keys_of(slots)),
            self.slot_info.remove(slots),
            self.add(**{counter: tf.size(slots)}),
        )
