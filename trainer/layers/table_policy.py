"""A dynamic table's policies: which ids get a row, how waiting ids are counted, who leaves.

Three parts that `trainer.layers.tables.DynamicTable` holds as members, each
with a small interface of its own (the module docstring of `tables` tells
what they do together):

* `AdmissionPolicy` (the table's `admission`): `admit`, a step's ids counted
  and those seen `min_count` times given a slot; the table calls it inside
  its lock.
* `EvictionPolicy` (`evictions`): where the newcomers' slots come from
  (`allocate`: freed, never used, or evicted by "lfu" or "lru"), the counts
  decayed by age (`decayed`), and the TTL sweep (`maybe_sweep`).
* `CountMinSketch` (`count_sketch`): the counts of the ids not admitted yet,
  in a sketch of fixed size (with `min_count` > 1), with its own small
  interface (`rows`, `columns`, `estimate`, `counted`, `load`, `bytes`).

None holds state of its own: every hash table is the index's
(`trainer.layers.table_store.IndexStore`, whose tables are the table's
attributes, so a checkpoint's keys are those of the table alone). The
policies read and write it through the store's operations (counters, slot
info, codes, `touch`, `release`); admission takes the eviction policy, the
sketch and the seen-filter it is given.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from trainer.layers.table_encoding import (
    COUNT_LIMIT,
    COUNT_ONE,
    GOLDEN,
    count_of,
    last_seen,
    splitmix64,
    u64,
)

if TYPE_CHECKING:
    from trainer.layers.table_seen import SeenFilter
    from trainer.layers.table_store import IndexStore


class AdmissionPolicy:
    """Which of a step's ids get a row: those counted `min_count` times, most counted first.

    `admit` (inside the table's lock) marks the held ids seen, counts the
    others (in the index or the `CountMinSketch`), gives slots to those due
    one (`EvictionPolicy.allocate`), keeps the counts of those left waiting,
    notes every id in the seen-filter (`trainer.layers.table_seen`), and adds
    to the counters.

    Args:
      store: the table's index (`IndexStore`).
      evictions: the table's `EvictionPolicy`.
      min_count: lookups an id needs before it gets a row.
      count_sketch: the counts of ids not admitted yet (`CountMinSketch`); None
        with `min_count` 1: counts in the index.
      seen_filter: the table's `SeenFilter`, or None.
    """

    def __init__(
        self,
        store: IndexStore,
        evictions: EvictionPolicy,
        min_count: int,
        count_sketch: CountMinSketch | None,
        seen_filter: SeenFilter | None,
    ):
        self.store, self.evictions = store, evictions
        self.min_count = int(min_count)
        self.count_sketch, self.seen_filter = count_sketch, seen_filter

    def admit(self, keys: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Counts int64 `keys` (1-D, a step's) at `step`, admits those seen `min_count` times.

        Every key's last-seen step becomes `step`. Returns True once every
        change is made. Inside the table's lock (`DynamicTable.admit`).
        """
        store = self.store
        unique, position = tf.unique(keys)
        seen = tf.math.unsorted_segment_sum(
            tf.ones_like(position, tf.int64), position, tf.size(unique)
        )
        value = tf.reshape(store.index.lookup(unique), [-1])
        held = value >= 0
        touched = self._touch_held(unique, value, held, seen, step)
        counts, sketched = self._waiting_counts(unique, value, held, seen)
        with tf.control_dependencies([touched]):
            wanted, new_slots = self._grant(counts, held, step)
        granted = wanted[: tf.size(new_slots)]
        new_keys = tf.gather(unique, granted)
        new_stamps = step * store.capacity + new_slots
        admitted = tf.scatter_nd(
            granted[:, None], tf.ones_like(granted, tf.bool), tf.shape(held, out_type=tf.int64)
        )
        # Ids left waiting keep their count, unless one lookup admits (it says nothing then):
        # refused or not, a table admitting at the first lookup grows no entry per id.
        kept = tf.no_op()
        if self.min_count > 1:
            waiting = ~held & ~admitted
            kept = self._keep_counts(unique, waiting, counts, seen, step, sketched)
        # What the step's lookups read: a row where the id holds one now, else the default.
        read_rows = tf.reduce_sum(tf.where(held | admitted, seen, 0))
        updates = [
            store.index.insert(new_keys, store.held_code(new_stamps)),
            store.touch(
                new_slots, new_stamps, new_keys, step, tf.gather(counts, granted) * COUNT_ONE
            ),
            store.add(
                admitted=tf.size(new_slots),
                refused=tf.size(wanted) - tf.size(new_slots),
                lookups=tf.size(keys),
                defaults=tf.size(keys, out_type=tf.int64) - read_rows,
            ),
            kept,
        ]
        if self.seen_filter is not None:
            updates.append(self.seen_filter.remember(unique))
        with tf.control_dependencies(updates):
            return tf.constant(True)

    def _touch_held(
        self,
        unique: tf.Tensor,
        value: tf.Tensor,
        held: tf.Tensor,
        seen: tf.Tensor,
        step: tf.Tensor,
    ):
        """Marks the `held` ids of `unique` seen at `step`: their counts decayed, plus `seen`.

        `value` is each id's in the index (`held_code` of its stamp where held).
        """
        at = tf.where(held)[:, 0]  # one mask for the three (a mask is four ops)
        held_slots = self.store.slots_of(tf.gather(value, at))
        held_info = self.store.info(held_slots)
        return self.store.touch(
            held_slots,
            held_info[:, 0],
            tf.gather(unique, at),
            step,
            self.evictions.decayed(held_info, step) + tf.gather(seen, at) * COUNT_ONE,
        )

    def _waiting_counts(
        self, unique: tf.Tensor, value: tf.Tensor, held: tf.Tensor, seen: tf.Tensor
    ) -> tuple[tf.Tensor, tuple[tf.Tensor, tf.Tensor] | None]:
        """The counts of the ids of `unique` not `held`, this step's `seen` lookups included.

        From the index's `value` (without a sketch) or the sketch's estimate;
        0 for held ids; at most `COUNT_LIMIT - 1`. And the sketch's cells and
        the ids' columns, read for `_keep_counts` (None without a sketch).
        """
        if self.count_sketch is None:
            counts = tf.where(held, tf.zeros_like(value), -value - 1) % COUNT_LIMIT + seen
            sketched = None
        else:
            cells, columns = self.count_sketch.rows(), self.count_sketch.columns(unique)
            estimated = self.count_sketch.estimate(cells, columns)
            counts = tf.where(held, tf.zeros_like(value), estimated + seen)
            sketched = (cells, columns)
        return tf.minimum(counts, COUNT_LIMIT - 1), sketched

    def _grant(
        self, counts: tf.Tensor, held: tf.Tensor, step: tf.Tensor
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The ids due a slot (positions, the most counted first) and the slots they get.

        Ids not `held` and counted `min_count` times want a slot; `EvictionPolicy.allocate`
        gives as many as it can, to the first of them: the others are refused.
        """
        wanted = tf.where(~held & (counts >= self.min_count))[:, 0]
        # The most counted first (stable: then in the order of the batch).
        wanted = tf.gather(wanted, tf.argsort(-tf.gather(counts, wanted), stable=True))
        return wanted, self.evictions.allocate(tf.gather(counts, wanted), step)

    def _keep_counts(
        self,
        unique: tf.Tensor,
        waiting: tf.Tensor,
        counts: tf.Tensor,
        seen: tf.Tensor,
        step: tf.Tensor,
        sketched: tuple[tf.Tensor, tf.Tensor] | None,
    ):
        """Keeps the `counts` of the `waiting` ids of `unique`, for their next lookups.

        In the sketch (`CountMinSketch.counted`, with the cells and columns
        `sketched`), or else in the index: the count, and the step it was last
        seen at.
        """
        if sketched is not None:
            taken = self.store.counter("sketched") + tf.reduce_sum(tf.boolean_mask(seen, waiting))
            write, taken = self.count_sketch.counted(*sketched, waiting, counts, taken)
            return tf.group(write, self.store.set("sketched", taken))
        return self.store.index.insert(
            tf.boolean_mask(unique, waiting),
            -1 - (tf.boolean_mask(counts, waiting) + step * COUNT_LIMIT),
        )


class CountMinSketch:
    """The counts of the ids not admitted yet: `depth` rows of `width` int32 cells.

    A part of `trainer.layers.tables.DynamicTable` (its `count_sketch`, with
    `min_count` > 1), over the hash table of cells it is given (`cells_table`:
    the table's own `sketch`, kept there so that checkpoints hold it under the
    table's name), which maps each row number to its cells. A key counts in one
    cell per row (`_columns`); its count is its smallest cell (`estimate`), an
    overestimate within the bound of docs/tables.md, which halving every cell
    now and then keeps (`counted`).
    """

    def __init__(self, cells: tf.lookup.experimental.MutableHashTable, width: int, depth: int):
        self.cells, self.width, self.depth = cells, int(width), int(depth)

    @staticmethod
    def cells_table(width: int) -> tf.lookup.experimental.MutableHashTable:
        """An empty hash table of rows of `width` cells, for `CountMinSketch`'s `cells`."""
        return tf.lookup.experimental.MutableHashTable(
            tf.int64, tf.int32, tf.zeros([width], tf.int32)
        )

    def bytes(self) -> int:
        """The bytes of the sketch: its cells."""
        return self.depth * self.width * 4

    def rows(self) -> tf.Tensor:
        """The sketch's cells `[depth, width]` (int32)."""
        rows = self.cells.lookup(tf.range(self.depth, dtype=tf.int64))
        return tf.reshape(rows, [self.depth, self.width])

    def estimates(self, keys: tf.Tensor) -> tf.Tensor:
        """The counts of int64 `keys` as admission reads them: `estimate` of the cells now."""
        return self.estimate(self.rows(), self.columns(keys))

    def columns(self, keys: tf.Tensor) -> tf.Tensor:
        """The cell of each of `keys` in each row of the sketch, `[depth, n]` (int64)."""
        rows = tf.bitcast(tf.range(1, self.depth + 1, dtype=tf.int64), tf.uint64)
        salts = splitmix64(rows * u64(GOLDEN))
        mixed = splitmix64(tf.bitcast(keys, tf.uint64)[None, :] ^ salts[:, None])
        return tf.cast(mixed % u64(self.width), tf.int64)

    def estimate(self, cells: tf.Tensor, columns: tf.Tensor) -> tf.Tensor:
        """The counts of the keys of `columns`: their smallest cell (an overestimate), int64."""
        rows = tf.range(self.depth, dtype=tf.int64)[:, None] + tf.zeros_like(columns)
        found = tf.gather_nd(cells, tf.stack([rows, columns], -1))
        return tf.cast(tf.reduce_min(found, 0), tf.int64)

    def counted(
        self, cells, columns, waiting, counts, taken: tf.Tensor
    ) -> tuple[tf.Operation, tf.Tensor]:
        """Raises the cells of the `waiting` keys to their `counts` (a conservative update).

        Then, once the sketch has taken `width` lookups since it was last halved
        (`taken`, this step's included), halves every cell, so that counts age
        and the overestimate stays within the bound of docs/tables.md. Returns
        the write, and the lookups taken after it (0 where it halved).
        """
        columns = tf.boolean_mask(columns, waiting, axis=1)
        rows = tf.range(self.depth, dtype=tf.int64)[:, None] + tf.zeros_like(columns)
        cells = tf.tensor_scatter_nd_max(
            cells,
            tf.reshape(tf.stack([rows, columns], -1), [-1, 2]),
            tf.reshape(
                tf.cast(tf.boolean_mask(counts, waiting)[None, :] + rows * 0, tf.int32), [-1]
            ),
        )
        full = taken >= self.width
        cells = tf.where(full, tf.bitwise.right_shift(cells, 1), cells)
        write = self.cells.insert(tf.range(self.depth, dtype=tf.int64), cells)
        return write, tf.where(full, tf.zeros_like(taken), taken)

    def load(self, cells) -> None:
        """Sets the cells (`rows()`' value; None or empty: zeros)."""
        value = np.zeros([self.depth, self.width], np.int32)
        if cells is not None and np.size(cells):
            value = np.asarray(cells, np.int32)
        self.cells.insert(np.arange(self.depth, dtype=np.int64), value)


class EvictionPolicy:
    """Where newcomers' slots come from, and which held ids lose theirs.

    `allocate` gives freed slots, then never used ones, then (with
    `eviction` "lfu" or "lru") evicted ones (`_evict`); `maybe_sweep` frees
    the ids not seen for `ttl_steps`; `decayed` gives held ids' counts at a
    step. An evicted or swept id is forgotten (`IndexStore.release`): it is
    counted from zero if it comes back.

    Args:
      store: the table's index (`IndexStore`).
      eviction: "lfu", "lru" or None (a full table refuses new ids).
      half_life: steps over which an unseen id's count halves.
      ttl_steps: free the rows of ids not seen for this many steps (0: never).
    """

    def __init__(self, store: IndexStore, eviction: str | None, half_life: int, ttl_steps: int):
        self.store, self.eviction = store, eviction
        self.half_life, self.ttl_steps = int(half_life), int(ttl_steps)
        self.sweep_every = max(1, math.ceil(self.ttl_steps / 8))

    def decayed(self, info: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """The counts of slots of `info` decayed from their last-seen step to `step` (int64).

        Halved every `half_life` steps unseen (exactly: by 2**(-age / half_life),
        rounded down), in float64 on the host: the same on every device and run.
        """
        age = tf.cast(step - last_seen(info), tf.float64)
        counts = tf.cast(count_of(info), tf.float64)
        decay = tf.pow(tf.constant(2.0, tf.float64), -age / self.half_life)
        return tf.cast(tf.floor(counts * decay), tf.int64)

    def allocate(self, wanted: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Free slots for the newcomers of counts `wanted` (most counted first, in lookups).

        Freed slots, then never used ones, then evicted ones: under "lru" the
        ids seen longest ago; under "lfu" an id of a lower decayed count than
        the newcomer's, for as many newcomers as beat one (`_evict`). As many
        slots as newcomers get one, given in the order of `wanted`.
        """
        store, number = self.store, tf.size(wanted, out_type=tf.int64)
        free = store.counter("free")
        reused = tf.minimum(number, free)
        popped = tf.reshape(store.free.lookup(tf.range(free - reused, free)), [-1])
        fresh = store.counter("fresh")
        more = tf.minimum(number - reused, store.capacity - fresh)
        updates = [store.set("free", free - reused), store.set("fresh", fresh + more)]
        with tf.control_dependencies(updates):
            slots = [popped, tf.range(fresh, fresh + more)]
            if self.eviction is not None:
                slots.append(self._evict(wanted[reused + more :], step))
            return tf.concat(slots, 0)

    def _evict(self, newcomers: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Frees a slot for each of the `newcomers` (their counts, highest first) it can.

        Only ids not seen at `step` are evicted, the lowest first. "lru": the ids
        seen longest ago first, one per newcomer. "lfu": the lowest decayed
        counts first (then the oldest), and a newcomer takes the slot of the
        i-th lowest only if its count is higher (TinyLFU's admission: a one-off
        id does not push out an id that keeps coming back; it reads the
        fallback rows). Ties by id: the choice depends on neither slots nor
        export order.
        """
        count = tf.size(newcomers, out_type=tf.int64)

        def evict():
            slots, info = self.store.held()
            older = last_seen(info) < step
            slots, info = tf.boolean_mask(slots, older), tf.boolean_mask(info, older)
            order = tf.argsort(info[:, 2], stable=True)
            order = tf.gather(order, tf.argsort(tf.gather(last_seen(info), order), stable=True))
            if self.eviction == "lfu":
                counts = tf.gather(self.decayed(info, step), order)
                lowest = tf.argsort(counts, stable=True)[:count]
                order = tf.gather(order, lowest)
                # Newcomers highest first against victims lowest first: those that win are a prefix.
                beaten = newcomers[: tf.size(order)] * COUNT_ONE > tf.gather(counts, lowest)
                order = order[: tf.reduce_sum(tf.math.cumprod(tf.cast(beaten, tf.int64)))]
            chosen = tf.gather(slots, order[:count])
            with tf.control_dependencies([self.store.release(chosen, "evicted")]):
                return tf.identity(chosen)

        return tf.cond(count > 0, evict, lambda: tf.zeros([0], tf.int64))

    def maybe_sweep(self, step: tf.Tensor) -> tf.Tensor:
        """Every `sweep_every` steps (once a step), frees the rows of ids older than the TTL."""
        store = self.store
        due = tf.equal(step % self.sweep_every, 0) & tf.not_equal(store.counter("swept"), step + 1)

        def sweep():
            keys, values = store.index.export()
            keys, values = tf.reshape(keys, [-1]), tf.reshape(values, [-1])
            counted_until = (-values - 1) // COUNT_LIMIT
            forgotten = (values < 0) & (counted_until <= step - self.ttl_steps)
            slots, info = store.held()
            expired = tf.boolean_mask(slots, last_seen(info) <= step - self.ttl_steps)
            free = store.counter("free")
            count = tf.size(expired, out_type=tf.int64)
            with tf.control_dependencies([store.release(expired, "evicted")]):
                done = tf.group(
                    store.index.remove(tf.boolean_mask(keys, forgotten)),
                    store.free.insert(tf.range(free, free + count), expired),
                    store.set("free", free + count),
                    store.set("swept", step + 1),
                )
            with tf.control_dependencies([done]):
                return tf.constant(True)

        return tf.cond(due, sweep, lambda: tf.constant(False))
