"""`DynamicEmbedding`: raw ids (int64 or strings) looked up in a table that grows.

The table (`trainer.layers.tables`) creates a row when an id is admitted and
frees it on eviction: no vocabulary size, no collisions. Under
`parameter_server` it is split by id into one part per ps member.

The layer here holds its settings (checked by `check_dynamic`), its
variables and its Keras and `Portable` interface; the rest is read in its
own module, beside this one:

* `dynamic_parts`: the table's parts, where each goes per strategy, the
  variables each creates, and what they report (`describe`, `figures`).
* `dynamic_lookup`: a call's steps, from ids to vectors: the training-time
  admission of the global batch and new ids reading their initial rows.
* `dynamic_content`: the logical content of a table (`export_logical`,
  `import_logical`), for a checkpoint written with another number of parts.
* `dynamic_types`: what those modules see of the layer and of a part (the
  protocols `TableLayer` and `Part`), so that none imports another for its types.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from strategies import sharding, tf_patches
from towerflow.errors import UserError
from trainer.layers import (
    dynamic_content,
    dynamic_lookup,
    dynamic_parts,
    table_frequencies,
    tables,
)
from trainer.layers.portable import Portable, Slots
from trainer.layers.table_training import TableOptimizer

COMBINERS = (None, "sum", "mean", "sqrtn")
KEY_DTYPES = {"int64": tf.int64, "string": tf.string}


def check_dynamic(
    key_dtype: str,
    combiner,
    min_count: int,
    ttl_steps: int,
    capacity: int,
    eviction,
    where: str = "`DynamicEmbedding`",
    fallback_rows: int = 0,
    sketch: tuple[int, int] = (tables.SKETCH_WIDTH, tables.SKETCH_DEPTH),
    fallback_hashes: int = tables.FALLBACK_HASHES,
    fallback_combiner: str = tables.FALLBACK_COMBINER,
    seen_bits: int = tables.SEEN_BITS,
) -> None:
    """Raises `UserError` naming the first bad argument of a dynamic table (`where`)."""
    rules = [
        (key_dtype in KEY_DTYPES, f"`key_dtype` '{key_dtype}' must be one of int64, string"),
        (combiner in COMBINERS, f"`combiner` '{combiner}' must be one of None, sum, mean, sqrtn"),
        (
            1 <= min_count < tables.COUNT_LIMIT,
            f"`min_count` ({min_count}) must be in [1, {tables.COUNT_LIMIT - 1}]; 1 admits "
            "every id at once",
        ),
        (ttl_steps >= 0, f"`ttl_steps` ({ttl_steps}) must be >= 0; 0 keeps ids until evicted"),
        (
            capacity >= 1,
            f"`capacity` ({capacity}) must be >= 1 row; e.g. {tables.DEFAULT_CAPACITY}",
        ),
        (
            eviction in tables.EVICTIONS,
            f"`eviction` '{eviction}' must be one of 'lfu', 'lru', None; "
            f"e.g. '{tables.DEFAULT_EVICTION}'",
        ),
        (
            fallback_rows >= 0,
            f"`fallback_rows` ({fallback_rows}) must be >= 0; 0 gives every id without a row "
            "one shared default row",
        ),
        (
            fallback_hashes >= 1,
            f"`fallback_hashes` ({fallback_hashes}) must be >= 1 fallback row read per id; "
            f"e.g. {tables.FALLBACK_HASHES}",
        ),
        (
            fallback_combiner in tables.FALLBACK_COMBINERS,
            f"`fallback_combiner` '{fallback_combiner}' must be one of mean, sum; e.g. "
            f"'{tables.FALLBACK_COMBINER}'",
        ),
        (
            sketch[0] >= 1,
            f"`sketch_width` ({sketch[0]}) must be >= 1 cell; e.g. {tables.SKETCH_WIDTH} "
            "(the count-min sketch of ids not admitted yet)",
        ),
        (
            sketch[1] >= 1,
            f"`sketch_depth` ({sketch[1]}) must be >= 1 row; e.g. {tables.SKETCH_DEPTH}",
        ),
        (
            seen_bits >= 0,
            f"`seen_bits` ({seen_bits}) must be >= 0; e.g. {tables.SEEN_BITS} (0: no "
            "seen-filter, every id without a row reads the default or fallback rows)",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise UserError(f"{where} {message}.")


@keras.saving.register_keras_serializable(package="towerflow")
class DynamicEmbedding(Portable, keras.layers.Layer):
    """An embedding of raw ids with a row per admitted id, called as `keras.layers.Embedding`.

    Ids are int64 over the whole 64-bit range (`key_dtype="int64"`; integer
    inputs of other widths are cast) or strings (`key_dtype="string"`), of any
    shape, or a `tf.RaggedTensor` of lists per example. No vocabulary size: a
    table (`trainer.layers.tables.DynamicTable`) gives each admitted id its own row,
    created with a value that depends only on (`seed`, id). Training lookups
    count ids and admit them (an id admitted at a step reads and trains its
    row at that step); eval and serving lookups change nothing, and an id
    without a row reads the default row (or its `fallback_rows` row). Under
    a synchronous strategy the replicas (and the workers of `multi_worker`)
    agree on the ids admitted each step, so every replica and worker holds
    the same table. Under `multi_worker`, feed every worker ids of one shape
    (ragged lists padded with `mask_id`; a ragged batch there is a one-line
    error saying so).
    Under `parameter_server` the table is split by id (`tables.part_of`) into
    one part per ps member, each part's index, lock and variables on its member
    (`capacity` split evenly); the workers hold no table (`describe()` says
    where each part is). A checkpoint restores into any number of parts
    (`Portable`; an id goes to its part by the same hash).

    Train it with an optimizer of `trainer.loop.optim` (Keras's classes, which
    reset the rows and slots of new ids); a Keras optimizer's own class is
    refused at its first update (`trainer.layers.table_training`). Its own
    optimizer and rate, if not the model's: `table_optimizer`.

        layer = DynamicEmbedding(16, key_dtype="string", combiner="mean", mask_id="")
        layer(tf.ragged.constant([["a", "b"], ["c"]]), training=True)  # [2, 16]

    Args:
      output_dim: the embedding width.
      key_dtype: "int64" or "string".
      combiner: None (a vector per id), or "sum", "mean", "sqrtn" over the last
        axis (the list of each example), leaving out `mask_id`.
      min_count: training lookups an id needs before it gets a row; until then
        it reads a shared trainable default row (initially zeros).
      ttl_steps: free the row of an id not seen for this many steps (0: never).
      capacity: the most rows held (the memory bound: `capacity + 1` rows of
        the variable and of each optimizer slot, the last one spare); default
        `trainer.layers.tables.DEFAULT_CAPACITY`.
      eviction: "lfu" (the default): a full table evicts the id of the lowest
        count decayed by age (`trainer.layers.tables.HALF_LIFE`), and only for
        a new id counted more often (else the new id is refused and reads the
        default or fallback row: a one-off id does not push out one that
        recurs); "lru": the least recently seen id, for any new id; None: it
        refuses new ids (they read the default row; `refused` counts them).
      fallback_rows: 0: every id without a row (not admitted yet, refused,
        evicted) reads one shared trainable default row; N > 0: it reads the
        mean of `fallback_hashes` rows of a trainable `[N, output_dim]` fallback
        table, rows `hash_k(id) % N` (a hashed embedding of several hashes, so
        that two ids rarely share all their rows), counted in `bytes_held`.
      fallback_hashes: the fallback rows an id reads (1: `hash(id) % N` alone,
        as a hashed embedding); default `trainer.layers.tables.FALLBACK_HASHES`.
      fallback_combiner: "mean" (the default: an id's vector trains at one
        row's pace) or "sum" (as layers saved before this option read them) of
        an id's fallback rows.
      sketch_width: with `min_count` > 1, the lookups of ids not admitted yet
        are counted in a count-min sketch of `sketch_depth` rows of
        `sketch_width` int32 cells (in `bytes_held`), no memory per id: a
        count is over by at most e/`sketch_width` x the lookups it took since
        it was last halved, with probability 1 - e**-`sketch_depth`.
      sketch_depth: the sketch's rows (see `sketch_width`).
      seen_bits: with fallback rows, outside training, an id without a row
        that the table has not seen in training lately reads zeros, not
        fallback rows that other ids trained. Which ids it saw is a Bloom
        filter of two generations of `seen_bits` bits
        (`trainer.layers.table_seen`; in `bytes_held`): it forgets ids unseen
        for one to two generations, and takes an unseen id for seen with
        probability at most about 5%. 0: no filter (every id without a row
        reads its fallback rows); default `trainer.layers.tables.SEEN_BITS`.
        Without fallback rows there is none: such ids read the default row,
        which they all train (as good as zeros for new ids, measured).
      mask_id: an id that means "no id" (padding): it reads zeros, is never
        admitted, and combiners leave it out.
      seed: keys the initial rows, and which ids share fallback rows (their
        hashes' salt: a resume or warm start keeps it, see `trainer.loop.warm_start`).
    """

    # The optimizer of the rows where it is not the model's (`TableConfig(optimizer=...)`).
    table_optimizer = TableOptimizer()

    def __init__(
        self,
        output_dim: int,
        key_dtype: str = "int64",
        combiner: str | None = None,
        min_count: int = 1,
        ttl_steps: int = 0,
        capacity: int = tables.DEFAULT_CAPACITY,
        eviction: str | None = tables.DEFAULT_EVICTION,
        mask_id=None,
        seed: int = 0,
        fallback_rows: int = 0,
        sketch_width: int = tables.SKETCH_WIDTH,
        sketch_depth: int = tables.SKETCH_DEPTH,
        fallback_hashes: int = tables.FALLBACK_HASHES,
        fallback_combiner: str = tables.FALLBACK_COMBINER,
        seen_bits: int = tables.SEEN_BITS,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_dynamic(
            key_dtype,
            combiner,
            min_count,
            ttl_steps,
            capacity,
            eviction,
            fallback_rows=fallback_rows,
            sketch=(sketch_width, sketch_depth),
            fallback_hashes=fallback_hashes,
            fallback_combiner=fallback_combiner,
            seen_bits=seen_bits,
        )
        self.seen_bits = int(seen_bits)
        self.fallback_rows = int(fallback_rows)
        self.fallback_hashes = int(fallback_hashes)
        self.fallback_combiner = fallback_combiner
        self.sketch_width, self.sketch_depth = int(sketch_width), int(sketch_depth)
        self.output_dim = int(output_dim)
        self.key_dtype = key_dtype
        self.combiner = combiner
        self.min_count = int(min_count)
        self.ttl_steps = int(ttl_steps)
        self.capacity = int(capacity)
        self.eviction = eviction
        self.mask_id = mask_id
        self.seed = int(seed)
        # One part per ps member under `parameter_server`, else one, here.
        self.parts = dynamic_parts.make_parts(self)
        self.table = self.parts[0].table

    def build(self, input_shape=None):
        for part in self.parts:
            part.build()
        self.rows, self.row_stamps = self.parts[0].rows, self.parts[0].row_stamps
        # Where ids without a row read: one logical variable, whatever the parts, beside
        # the first part's rows (whose lookups carry the default row: `vectors_by_part`).
        self.default_row = self.fallback = None
        with self.parts[0].placed():
            if self.fallback_rows:
                shape, name = (self.fallback_rows, self.output_dim), "fallback"
                self.fallback = self.add_weight(shape, "zeros", name=name, autocast=False)
            else:
                shape, name = (self.output_dim,), "default_row"
                self.default_row = self.add_weight(shape, "zeros", name=name, autocast=False)

    def defaults(self, keys: tf.Tensor, valid: tf.Tensor, default_row=None) -> tf.Tensor:
        """What each of `keys` reads without a row: the default row or its fallback row.

        Zeros where not `valid`. `default_row`: the default row's value as
        `vectors_by_part` read it with the first part's rows (None with fallback rows).

        A key's fallback value is the mean (or sum: `fallback_combiner`) of its
        `fallback_hashes` rows, gathered
        for every key (`tf.gather`: a sparse gradient of `fallback_hashes` rows
        per key, never empty), then masked by the caller.
        """
        if self.fallback is None:
            return tf.where(valid[:, None], default_row[None, :], 0.0)
        buckets = tables.buckets_of(keys, self.fallback_rows, self.fallback_hashes, self.seed)
        rows = tf.gather(tf_patches.replica_copy(self.fallback.value), buckets)
        combine = tf.reduce_mean if self.fallback_combiner == "mean" else tf.reduce_sum
        return tf.where(valid[:, None], combine(rows, axis=1), 0.0)

    # `Portable`: the rows of every id, whatever the number of parts (`dynamic_content`).

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def indexes(self) -> list[tf.Module]:
        return [part.table for part in self.parts]

    def split_shapes(self, parts: int) -> list[tuple[int, ...]] | None:
        if parts > self.capacity:
            return None
        rows = [capacity + 1 for capacity in sharding.split_rows(self.capacity, parts)]
        width = self.output_dim
        shared = (self.fallback_rows, width) if self.fallback_rows else (width,)
        return [(r, width) for r in rows] + [shared] + [(r,) for r in rows]

    def twin(self, parts: int) -> keras.layers.Layer:
        with sharding.policy((sharding.current() or sharding.Policy()).with_parts(parts)):
            twin = type(self).from_config(self.get_config())
        twin.table_optimizer = self.table_optimizer
        twin.build()
        return twin

    def export_logical(self, slots: Slots) -> dict[str, np.ndarray]:
        """Every id's row, optimizer slots, admission and last-seen step, count; counters.

        `fresh` marks rows not written since their id was admitted (they read
        the id's initial row). `spare/...` is the spare row past the capacity.
        """
        return dynamic_content.export_logical(self, slots)

    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        """Each id goes to its part (`tables.part_of`); a part over its capacity evicts LRU."""
        return dynamic_content.import_logical(self, content, slots)

    # What the table holds and where (`dynamic_parts`).

    def describe(self) -> dict:
        """The table's policy, its parts (where each is, its bound, ids and bytes held), a line."""
        return dynamic_parts.describe(self)

    def figures(self) -> list[dict[str, int]]:
        """Each part's counters, ids held and bytes held (`TablePart.figures`), read now."""
        return [part.figures() for part in self.parts]

    # What retrieval reads of the table (`table_frequencies`).

    def held_ids(self) -> tf.Tensor:
        """The ids holding a row (int64; strings' fingerprints, `tables.key64`), in no order."""
        return table_frequencies.held_keys(self.parts)

    def frequencies(self, ids) -> tf.Tensor:
        """The share of the table's recent training lookups that were each of `ids` (flat).

        Each id's count as the table keeps it for admission and eviction, decayed
        to now, over the decayed total (`trainer.layers.table_frequencies`).
        """
        keys, _ = dynamic_lookup.keys_of(ids, self.mask_id)
        return table_frequencies.frequencies(self.parts, keys)

    # The lookup, in its steps (`dynamic_lookup`); `DynamicEmbeddings` takes them too.

    def call(self, inputs, training=False):
        keys, valid = dynamic_lookup.keys_of(inputs, self.mask_id)
        vectors = dynamic_lookup.vectors_by_part(self.parts, keys, valid, training)
        return dynamic_lookup.shaped(inputs, vectors, valid, self.combiner, self.output_dim)

    def __call__(self, inputs, *args, **kwargs):
        # Checked before Keras's `__call__`, which adds lines about the call to any error.
        dynamic_lookup.check_ids(inputs, self.key_dtype, f"`DynamicEmbedding` '{self.name}'")
        return super().__call__(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return (*input_shape, self.output_dim)
        return (*input_shape[:-1], self.output_dim)

    @classmethod
    def from_config(cls, config: dict) -> DynamicEmbedding:
        # A layer saved before `fallback_hashes` existed read one fallback row per id; one
        # saved before `fallback_combiner`, their sum; one saved before `seen_bits`, the
        # default or fallback rows for every id.
        old = {"fallback_hashes": 1, "fallback_combiner": "sum", "seen_bits": 0}
        return super().from_config({**old, **config})

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "output_dim": self.output_dim,
            "key_dtype": self.key_dtype,
            "combiner": self.combiner,
            "min_count": self.min_count,
            "ttl_steps": self.ttl_steps,
            "capacity": self.capacity,
            "eviction": self.eviction,
            "mask_id": self.mask_id,
            "seed": self.seed,
            "fallback_rows": self.fallback_rows,
            "sketch_width": self.sketch_width,
            "sketch_depth": self.sketch_depth,
            "fallback_hashes": self.fallback_hashes,
            "fallback_combiner": self.fallback_combiner,
            "seen_bits": self.seen_bits,
        }
