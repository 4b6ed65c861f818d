"""Dynamic embedding tables: a row per admitted id, created on admission, freed on eviction.

A table maps raw ids (int64 over the whole 64-bit range; strings by their
64-bit fingerprint, `key64`) to rows of a `[capacity, dim]` variable. It has
two halves:

* The *index*, on the host and shared by every replica of the process: hash
  tables (`tf.lookup.experimental.MutableHashTable`) from id to row slot and
  from slot to (stamp, last-seen step and count, id), a stack of freed slots
  and a few counters. The counts of ids not admitted yet (`min_count` > 1)
  live in a count-min sketch of fixed size (`sketch_depth` rows of
  `sketch_width` int32 cells), so the tail that is never admitted costs no
  memory per id. (A value below 0 in the id -> slot table, the count of an id
  not admitted yet as checkpoints written before the sketch hold it, is still
  read: `-1 - (count + last-seen step * COUNT_LIMIT)`.)
  Every change to the index runs inside one `tf.CriticalSection`, so callers
  admitting ids at once (asynchronous workers) cannot race. The index is made
  of lookup tables, not variables, because a variable created under a
  strategy's scope is copied per replica, and the replicas must share one.
* The *rows* (`DynamicEmbedding.rows`), an ordinary trainable variable that
  the strategy places like any other (mirrored copies, the host), read with
  `tf.gather`: its gradient is a `tf.IndexedSlices` of the rows looked up,
  which the optimizers of `trainer.loop.optim` apply sparsely to those rows and
  their slots only. A per-copy `row_stamps` variable says which admission a
  row's values belong to.

A row's initial value depends only on (seed, id): `initial_rows` hashes
(seed, id, column) with SplitMix64 in TF's uint64 arithmetic. Rows are not
written when an id is admitted (a replica cannot write a mirrored variable
alone); a lookup reads the initial value wherever the slot's stamp in the
index differs from the row's stamp (a new id, or a reused slot), and the
optimizer's update first resets such rows (and their optimizer slots) to the
initial value, then applies the gradient.

Admission is decided once a step on the ids of the whole global batch (the
layer gathers them from every replica), before the step's lookups: an id
admitted at step t reads (and trains) its own row at step t. The replicas of
a step each admit the same gathered batch, and the first to take the lock
changes the table (`admit(once=True)`: a batch's fingerprint and step are
noted). So what a step reads does not depend on how its batch is split over
replicas or in what order replicas reach the table: the same ids are admitted
and every id gets the same row under one device, several replicas or several
workers. An id counts once per lookup; after `min_count` lookups it is
admitted.

Eviction: when the table is full, a new id takes the slot of the held id of
the lowest count decayed by age (`eviction="lfu"`, the default: the count
halves every `half_life` steps unseen) or of the id seen longest ago
(`"lru"`); ties go to the older, then the smaller id, and an id seen at the
current step is never evicted. Under "lfu" a new id takes that slot only if
its own count (its lookups this step, plus the sketch's with `min_count` > 1)
is higher (TinyLFU's admission): the step's new ids most counted first, each
against the lowest held count left, until one does not beat it; the rest are
refused (they read the default or fallback row, and are counted again when
they come back). With `ttl_steps`, a sweep every
`ceil(ttl_steps / 8)` steps frees ids not seen for `ttl_steps` steps. With
eviction off (`eviction=None`) a full table refuses new ids: they read the
default row and are counted (`refused`); which of a step's new ids are
refused then follows their counts, then their order.

The step is the optimizer's `iterations` once `trainer.loop.optim` has built for
the rows (`use_clock`); a table used on its own counts its admission calls.

Counters (`COUNTERS`, kept in the index and checkpointed with it) say what
the table did: ids `admitted`, `evicted` (by LRU, LFU or the TTL), `refused`
(a full table without eviction, or under "lfu" holding no lower count), and
of the training lookups (each id of a step's global batch, leaving out the
mask id), how many there were
(`lookups`) and how many read the default row (`defaults`: ids without a row
after the step's admission); `sketched`: lookups the sketch took since it was
last halved. They are counted in the admission the step
already makes, so they cost no extra pass. `figures()` reads them with the
sizes of the index, for the per-block summaries of `trainer.loop.actions.tables`.

`contents()` and `load()` give and set what a table holds in a form that
does not depend on its slots or capacity (ids, admission and last-seen
steps, counts, the sketch), so a split table restores into another split
(`trainer.loop.portable`).
"""

