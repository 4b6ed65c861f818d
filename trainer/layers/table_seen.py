"""Which ids a dynamic table saw in training lately: a Bloom filter of two generations.

A part of `trainer.layers.tables.DynamicTable` (its `seen_filter`, None with
`seen_bits` 0), over the table's `seen`: a hash table from 0 (the current
generation) and 1 (the one before) to `seen_bits` bits each, as int64 words.

Every training lookup sets its id's `SEEN_HASHES` bits in the current
generation (`remember`, inside the admission's lock). Once
`SEEN_FILL` of the current generation's bits are set, it becomes the one
before and a new empty generation starts, so the filter forgets ids not seen
for one to two generations and never fills up. An id is seen (`seen_ids`)
if all its bits are set in either generation: an id seen in those
generations always is; an id not seen is taken for seen with probability at
most about 2 x `SEEN_FILL`**`SEEN_HASHES` (5.4%: the two generations' false
positives, each at most that full). The filter costs `seen_bits` / 4 bytes,
whatever the ids.

A checkpoint written without filters (before them, or with `seen_bits` 0)
restores into tables that have one (`restore_matched`, how every restore of
a model's checkpoint or delta goes): the filters are left out of the
restore, and start empty.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from trainer.layers.table_encoding import GOLDEN, splitmix64, u64

SEEN_BITS = 2**18  # bits per generation of a table's seen-filter (32 KB; two generations)
SEEN_HASHES = 3  # bits an id sets and tests
SEEN_FILL = 0.3  # the share of a generation's bits set at which a new generation starts
_SALT = 0x6A09E667F3BCC909  # moves the filter's hashes away from the fallback rows' and parts'


def restore_matched(checkpoint: tf.train.Checkpoint, path: str, tables: list) -> None:
    """Restores `path` into `checkpoint`, every object of it matched but filters `path` lacks.

    `tables`: the `DynamicTable`s reachable from `checkpoint`. If `path` holds
    no seen-filter, theirs are left out of the restore and start empty.

    Raises:
      AssertionError: `path` does not fit `checkpoint`'s objects.
    """
    with _left_out(tables, path):
        status = checkpoint.restore(path)
        status.assert_existing_objects_matched()
    # Values of `path` that no object takes are meant (a delta's rows, read apart; a filter
    # of a table that has none now): TF would log them as unrestored at exit.
    status.expect_partial()


@contextlib.contextmanager
def _left_out(tables: list, path: str):
    """Inside, `tables`' filters are untracked (a restore expects none) if `path` holds none.

    They are empty after it.
    """
    hidden = [(table, table.seen) for table in tables if table.seen is not None]
    if hidden:
        keys = tf.compat.v1.train.NewCheckpointReader(path).get_variable_to_shape_map()
        if any("/seen/.ATTRIBUTES/" in key for key in keys):
            hidden = []
    for table, _ in hidden:
        del table.seen  # untracked: a tracked attribute set to None stays a dependency
    try:
        yield
    finally:
        for table, seen in hidden:
            table.seen = seen
            table.seen_filter.load(None)


class SeenFilter:
    """Which ids a table saw in training in its last one or two generations (`seen_ids`).

    A part of `trainer.layers.tables.DynamicTable` (its `seen_filter`), over the
    hash table of words it is given (`words_table`: the table's own `seen`, kept
    there so that checkpoints hold it under the table's name).

    Args:
      words: the hash table from 0 (the current generation) and 1 (the one
        before) to `bits` bits each, as int64 words (`words_table`).
      bits: the bits of each generation.
    """

    def __init__(self, words: tf.lookup.experimental.MutableHashTable, bits: int):
        self.words, self.bits = words, int(bits)

    @staticmethod
    def words_table(bits: int) -> tf.lookup.experimental.MutableHashTable:
        """An empty hash table of two generations of `bits` bits, for `SeenFilter`'s `words`."""
        return tf.lookup.experimental.MutableHashTable(
            tf.int64, tf.int64, tf.zeros([_words_of(bits)], tf.int64)
        )

    def bytes(self) -> int:
        """The bytes of the filter: two generations of `bits` bits."""
        return 2 * _words_of(self.bits) * 8

    def seen_ids(self, keys: tf.Tensor) -> tf.Tensor:
        """Whether each of int64 `keys` (1-D) was seen in training lately."""
        generations = self.generations()
        positions = self._positions(keys)  # [n, hashes]
        words = tf.gather(generations, positions // 64, axis=1)  # [2, n, hashes]
        bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, positions % 64), 1)
        return tf.reduce_any(tf.reduce_all(bits == 1, axis=-1), axis=0)

    def generations(self) -> tf.Tensor:
        """The filter's words `[2, words]`: the current generation, then the one before."""
        words = self.words.lookup(tf.constant([0, 1], tf.int64))
        return tf.reshape(words, [2, _words_of(self.bits)])

    def _positions(self, keys: tf.Tensor) -> tf.Tensor:
        """The filter's bits of each of `keys`, `[n, SEEN_HASHES]` int64."""
        salts = u64([(GOLDEN * (2 * h + 1) + _SALT) % 2**64 for h in range(SEEN_HASHES)])
        mixed = splitmix64(tf.bitcast(keys, tf.uint64)[:, None] ^ salts[None, :])
        return tf.cast(mixed % u64(self.bits), tf.int64)

    def remember(self, keys: tf.Tensor):
        """Sets the bits of `keys` in the current generation, and starts a new one when due.

        Writes the current generation alone, both when a new one starts.
        """
        words = _words_of(self.bits)
        current = tf.reshape(self.words.lookup(tf.constant([0], tf.int64)), [words])
        positions, _ = tf.unique(tf.reshape(self._positions(keys), [-1]))
        one = tf.ones_like(positions)
        # A word's bits, each once: their sum is their union (no carries).
        added = tf.math.unsorted_segment_sum(
            tf.bitwise.left_shift(one, positions % 64), positions // 64, words
        )
        current = tf.bitwise.bitwise_or(current, added)
        set_bits = tf.reduce_sum(tf.cast(tf.raw_ops.PopulationCount(x=current), tf.int64))

        def rotate():
            rows = tf.stack([tf.zeros_like(current), current])
            return self.words.insert(tf.constant([0, 1], tf.int64), rows)

        def keep():
            return self.words.insert(tf.constant([0], tf.int64), current[None])

        full = set_bits >= int(SEEN_FILL * self.bits)
        return tf.cond(full, rotate, keep)

    def load(self, generations) -> None:
        """Sets the filter's words (`generations()`' value); of another size or none: empty."""
        words = tf.zeros([2, _words_of(self.bits)], tf.int64)
        if generations is not None and tuple(generations.shape) == tuple(words.shape):
            words = tf.constant(generations, tf.int64)
        self.words.insert(tf.constant([0, 1], tf.int64), words)


def _words_of(bits: int) -> int:
    """The int64 words that hold `bits` bits."""
    return -(-bits // 64)
