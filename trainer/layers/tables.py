"""Dynamic embedding tables: a row per admitted id, created on admission, freed on eviction.

A table maps raw ids (int64 over the whole 64-bit range; strings by their
64-bit fingerprint, `key64`) to rows of a `[capacity, dim]` variable. It has
two halves:

* The *index*, on the host and shared by every replica of the process: hash
  tables (`tf.lookup.experimental.MutableHashTable`) from id to its stamp
  (as `capacity + stamp`, `held_code`: the stamp says the slot, so a lookup
  finds both at once; plus `WRITTEN` once the optimizer wrote the id's row,
  `mark_written`) and from slot to (stamp, last-seen step and count, id),
  a stack of freed slots and a few counters. (An id -> slot entry, as
  checkpoints written before hold it, is still read: `find`.) The counts of
  ids not admitted yet (`min_count` > 1)
  live in a count-min sketch of fixed size (`sketch_depth` rows of
  `sketch_width` int32 cells), so the tail that is never admitted costs no
  memory per id. (A value below 0 in the id -> slot table, the count of an id
  not admitted yet as checkpoints written before the sketch hold it, is still
  read: `-1 - (count + last-seen step * COUNT_LIMIT)`.) Which ids training
  looked up lately lives in a Bloom filter of fixed size (`seen_bits`,
  `trainer.layers.table_seen`): outside training, an id without a row that
  it has not seen reads zeros.
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
initial value, then applies the gradient, and marks the ids of the rows it
reset written in the index (`mark_written`, under the lock): a lookup outside
training reads a marked id's row as it is, with no row stamp to compare.

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

The code, to read in steps: `DynamicTable` here owns the index (every hash
table, the lock and the clock; checkpoints hold them under its attribute
names), takes the lock for every change (`admit`) and reads it: counters,
`figures()`, `contents()` and `load()`, `find()`. It is composed of parts
held as members, each with a small interface of its own and reading nothing
of the table: `store` (`IndexStore`, `trainer.layers.table_store`: the
index's hash tables and the operations its parts share), `admission`
(`AdmissionPolicy`, `trainer.layers.table_policy`: `admit`), `evictions`
(`EvictionPolicy`: slots for newcomers, LFU and LRU, the TTL sweep),
`count_sketch` (`CountMinSketch`) and `seen_filter` (`SeenFilter`,
`trainer.layers.table_seen`), the last two over hash tables that are the
table's attributes (`sketch`, `seen`), as checkpoints hold them. The hash
and the packing of counts and steps they share are
`trainer.layers.table_encoding`'s.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from strategies import tf_patches

# COUNT_LIMIT, COUNT_MAX and COUNT_ONE are re-exported (callers read `tables.COUNT_ONE`).
from trainer.layers.table_encoding import (  # noqa: F401
    COUNT_LIMIT,
    COUNT_MAX,
    COUNT_ONE,
    GOLDEN,
    STEP_BITS,
    last_seen,
    splitmix64,
    u64,
    u64_as_traced,
)
from trainer.layers.table_policy import AdmissionPolicy, CountMinSketch, EvictionPolicy
from trainer.layers.table_seen import SEEN_BITS, SeenFilter  # noqa: F401 (SEEN_BITS)

# COUNTERS and WRITTEN are re-exported (callers read `tables.COUNTERS`, `tables.WRITTEN`).
from trainer.layers.table_store import COUNTERS, WRITTEN, IndexStore, hash_table
from trainer.layers.table_store import POSITION as _C

DEFAULT_CAPACITY = 2**18  # rows per table: 32 MB of float32 rows at width 32
ROW_SCALE = 0.05  # initial rows are uniform in [-ROW_SCALE, ROW_SCALE), as Keras's "uniform"
EVICTIONS = ("lfu", "lru", None)
DEFAULT_EVICTION = "lfu"  # measured better than "lru" on a drifting long tail (docs/tables.md)
HALF_LIFE = 500  # steps over which an id's count halves when it is not seen ("lfu")
# Counts of ids not admitted yet (`min_count` > 1): a count-min sketch of SKETCH_DEPTH rows of
# SKETCH_WIDTH int32 cells, halved whenever SKETCH_WIDTH lookups were added since the last.
SKETCH_WIDTH = 2**13
SKETCH_DEPTH = 2
# The fallback rows an id without a row of its own reads (their mean, `FALLBACK_COMBINER`): two
# measured better than one and three on a drifting long tail at equal bytes (docs/tables.md).
FALLBACK_HASHES = 2
# How an id's fallback rows make its vector: their mean (each id's vector then trains at one
# row's pace, measured better than the sum at 50% and 100% of the ids, docs/tables.md) or sum.
FALLBACK_COMBINERS = ("mean", "sum")
FALLBACK_COMBINER = "mean"
SEED_SALT = 0xD1B54A32D192ED03  # odd: a table's seed moves its fallback rows' salts (`buckets_of`)
_TOTALS = ("admitted", "evicted", "refused", "lookups", "defaults")  # add up over a table's parts

# Memory of one entry of the index's hash tables (TF's `MutableHashTable` is a
# `std::unordered_map`: a node, and a bucket pointer), measured on TF 2.21,
# Linux x86-64, as the growth of the resident memory over a million inserts.
ENTRY_BYTES = 42  # int64 -> int64
INFO_ENTRY_BYTES = 78  # int64 -> three int64 (a slot's stamp, last-seen step and id)


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
    base = splitmix64(u64(seed % 2**64) ^ splitmix64(ids * u64(GOLDEN)))
    bits = splitmix64(base + tf.bitcast(columns, tf.uint64)[None, :] * u64(GOLDEN))
    top = tf.cast(tf.bitwise.right_shift(bits, u64(40)), tf.float32)  # 24 bits: exact
    return (top / 2.0**24 * 2.0 - 1.0) * ROW_SCALE


def part_of(keys: tf.Tensor, parts: int) -> tf.Tensor:
    """Which of `parts` parts of a split table holds each of int64 `keys` (int32).

    By a hash of the id, so that consecutive ids spread evenly.
    """
    mixed = splitmix64(tf.bitcast(keys, tf.uint64))
    return tf.cast(mixed % u64(parts), tf.int32)


def buckets_of(keys: tf.Tensor, buckets: int, hashes: int, seed: int = 0) -> tf.Tensor:
    """Which `hashes` of `buckets` hashed rows each of int64 `keys` reads without a row of its own.

    `[n, hashes]` int64: one hash of the id per column, each salted apart from
    the others and from `part_of`'s (so that a part's ids spread over every
    bucket). Two ids share one bucket about `hashes` times more often than
    with one hash, and all of them far more rarely (with two hashes, about
    `buckets / 2` times). `seed` keys which ids share a bucket (0: the
    salts alone, as tables written before the seed keyed them).
    """
    offset = seed * SEED_SALT
    salts = u64_as_traced([(GOLDEN * (2 * h + 1) + offset) % 2**64 for h in range(hashes)])
    mixed = splitmix64(tf.bitcast(keys, tf.uint64)[:, None] + salts[None, :])
    return tf.cast(mixed % u64(buckets), tf.int64)


class DynamicTable(tf.Module):
    """The index of one dynamic table: int64 ids -> row slots, admission and eviction.

    This class owns the index's state (made in `__init__`: the hash tables,
    the sketch, the counters, the lock, the clock), its one way in for
    changes (`admit`, inside the lock) and its reads: the step, the counters
    and sizes (`figures`), the content whatever the slots (`contents`,
    `load`) and the lookups (`find`, `codes`, `stamps`, `changed_slots`),
    and the marks of written rows (`mark_written`). It is made of parts,
    members each with a small interface: `store` (the index's hash tables
    and their shared operations, an `IndexStore`), `admission` (an
    `AdmissionPolicy`: how ids get a row), `evictions` (an
    `EvictionPolicy`: how they lose it), `count_sketch` (the counts of ids
    not admitted yet, a `CountMinSketch`; None with `min_count` 1) and
    `seen_filter` (a `SeenFilter`; None with `seen_bits` 0).

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
      seen_bits: the bits of each generation of the seen-filter
        (`trainer.layers.table_seen`; 0: none, every id counts as seen).
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
        seen_bits: int = 0,
    ):
        super().__init__(name=name)
        self.capacity = int(capacity)
        self.min_count = int(min_count)
        self.ttl_steps = int(ttl_steps)
        self.eviction = eviction
        self.half_life = int(half_life)
        self.sketch_width, self.sketch_depth = int(sketch_width), int(sketch_depth)
        self.seen_bits = int(seen_bits)
        with tf.device("/cpu:0"):
            self.store = IndexStore(self.capacity)
            # The store's hash tables are the table's attributes: checkpoints hold them so.
            store = self.store
            self.index, self.slot_info, self.free = store.index, store.slot_info, store.free
            self.counters = store.counters
            # The global batches admitted at each step (fingerprint -> step), so that every
            # replica may admit a step's batch and only the first changes the index. It
            # matters within a step only, yet checkpoints hold it (`_batches/0`: the list is
            # tracked); kept so, for the checkpoints' keys.
            self._batches = [hash_table(-1)]
            # The parts' hash tables are the table's attributes: checkpoints hold them so.
            self.sketch = self.count_sketch = None
            if self.min_count > 1:  # a row of cells per key 0 .. depth - 1
                self.sketch = CountMinSketch.cells_table(self.sketch_width)
                self.count_sketch = CountMinSketch(
                    self.sketch, self.sketch_width, self.sketch_depth
                )
            self.seen = self.seen_filter = None
            if self.seen_bits:  # a row of words per generation: 0 the current, 1 the one before
                self.seen = SeenFilter.words_table(self.seen_bits)
                self.seen_filter = SeenFilter(self.seen, self.seen_bits)
        self.evictions = EvictionPolicy(self.store, eviction, self.half_life, self.ttl_steps)
        self.admission = AdmissionPolicy(
            self.store, self.evictions, self.min_count, self.count_sketch, self.seen_filter
        )
        # A shared name of its own: the CriticalSections a process creates eagerly
        # without one are all one mutex (TF 2.21), and two tables admitting in one
        # step then wait on each other forever.
        self._lock = tf.CriticalSection(
            name=f"{name}_lock", shared_name=f"{name}_lock_{uuid.uuid4().hex}"
        )
        self._clock = None

    def lock_device(self) -> str:
        """The device of the lock that every change to the index takes."""
        return tf_patches.lock_handle(self._lock).device

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
        step's admission exchange control messages with that member.
        """
        if self._clock is not None:
            with tf.device(self.lock_device()):
                return tf.identity(tf.cast(tf.convert_to_tensor(self._clock), tf.int64))
        return self.counter("calls")

    # Changes: admission, under the lock.

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
        The work is `admission`'s (`AdmissionPolicy.admit`) and `evictions`'s.
        """
        # The clock is read outside the lock: the parts of a split table share it,
        # and a lock claims every resource read inside it for itself alone.
        if self._clock is None:
            step = None
        elif step is None:
            step = self.now()
        if tf.executing_eagerly():
            return self._locked_admit(keys, step, once)
        # Traced as a function of its own, whose keys are copied here first. TF's automatic
        # control dependencies chain, in program order, every stateful op that takes no
        # resource, and the lock's release is one: the admissions of a table's parts (each
        # on its ps member) would each wait for the one before. And the lock waits for
        # every op whose output its work reads: for the op that made `keys`, on a worker,
        # unless they are copied on this device. Each is a message every step.
        admit = tf.function(self._locked_admit, autograph=False)
        return admit(tf.identity(keys), step, once)

    def _locked_admit(self, keys: tf.Tensor, step: tf.Tensor | None, once: bool) -> tf.Tensor:
        """`admit`'s work inside the table's lock."""
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
        """`admit`'s work, inside the lock, at step `clock` (None: the count of calls).

        Returns whether the TTL sweep ran (True without a TTL).
        """
        step = self.now() if clock is None else clock
        updates = [self.admission.admit(keys, step)]
        if self._clock is None:
            updates.append(self.store.set("calls", step + 1))
        with tf.control_dependencies(updates):
            if self.ttl_steps:  # after the touch: an id seen now is never swept now
                return self.evictions.maybe_sweep(step)
            return tf.constant(True)

    # Counters.

    def counter(self, name: str) -> tf.Tensor:
        """The counter `name` (one of `COUNTERS`)."""
        return self.store.counter(name)

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
            "index_bytes": entries * ENTRY_BYTES
            + held * INFO_ENTRY_BYTES
            + (self.count_sketch.bytes() if self.count_sketch else 0)
            + (self.seen_filter.bytes() if self.seen_filter else 0),
        }

    # Contents, whatever the slots and capacity.

    def contents(self) -> dict[str, np.ndarray]:
        """What the table holds, read to the host.

        `keys` (the ids holding a row), their `slots`, `stamps`, `admitted`
        (the step each was admitted at), `last_seen` steps and `counts` (decayed
        to the last-seen step, in 1 / `COUNT_ONE` lookups); `waiting` (ids
        counted, not admitted) and `waiting_values` (their count and last-seen
        step, as the index holds them); `counters` (by `COUNTERS` position);
        `seen`, the seen-filter's words (`[0, 0]` without one).
        """
        keys, values = (tensor.numpy() for tensor in self.index.export())
        held = values >= 0
        slots = (values[held] & (WRITTEN - 1)) % self.capacity
        info = self.store.info(tf.constant(slots, tf.int64)).numpy()
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
            "sketch": (
                self.count_sketch.rows().numpy()
                if self.count_sketch
                else np.zeros([0, self.sketch_width], np.int32)
            ),
            "seen": (
                self.seen_filter.generations().numpy()
                if self.seen_filter
                else np.zeros([0, 0], np.int64)
            ),
            "counters": counters,
        }

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
        seen: np.ndarray | None = None,
    ) -> np.ndarray:
        """Replaces what the table holds; `keys` get slots 0, 1, ...; returns their stamps.

        The arguments are those of `contents()` (at most `capacity` keys), and
        `evicted`: ids left out for want of room, added to the counter; `counts`
        (None: zeros, as a checkpoint written before counts were kept); the
        `sketch`'s cells (None or empty: zeros); the `seen`-filter's words (None,
        or of another size: empty). The
        counters of the slots in use are set for the new slots.
        """
        for table in (self.index, self.slot_info, self.free, self.counters):
            table.remove(table.export()[0])
        if self.count_sketch:
            self.count_sketch.load(sketch)
        if self.seen_filter:
            self.seen_filter.load(seen)
        slots = np.arange(len(keys), dtype=np.int64)
        stamps = admitted * self.capacity + slots
        self.index.insert(tf.constant(keys, tf.int64), self.held_code(stamps))
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
        slots, info = self.store.held()
        seen = tf.boolean_mask(slots, last_seen(info) >= since)
        free = tf.reshape(self.free.lookup(tf.range(self.counter("free"))), [-1])
        return tf.sort(tf.concat([seen, free], 0))

    def find(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Slots and stamps of int64 `keys` (1-D); changes nothing. Both are -1 where none.

        One lookup in the index (`codes`), which holds a held id's stamp (`decoded`).
        """
        return self.decoded(self.codes(keys))

    def codes(self, keys: tf.Tensor) -> tf.Tensor:
        """What the index holds for each of int64 `keys` (1-D): `held_code` where held, else < 0."""
        return tf.reshape(self.index.lookup(keys), [-1])

    def decoded(self, codes: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The slots and stamps the index's `codes` say (`held_code`'s); both -1 where none.

        An entry written before the index held stamps (a checkpoint's: its slot
        alone, below the capacity) has its stamp read from `slot_info`, only in
        a batch that holds one.
        """
        held = codes >= 0
        plain = tf.bitwise.bitwise_and(codes, WRITTEN - 1)  # without the mark
        slots = tf.where(held, plain % self.capacity, -1)
        stamps = tf.where(held, plain - self.capacity, -1)
        older = held & (plain < self.capacity)
        return slots, tf.cond(
            tf.reduce_any(older),
            lambda: tf.where(older, self.stamps(tf.where(older, slots, -1)), stamps),
            lambda: stamps,
        )

    def held_code(self, stamps: tf.Tensor, written: tf.Tensor | None = None) -> tf.Tensor:
        """What the index holds for an id of stamp `stamps` (`IndexStore.held_code`)."""
        return self.store.held_code(stamps, written)

    @staticmethod
    def written(codes: tf.Tensor) -> tf.Tensor:
        """Whether each of the index's `codes` says a held id whose row is written for it.

        False says nothing: a row written before the index marked rows (a
        checkpoint's), or not written.
        """
        return codes >= WRITTEN

    def written_slots(self, codes: tf.Tensor) -> tf.Tensor:
        """The slots of `codes` that are `written` (any value elsewhere)."""
        return (codes - WRITTEN) % self.capacity

    def mark_written(
        self, slots: tf.Tensor, row_stamps: Callable[[tf.Tensor], tf.Tensor]
    ) -> tf.Tensor:
        """Marks in the index whether the rows of `slots` are written for the ids holding them.

        Inside the lock: where the row's stamp (`row_stamps(slots)`, read there)
        is its slot's, the id's code gains `WRITTEN`; where it is not, loses it
        (an asynchronous worker's reset of a row for an id that has left the
        slot since); a free slot is left alone. The optimizer's reset of new
        rows calls it after writing them (`trainer.loop.optim`), so a marked
        id's row stamp needs no reading outside training. Nothing is done for
        no slots. Returns how many ids it marked or unmarked.
        """

        def work(slots: tf.Tensor) -> tf.Tensor:
            info = self.store.info(slots)
            held = info[:, 0] >= 0
            stamps, keys = tf.boolean_mask(info[:, 0], held), tf.boolean_mask(info[:, 2], held)
            written = tf.equal(row_stamps(tf.boolean_mask(slots, held)), stamps)
            with tf.control_dependencies(
                [self.index.insert(keys, self.held_code(stamps, written))]
            ):
                return tf.size(keys)

        if tf.executing_eagerly():
            return self._lock.execute(lambda: work(slots))
        # A function of its own, its slots copied here first, as `admit`'s (which says why).
        locked = tf.function(lambda s: self._lock.execute(lambda: work(s)), autograph=False)
        return tf.cond(tf.size(slots) > 0, lambda: locked(tf.identity(slots)), lambda: 0)

    def slots_of(self, codes: tf.Tensor) -> tf.Tensor:
        """The slot of each of the index's values `codes` (held or older), -1 where none."""
        return self.store.slots_of(codes)

    def stamps(self, slots: tf.Tensor) -> tf.Tensor:
        """The stamp of each slot's current id: `capacity * admission step + slot` (-1: free)."""
        return self.store.info(slots)[:, 0]

    def keys_of(self, slots: tf.Tensor) -> tf.Tensor:
        """The id each slot holds."""
        return self.store.keys_of(slots)

    def seen_ids(self, keys: tf.Tensor) -> tf.Tensor:
        """Whether training saw each of int64 `keys` (1-D) lately (`SeenFilter`; all without)."""
        if self.seen_filter is None:
            return tf.ones_like(keys, tf.bool)
        return self.seen_filter.seen_ids(keys)


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
