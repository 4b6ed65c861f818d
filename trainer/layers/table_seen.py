"""Which ids a dynamic table saw in training lately: a Bloom filter of two generations.

A mixin of `trainer.layers.tables.DynamicTable` (as the policies of
`trainer.layers.table_policy` are), with no state of its own: the filter is
the table's `seen` (None with `seen_bits` 0), a hash table from 0 (the
current generation) and 1 (the one before) to `seen_bits` bits each, as
int64 words.

Every training lookup sets its id's `SEEN_HASHES` bits in the current
generation (`_remember`, inside the admission's lock). Once
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
            table._load_seen(None)


class SeenFilter:
    """Which ids the table saw in training in its last one or two generations (`seen_ids`)."""

    def seen_bytes(self) -> int:
        """The bytes of the seen-filter: two generations of `seen_bits` bits (0 without one)."""
        return 0 if self.seen is None else 2 * self._seen_words() * 8

    def seen_ids(self, keys: tf.Tensor) -> tf.Tensor:
        """Whether each of int64 `keys` (1-D) was seen in training lately (all: no filter)."""
        if self.seen is None:
            return tf.ones_like(keys, tf.bool)
        generations = self._generations()
        positions = self._positions(keys)  # [n, hashes]
        words = tf.gather(generations, positions // 64, axis=1)  # [2, n, hashes]
        bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, positions % 64), 1)
        return tf.reduce_any(tf.reduce_all(bits == 1, axis=-1), axis=0)

    def _seen_words(self) -> int:
        return -(-self.seen_bits // 64)

    def _generations(self) -> tf.Tensor:
        """The filter's words `[2, words]`: the current generation, then the one before."""
        words = self.seen.lookup(tf.constant([0, 1], tf.int64))
        return tf.reshape(words, [2, self._seen_words()])

    def _positions(self, keys: tf.Tensor) -> tf.Tensor:
        """The filter's bits of each of `keys`, `[n, SEEN_HASHES]` int64."""
        salts = u64([(GOLDEN * (2 * h + 1) + _SALT) % 2**64 for h in range(SEEN_HASHES)])
        mixed = splitmix64(tf.bitcast(keys, tf.uint64)[:, None] ^ salts[None, :])
        return tf.cast(mixed % u64(self.seen_bits), tf.int64)

    def _remember(self, keys: tf.Tensor):
        """Sets the bits of `keys` in the current generation, and starts a new one when due.

        Writes the current generation alone, both when a new one starts.
        """
        words = self._seen_words()
        current = tf.reshape(self.seen.lookup(tf.constant([0], tf.int64)), [words])
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
            return self.seen.insert(tf.constant([0, 1], tf.int64), rows)

        def keep():
            return self.seen.insert(tf.constant([0], tf.int64), current[None])

        full = set_bits >= int(SEEN_FILL * self.seen_bits)
        return tf.cond(full, rotate, keep)

    def _load_seen(self, generations) -> None:
        """Sets the filter's words (`contents()["seen"]`); of another size or none: empty."""
        words = tf.zeros([2, self._seen_words()], tf.int64)
        if generations is not None and tuple(generations.shape) == tuple(words.shape):
            words = tf.constant(generations, tf.int64)
        self.seen.insert(tf.constant([0, 1], tf.int64), words)