from __future__ import annotations

import math
import uuid
import weakref

import numpy as np
import tensorflow as tf

DEFAULT_CAPACITY = 2**18  # rows per table: 32 MB of float32 rows at width 32
ROW_SCALE = 0.05  # initial rows are uniform in [-ROW_SCALE, ROW_SCALE), as Keras's "uniform"
EVICTIONS = ("lfu", "lru", None)
DEFAULT_EVICTION = "lfu"  # measured better than "lru" on a drifting long tail (docs/tables.md)
COUNT_LIMIT = 2**16  # counts of ids not admitted yet stop at COUNT_LIMIT - 1
# A held id's (decayed) count shares the int64 of its last-seen step: the step in the low
# STEP_BITS bits, the count in units of 1 / COUNT_ONE lookups above them (no byte per id).
STEP_BITS = 40
COUNT_ONE = 16
COUNT_MAX = 2 ** (63 - STEP_BITS) - 1
HALF_LIFE = 500  # steps over which an id's count halves when it is not seen ("lfu")
# Counts of ids not admitted yet (`min_count` > 1): a count-min sketch of SKETCH_DEPTH rows of
# SKETCH_WIDTH int32 cells, halved whenever SKETCH_WIDTH lookups were added since the last.
SKETCH_WIDTH = 2**13
SKETCH_DEPTH = 2
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
_C = {name: index for index, name in enumerate(COUNTERS)}
_TOTALS = ("admitted", "evicted", "refused", "lookups", "defaults")  # add up over a table's parts

# Memory of one entry of the index's hash tables (TF's `MutableHashTable` is a
# `std::unordered_map`: a node, and a bucket pointer), measured on TF 2.21,
# Linux x86-64, as the growth of the resident memory over a million inserts.
ENTRY_BYTES = 42  # int64 -> int64
INFO_ENTRY_BYTES = 78  # int64 -> three int64 (a slot's stamp, last-seen step and id)
_NO_SLOT = (-1, -1, 0)  # what `slot_info` gives for a free slot

_GOLDEN = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _u64(value: int) -> tf.Tensor:
    return tf.constant(value, tf.uint64)


def _splitmix64(x: tf.Tensor) -> tf.Tensor:
    """SplitMix64's finaliser on uint64 (multiplication wraps modulo 2**64)."""
    shift = tf.bitwise.right_shift
    x = (x ^ shift(x, _u64(30))) * _u64(_MIX[0])
    x = (x ^ shift(x, _u64(27))) * _u64(_MIX[1])
    return x ^ shift(x, _u64(31))


def key64(keys: tf.Tensor) -> tf.Tensor:
    """Ids as int64: int ids as they are, strings by their 64-bit fingerprint."""
    if keys.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(keys, 2**63 - 1)
    return tf.cast(keys, tf.int64)


def initial_rows(seed: int, keys: tf.Tensor, dim: int) -> tf.Tensor:
    """The initial rows `[n, dim]` of ids `keys`: uniform in [-ROW_SCALE, ROW_SCALE).

    A function of (seed, id, column) only: the same on every device, shard and run.
    """
    ids = tf.bitcast(key64(keys), tf.uint64)[:, None]
    columns = tf.range(dim, dtype=tf.int64)
    base = _splitmix64(_u64(seed % 2**64) ^ _splitmix64(ids * _u64(_GOLDEN)))
    bits = _splitmix64(base + tf.bitcast(columns, tf.uint64)[None, :] * _u64(_GOLDEN))
    top = tf.cast(tf.bitwise.right_shift(bits, _u64(40)), tf.float32)  # 24 bits: exact
    return (top / 2.0**24 * 2.0 - 1.0) * ROW_SCALE


def part_of(keys: tf.Tensor, parts: int) -> tf.Tensor:
    """Which of `parts` parts of a split table holds each of int64 `keys` (int32).

    By a hash of the id, so that consecutive ids spread evenly.
    """
    mixed = _splitmix64(tf.bitcast(keys, tf.uint64))
    return tf.cast(mixed % _u64(parts), tf.int32)


def bucket_of(keys: tf.Tensor, buckets: int) -> tf.Tensor:
    """Which of `buckets` hashed rows each of int64 `keys` reads without a row of its own (int64).

    By a hash salted apart from `part_of`'s, so that a part's ids spread over every bucket.
    """
    mixed = _splitmix64(tf.bitcast(keys, tf.uint64) + _u64(_GOLDEN))
    return tf.cast(mixed % _u64(buckets), tf.int64)


class DynamicTable(tf.Module):
    """The index of one dynamic table: int64 ids -> row slots, admission and eviction.

    Args:
      capacity: the most rows (slots) the table holds.
      min_count: lookups an id needs before it gets a row.
      ttl_steps: free the rows of ids not seen for this many steps (0: never).
      eviction: "lfu" (a full table evicts the id of the lowest count decayed by
        its age, `half_life`), "lru" (the least recently seen id) or None (a full
        table refuses new ids).
      half_life: steps over which an unseen id's count halves ("lfu").
      sketch_width, sketch_depth: the count-min sketch that counts the lookups
        of ids not admitted yet (with `min_count` > 1; else none).
    """

    def __init__(
        self,
        capacity: int,
        min_count: int = 1,
        ttl_steps: int = 0,
        eviction: str | None = DEFAULT_EVICTION,
        name: str = "table",
        half_life: int = HALF_LIFE,
        sketch_width: int = SKETCH_WIDTH,
        sketch_depth: int = SKETCH_DEPTH,
    ):
        super().__init__(name=name)
        self.capacity = int(capacity)
        self.min_count = int(min_count)
        self.ttl_steps = int(ttl_steps)
        self.eviction = eviction
        self.half_life = int(half_life)
        self.sketch_width, self.sketch_depth = int(sketch_width), int(sketch_depth)
        self.sweep_every = max(1, math.ceil(self.ttl_steps / 8))
        with tf.device("/cpu:0"):
            self.index = self._hash_table(-1)
            self.slot_info = self._hash_table(tf.constant(_NO_SLOT, tf.int64))
            self.free = self._hash_table(-1)
            self.counters = self._hash_table(0)
            # The global batches admitted at each step (fingerprint -> step), so that every
            # replica may admit a step's batch and only the first changes the index. Not
            # checkpointed (a list hides it from tracking): it matters within a step only.
            self._batches = [self._hash_table(-1)]
            self.sketch = None
            if self.min_count > 1:  # a row of cells per key 0 .. depth - 1
                self.sketch = tf.lookup.experimental.MutableHashTable(
                    tf.int64, tf.int32, tf.zeros([self.sketch_width], tf.int32)
                )
        # A shared name of its own: the CriticalSections a process creates eagerly
        # without one are all one mutex (TF 2.21), and two tables admitting in one
        # step then wait on each other forever.
        self._lock = tf.CriticalSection(
            name=f"{name}_lock", shared_name=f"{name}_lock_{uuid.uuid4().hex}"
        )
        self._clock = None

    @staticmethod
    def _hash_table(default) -> tf.lookup.experimental.MutableHashTable:
        return tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default)

    def lock_device(self) -> str:
        """The device of the lock that every change to the index takes."""
        return self._lock._handle.device

    def use_clock(self, step: tf.Variable) -> None:
        """Takes the step from `step` (the optimizer's `iterations`) instead of counting calls."""
        self._clock = step

    @property
    def clocked(self) -> bool:
        """Whether the step comes from a clock (`use_clock`) rather than the count of calls."""
        return self._clock is not None

    def now(self) -> tf.Tensor:
        """The current step, on this table's device.

        A step read from the clock is copied here once: ops of the index that
        read the clock's variable where it lives (another ps member) made a
        step's admission exchange control messages with that task.
        """
        if self._clock is not None:
            with tf.device(self.lock_device()):
                return tf.identity(tf.cast(tf.convert_to_tensor(self._clock), tf.int64))
        return self.counter("calls")

    # Counters.

    def counter(self, name: str) -> tf.Tensor:
        """The counter `name` (one of `COUNTERS`)."""
        return tf.reshape(self.counters.lookup(tf.constant([_C[name]], tf.int64)), [])

    def _set(self, name: str, value: tf.Tensor):
        return self.counters.insert(tf.constant([_C[name]], tf.int64), tf.reshape(value, [1]))

    def _add(self, **amounts: tf.Tensor):
        """Adds each of `amounts` to its counter, in one lookup and one insert."""
        keys = tf.constant([_C[name] for name in amounts], tf.int64)
        totals = tf.reshape(self.counters.lookup(keys), [-1])
        added = tf.stack([tf.cast(amount, tf.int64) for amount in amounts.values()])
        return self.counters.insert(keys, totals + added)

    def size(self) -> tf.Tensor:
        """Ids holding a row."""
        return self.slot_info.size()

    def figures(self) -> dict[str, int]:
        """Every counter, the ids held, and the index's bytes (an estimate: `ENTRY_BYTES`).

        Eager: from the coordinator under `parameter_server`, a few small reads
        on the table's ps member. The index holds an entry per id held or counted
        (`index`), one more per id held (`slot_info`) and one per slot ever
        freed (`free`).
        """
        counts = self.counters.lookup(tf.range(len(COUNTERS), dtype=tf.int64)).numpy()
        held = int(self.size())
        entries = int(self.index.size()) + int(self.free.size())
        return {
            **dict(zip(COUNTERS, counts.tolist(), strict=True)),
            "ids_held": held,
            "index_bytes": entries * ENTRY_BYTES + held * INFO_ENTRY_BYTES + self.sketch_bytes(),
        }

    def sketch_bytes(self) -> int:
        """The bytes of the count-min sketch: its cells (0 without one)."""
        return 0 if self.sketch is None else self.sketch_depth * self.sketch_width * 4

    # Contents, whatever the slots and capacity.

    def contents(self) -> dict[str, np.ndarray]:
        """What the table holds, read to the host.

        `keys` (the ids holding a row), their `slots`, `stamps`, `admitted`
        (the step each was admitted at), `last_seen` steps and `counts` (decayed
        to the last-seen step, in 1 / `COUNT_ONE` lookups); `waiting` (ids
        counted, not admitted) and `waiting_values` (their count and last-seen
        step, as the index holds them); `counters` (by `COUNTERS` position).
        """
        keys, values = (tensor.numpy() for tensor in self.index.export())
        held = values >= 0
        slots = values[held]
        info = self._info(tf.constant(slots, tf.int64)).numpy()
        names, counts = (tensor.numpy() for tensor in self.counters.export())
        counters = np.zeros(len(COUNTERS), np.int64)
        counters[names] = counts
        return {
            "keys": keys[held],
            "slots": slots,
            "stamps": info[:, 0],
            "admitted": info[:, 0] // self.capacity,
            "last_seen": info[:, 1] & (2**STEP_BITS - 1),
            "counts": info[:, 1] >> STEP_BITS,
            "waiting": keys[~held],
            "waiting_values": values[~held],
            "sketch": self._sketch_rows().numpy(),
            "counters": counters,
        }

    def _sketch_rows(self) -> tf.Tensor:
        """The sketch's cells `[depth, width]` (int32; `[0, width]` without a sketch)."""
        if self.sketch is None:
            return tf.zeros([0, self.sketch_width], tf.int32)
        rows = self.sketch.lookup(tf.range(self.sketch_depth, dtype=tf.int64))
        return tf.reshape(rows, [self.sketch_depth, self.sketch_width])

    def load(
        self,
        keys: np.ndarray,
        admitted: np.ndarray,
        last_seen: np.ndarray,
        waiting: np.ndarray,
        waiting_values: np.ndarray,
        counters: np.ndarray,
        evicted: int = 0,
        counts: np.ndarray | None = None,
        sketch: np.ndarray | None = None,
    ) -> np.ndarray:
        """Replaces what the table holds; `keys` get slots 0, 1, ...; returns their stamps.

        The arguments are those of `contents()` (at most `capacity` keys), and
        `evicted`: ids left out for want of room, added to the counter; `counts`
        (None: zeros, as a checkpoint written before counts were kept); the
        `sketch`'s cells (None or empty: zeros). The
        counters of the slots in use are set for the new slots.
        """
        for table in (self.index, self.slot_info, self.free, self.counters):
            table.remove(table.export()[0])
        if self.sketch is not None:
            cells = np.zeros([self.sketch_depth, self.sketch_width], np.int32)
            if sketch is not None and np.size(sketch):
                cells = np.asarray(sketch, np.int32)
            self.sketch.insert(np.arange(self.sketch_depth, dtype=np.int64), cells)
        slots = np.arange(len(keys), dtype=np.int64)
        stamps = admitted * self.capacity + slots
        self.index.insert(tf.constant(keys, tf.int64), slots)
        self.index.insert(tf.constant(waiting, tf.int64), tf.constant(waiting_values, tf.int64))
        counts = np.zeros_like(keys) if counts is None else np.asarray(counts, np.int64)
        seen = np.asarray(last_seen, np.int64) | (counts << STEP_BITS)
        info = np.stack([stamps, seen, keys], 1).reshape([-1, 3]).astype(np.int64)
        self.slot_info.insert(slots, info)
        counters = np.array(counters, np.int64)
        counters[_C["fresh"]], counters[_C["free"]] = len(keys), 0
        counters[_C["evicted"]] += evicted
        self.counters.insert(np.arange(len(COUNTERS), dtype=np.int64), counters)
        return stamps

    # Lookups.

    def changed_slots(self, since: int) -> tf.Tensor:
        """The slots whose rows may have changed at step `since` or later (int64, sorted).

        A row changes only where a training lookup found its id, which marks
        the slot seen at that step (an admission or a reused slot too): the
        slots held and last seen at `since` or later. And the free slots (freed
        by the TTL sweep, perhaps written before): a release leaves no step.
        """
        slots, info = self._export()
        seen = tf.boolean_mask(slots, _last_seen(info) >= since)
        free = tf.reshape(self.free.lookup(tf.range(self.counter("free"))), [-1])
        return tf.sort(tf.concat([seen, free], 0))

    def find(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Slots and stamps of int64 `keys` (1-D); changes nothing. The slot is -1 where none."""
        slots = tf.reshape(self.index.lookup(keys), [-1])
        slots = tf.where(slots >= 0, slots, -1)
        return slots, self.stamps(slots)

    def stamps(self, slots: tf.Tensor) -> tf.Tensor:
        """The stamp of each slot's current id: `capacity * admission step + slot` (-1: free)."""
        return self._info(slots)[:, 0]

    def keys_of(self, slots: tf.Tensor) -> tf.Tensor:
        """The id each slot holds."""
        return self._info(slots)[:, 2]

    def _info(self, slots: tf.Tensor) -> tf.Tensor:
        """The (stamp, last-seen step, id) of each of `slots`; `_NO_SLOT` where free."""
        return tf.reshape(self.slot_info.lookup(slots), [-1, 3])

    def admit(
        self, keys: tf.Tensor, step: tf.Tensor | None = None, once: bool = False
    ) -> tf.Tensor:
        """Counts int64 `keys` (1-D, a step's), admits those seen `min_count` times.

        Every key's last-seen step becomes the current step: `step`, as `now()`
        gave it (read here if None), or without a clock the count of calls,
        read inside the lock. Ids admitted now are found at once (`find` after
        this). Then, if due, the TTL sweep. With `once` (the replicas of a
        step, each admitting the same gathered batch), a batch already admitted
        at this step changes nothing: whichever replica comes first admits it,
        and every replica's `find` that follows its own call sees the admission.
        """
        # The clock is read outside the lock: the parts of a split table share it,
        # and a lock claims every resource read inside it for itself alone.
        if self._clock is None:
            step = None
        elif step is None:
            step = self.now()
        if not once or step is None:
            return self._lock.execute(lambda: self._admit(keys, step))
        mark = tf.bitcast(tf.fingerprint(keys[None, :]), tf.int64)[0]
        return self._lock.execute(lambda: self._admit_once(keys, step, mark))

    def _admit_once(self, keys: tf.Tensor, step: tf.Tensor, mark: tf.Tensor) -> tf.Tensor:
        """`_admit` unless the batch of fingerprint `mark` was admitted at `step`."""
        batches = self._batches[0]
        done = tf.equal(tf.reshape(batches.lookup(mark[None]), []), step)

        def admit():
            marked, steps = batches.export()
            old = tf.boolean_mask(marked, tf.reshape(steps, [-1]) < step)
            with tf.control_dependencies([batches.remove(old)]):
                noted = batches.insert(mark[None], step[None])
            with tf.control_dependencies([noted]):
                return self._admit(keys, step)

        return tf.cond(done, lambda: tf.constant(False), admit)

    def _admit(self, keys: tf.Tensor, clock: tf.Tensor | None) -> tf.Tensor:
        step = self.now() if clock is None else clock
        unique, position = tf.unique(keys)
        seen = tf.math.unsorted_segment_sum(
            tf.ones_like(position, tf.int64), position, tf.size(unique)
        )
        value = tf.reshape(self.index.lookup(unique), [-1])
        held = value >= 0
        held_slots = tf.boolean_mask(value, held)
        held_info = self._info(held_slots)
        held_seen = tf.boolean_mask(seen, held)
        touched = self._touch(
            held_slots,
            held_info[:, 0],
            tf.boolean_mask(unique, held),
            step,
            self._decayed(held_info, step) + held_seen * COUNT_ONE,
        )
        if self.sketch is None:
            counts = tf.where(held, tf.zeros_like(value), -value - 1) % COUNT_LIMIT + seen
        else:
            cells, columns = self._sketch_rows(), self._columns(unique)
            counts = tf.where(held, tf.zeros_like(value), self._estimate(cells, columns) + seen)
        counts = tf.minimum(counts, COUNT_LIMIT - 1)
        with tf.control_dependencies([touched]):
            wanted = tf.where(~held & (counts >= self.min_count))[:, 0]
            # The most counted first (stable: then in the order of the batch).
            wanted = tf.gather(wanted, tf.argsort(-tf.gather(counts, wanted), stable=True))
            new_slots = self._allocate(tf.gather(counts, wanted), step)
        granted = wanted[: tf.size(new_slots)]
        new_keys = tf.gather(unique, granted)
        new_stamps = step * self.capacity + new_slots
        admitted = tf.scatter_nd(
            granted[:, None], tf.ones_like(granted, tf.bool), tf.shape(held, out_type=tf.int64)
        )
        # Ids left waiting keep their count, unless one lookup admits (it says nothing then):
        # refused or not, a table admitting at the first lookup grows no entry per id.
        waiting = ~held & ~admitted & (self.min_count > 1)
        if self.sketch is not None:
            waiting_counts = self._counted(cells, columns, waiting, counts, seen)
        else:
            waiting_counts = self.index.insert(  # the count, and the step it was last seen at
                tf.boolean_mask(unique, waiting),
                -1 - (tf.boolean_mask(counts, waiting) + step * COUNT_LIMIT),
            )
        # What the step's lookups read: a row where the id holds one now, else the default.
        read_rows = tf.reduce_sum(tf.boolean_mask(seen, held | admitted))
        updates = [
            self.index.insert(new_keys, new_slots),
            self._touch(
                new_slots, new_stamps, new_keys, step, tf.gather(counts, granted) * COUNT_ONE
            ),
            self._add(
                admitted=tf.size(new_slots),
                refused=tf.size(wanted) - tf.size(new_slots),
                lookups=tf.size(keys),
                defaults=tf.size(keys, out_type=tf.int64) - read_rows,
            ),
            waiting_counts,
        ]
        if self._clock is None:
            updates.append(self._set("calls", step + 1))
        with tf.control_dependencies(updates):
            if self.ttl_steps:  # after the touch: an id seen now is never swept now
                return self._maybe_sweep(step)
            return tf.constant(True)

    def _touch(
        self,
        slots: tf.Tensor,
        stamps: tf.Tensor,
        keys: tf.Tensor,
        step: tf.Tensor,
        counts: tf.Tensor,
    ):
        """Marks `slots` (holding `stamps` of `keys`) seen at `step`, with `counts` then."""
        packed = step + tf.bitwise.left_shift(tf.minimum(counts, COUNT_MAX), STEP_BITS)
        seen = tf.stack([stamps, packed, keys], 1)
        return self.slot_info.insert(slots, seen)

    # The count-min sketch of the ids not admitted yet.

    def _columns(self, keys: tf.Tensor) -> tf.Tensor:
        """The cell of each of `keys` in each row of the sketch, `[depth, n]` (int64)."""
        rows = tf.bitcast(tf.range(1, self.sketch_depth + 1, dtype=tf.int64), tf.uint64)
        salts = _splitmix64(rows * _u64(_GOLDEN))
        mixed = _splitmix64(tf.bitcast(keys, tf.uint64)[None, :] ^ salts[:, None])
        return tf.cast(mixed % _u64(self.sketch_width), tf.int64)

    def _estimate(self, cells: tf.Tensor, columns: tf.Tensor) -> tf.Tensor:
        """The counts of the keys of `columns`: their smallest cell (an overestimate), int64."""
        rows = tf.range(self.sketch_depth, dtype=tf.int64)[:, None] + tf.zeros_like(columns)
        found = tf.gather_nd(cells, tf.stack([rows, columns], -1))
        return tf.cast(tf.reduce_min(found, 0), tf.int64)

    def _counted(self, cells, columns, waiting, counts, seen) -> tf.Operation:
        """Raises the cells of the `waiting` keys to their `counts` (a conservative update).

        Then, once the sketch has taken `sketch_width` lookups since it was last
        halved, halves every cell, so that counts age and the overestimate stays
        within the bound of docs/tables.md.
        """
        columns = tf.boolean_mask(columns, waiting, axis=1)
        rows = tf.range(self.sketch_depth, dtype=tf.int64)[:, None] + tf.zeros_like(columns)
        cells = tf.tensor_scatter_nd_max(
            cells,
            tf.reshape(tf.stack([rows, columns], -1), [-1, 2]),
            tf.reshape(
                tf.cast(tf.boolean_mask(counts, waiting)[None, :] + rows * 0, tf.int32), [-1]
            ),
        )
        taken = self.counter("sketched") + tf.reduce_sum(tf.boolean_mask(seen, waiting))
        full = taken >= self.sketch_width
        cells = tf.where(full, tf.bitwise.right_shift(cells, 1), cells)
        keys = tf.range(self.sketch_depth, dtype=tf.int64)
        return tf.group(
            self.sketch.insert(keys, cells),
            self._set("sketched", tf.where(full, tf.zeros_like(taken), taken)),
        )

    def _decayed(self, info: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """The counts of slots of `info` decayed from their last-seen step to `step` (int64).

        Halved every `half_life` steps unseen (exactly: by 2**(-age / half_life),
        rounded down), in float64 on the host: the same on every device and run.
        """
        age = tf.cast(step - _last_seen(info), tf.float64)
        counts = tf.cast(_count(info), tf.float64)
        decay = tf.pow(tf.constant(2.0, tf.float64), -age / self.half_life)
        return tf.cast(tf.floor(counts * decay), tf.int64)

    # Allocation and eviction.

    def _allocate(self, wanted: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Free slots for the newcomers of counts `wanted` (most counted first, in lookups).

        Freed slots, then never used ones, then evicted ones: under "lru" the
        ids seen longest ago; under "lfu" an id of a lower decayed count than
        the newcomer's, for as many newcomers as beat one (`_evict`). As many
        slots as newcomers get one, given in the order of `wanted`.
        """
        number = tf.size(wanted, out_type=tf.int64)
        free = self.counter("free")
        reused = tf.minimum(number, free)
        popped = tf.reshape(self.free.lookup(tf.range(free - reused, free)), [-1])
        fresh = self.counter("fresh")
        more = tf.minimum(number - reused, self.capacity - fresh)
        updates = [self._set("free", free - reused), self._set("fresh", fresh + more)]
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
            slots, info = self._export()
            older = _last_seen(info) < step
            slots, info = tf.boolean_mask(slots, older), tf.boolean_mask(info, older)
            order = tf.argsort(info[:, 2], stable=True)
            order = tf.gather(order, tf.argsort(tf.gather(_last_seen(info), order), stable=True))
            if self.eviction == "lfu":
                counts = tf.gather(self._decayed(info, step), order)
                lowest = tf.argsort(counts, stable=True)[:count]
                order = tf.gather(order, lowest)
                # Newcomers highest first against victims lowest first: those that win are a prefix.
                beaten = newcomers[: tf.size(order)] * COUNT_ONE > tf.gather(counts, lowest)
                order = order[: tf.reduce_sum(tf.math.cumprod(tf.cast(beaten, tf.int64)))]
            chosen = tf.gather(slots, order[:count])
            with tf.control_dependencies([self._release(chosen, "evicted")]):
                return tf.identity(chosen)

        return tf.cond(count > 0, evict, lambda: tf.zeros([0], tf.int64))

    def _export(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Every held slot and its (stamp, last-seen step)."""
        slots, info = self.slot_info.export()
        return tf.reshape(slots, [-1]), tf.reshape(info, [-1, 3])

    def _release(self, slots: tf.Tensor, counter: str):
        """Forgets the ids of `slots` (they are counted from zero if they come back)."""
        return tf.group(
            self.index.remove(self.keys_of(slots)),
            self.slot_info.remove(slots),
            self._add(**{counter: tf.size(slots)}),
        )

    def _maybe_sweep(self, step: tf.Tensor) -> tf.Tensor:
        """Every `sweep_every` steps (once a step), frees the rows of ids older than the TTL."""
        due = tf.equal(step % self.sweep_every, 0) & tf.not_equal(self.counter("swept"), step + 1)

        def sweep():
            keys, values = self.index.export()
            keys, values = tf.reshape(keys, [-1]), tf.reshape(values, [-1])
            counted_until = (-values - 1) // COUNT_LIMIT
            forgotten = (values < 0) & (counted_until <= step - self.ttl_steps)
            slots, info = self._export()
            expired = tf.boolean_mask(slots, _last_seen(info) <= step - self.ttl_steps)
            free = self.counter("free")
            count = tf.size(expired, out_type=tf.int64)
            with tf.control_dependencies([self._release(expired, "evicted")]):
                done = tf.group(
                    self.index.remove(tf.boolean_mask(keys, forgotten)),
                    self.free.insert(tf.range(free, free + count), expired),
                    self._set("free", free + count),
                    self._set("swept", step + 1),
                )
            with tf.control_dependencies([done]):
                return tf.constant(True)

        return tf.cond(due, sweep, lambda: tf.constant(False))


def _last_seen(info: tf.Tensor) -> tf.Tensor:
    """The last-seen steps of slots' (stamp, seen, id) `info` rows (their counts left out)."""
    return tf.bitwise.bitwise_and(info[:, 1], 2**STEP_BITS - 1)


def _count(info: tf.Tensor) -> tf.Tensor:
    """The counts (at their last-seen step, in 1 / `COUNT_ONE` lookups) of slots' `info`."""
    return tf.bitwise.right_shift(info[:, 1], STEP_BITS)


def merged_counters(counters: list[np.ndarray]) -> np.ndarray:
    """The counters of a table's parts as one table's: totals, and the latest step.

    The slots' own (`fresh`, `free`) are 0: they belong to a split, not to the content.
    """
    merged = np.max(counters, axis=0)
    merged[[_C["fresh"], _C["free"]]] = 0
    for name in _TOTALS:
        merged[_C[name]] = sum(c[_C[name]] for c in counters)
    return merged


def split_counters(counters: np.ndarray, parts: int) -> list[np.ndarray]:
    """`counters` of one table for each of `parts` parts: the totals kept by the first."""
    split = [np.array(counters, np.int64) for _ in range(parts)]
    for part in split[1:]:
        part[[_C[name] for name in _TOTALS]] = 0
    return split


_ROWS: dict[int, weakref.ref] = {}


def register_rows(rows, owner) -> None:
    """Records that the variable `rows` holds the rows of `owner` (a `DynamicEmbedding`)."""
    _ROWS[id(rows)] = weakref.ref(owner)


def owner_of(rows):
    """The `DynamicEmbedding` whose rows `rows` holds, or None."""
    ref = _ROWS.get(id(rows))
    return ref() if ref is not None else None
