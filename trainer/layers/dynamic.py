"""`DynamicEmbedding`: raw ids (int64 or strings) looked up in a table that grows.

The table (`trainer.layers.tables`) creates a row when an id is admitted and
frees it on eviction: no vocabulary size, no collisions. Under
`parameter_server` it is split by id into one part per ps member.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from strategies import sharding, tf_patches
from towerflow.errors import UserError
from trainer.layers import tables
from trainer.layers.portable import Portable, Slots, with_slots
from trainer.layers.table_training import RowAwareOnly, TableOptimizer

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
            sketch[0] >= 1,
            f"`sketch_width` ({sketch[0]}) must be >= 1 cell; e.g. {tables.SKETCH_WIDTH} "
            "(the count-min sketch of ids not admitted yet)",
        ),
        (
            sketch[1] >= 1,
            f"`sketch_depth` ({sketch[1]}) must be >= 1 row; e.g. {tables.SKETCH_DEPTH}",
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
    one part per ps member, each part's index, lock and variables on its task
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
        evicted) reads one shared trainable default row; N > 0: it reads row
        `hash(id) % N` of a trainable `[N, output_dim]` fallback table (as a
        hashed embedding would), counted in `bytes_held`.
      sketch_width: with `min_count` > 1, the lookups of ids not admitted yet
        are counted in a count-min sketch of `sketch_depth` rows of
        `sketch_width` int32 cells (in `bytes_held`), no memory per id: a
        count is over by at most e/`sketch_width` x the lookups it took since
        it was last halved, with probability 1 - e**-`sketch_depth`.
      sketch_depth: the sketch's rows (see `sketch_width`).
      mask_id: an id that means "no id" (padding): it reads zeros, is never
        admitted, and combiners leave it out.
      seed: keys the initial rows.
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
        )
        self.fallback_rows = int(fallback_rows)
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
        # One part per ps member under `parameter_server` (ids split by `tables.part_of`),
        # each with its index, lock, rows and row stamps on that task; else one, here.
        devices = _part_devices()
        capacities = sharding.split_rows(self.capacity, len(devices))
        self.parts = [
            _TablePart(self, index, device, part_capacity)
            for index, (device, part_capacity) in enumerate(zip(devices, capacities, strict=True))
        ]
        self.table = self.parts[0].table

    def build(self, input_shape=None):
        for part in self.parts:
            part.build()
        self.rows, self.row_stamps = self.parts[0].rows, self.parts[0].row_stamps
        # Where ids without a row read: one logical variable, whatever the parts.
        self.default_row = self.fallback = None
        if self.fallback_rows:
            self.fallback = self.add_weight(
                (self.fallback_rows, self.output_dim), "zeros", name="fallback"
            )
        else:
            self.default_row = self.add_weight((self.output_dim,), "zeros", name="default_row")

    def defaults(self, keys: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
        """What each of `keys` reads without a row: the default row or its fallback row.

        Zeros where not `valid`.

        A fallback row is gathered for every key (`tf.gather`: a sparse gradient
        of one row per key, never empty), then masked by the caller.
        """
        if self.fallback is None:
            return tf.where(valid[:, None], self.default_row.value[None, :], 0.0)
        buckets = tables.bucket_of(keys, self.fallback_rows)
        rows = tf.gather(tf_patches.replica_copy(self.fallback.value), buckets)
        return tf.where(valid[:, None], rows, 0.0)

    # `Portable`: the rows of every id, whatever the number of parts.

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
        parts = []
        for part in self.parts:
            content = part.table.contents()
            held = content.pop("slots")
            stamps = content.pop("stamps")
            content["fresh"] = part.row_stamps.numpy()[held] != stamps
            for name, variable, _ in with_slots(part.rows, slots, "rows"):
                value = variable.numpy()
                content[name], content[f"spare/{name}"] = value[held], value[-1:]
            parts.append(content)
        counters = tables.merged_counters([content.pop("counters") for content in parts])
        # An id's count is in its part's sketch: the parts' largest cell is at least as large.
        sketch = np.max([content.pop("sketch") for content in parts], axis=0)
        merged = {name: np.concatenate([c[name] for c in parts]) for name in parts[0]}
        merged["sketch"] = sketch
        for name, variable, _ in self._shared(slots):
            merged[name] = variable.numpy()
        return {**merged, "counters": counters}

    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        """Each id goes to its part (`tables.part_of`); a part over its capacity evicts LRU."""
        keys, last_seen = content["keys"], content["last_seen"]
        owners = tables.part_of(tf.constant(keys, tf.int64), len(self.parts)).numpy()
        waiting = content["waiting"]
        waiting_owners = tables.part_of(tf.constant(waiting, tf.int64), len(self.parts)).numpy()
        counters = tables.split_counters(content["counters"], len(self.parts))
        counts = content.get("counts")  # None from a checkpoint written before counts were kept
        sketch = content.get("sketch")  # the parts' largest cells: each part takes them all
        warnings = []
        for part in self.parts:
            mine = np.flatnonzero(owners == part.index)
            evicted = max(0, len(mine) - part.capacity)
            if evicted:  # the least recently seen first, ties by id, as the table evicts
                mine = mine[np.lexsort((keys[mine], last_seen[mine]))[evicted:]]
                warnings.append(
                    f"table {self.name} part {part.index} holds {part.capacity} rows and the "
                    f"checkpoint {len(mine) + evicted} of its ids: evicted the {evicted} least "
                    "recently seen"
                )
            mine = mine[np.argsort(keys[mine], kind="stable")]
            waits = waiting_owners == part.index
            stamps = part.table.load(
                keys[mine],
                content["admitted"][mine],
                last_seen[mine],
                waiting[waits],
                content["waiting_values"][waits],
                counters[part.index],
                evicted,
                counts[mine] if counts is not None else None,
                sketch,
            )
            row_stamps = np.full(part.row_stamps.shape, -1, np.int64)
            row_stamps[: len(mine)] = np.where(content["fresh"][mine], -1, stamps)
            part.row_stamps.assign(row_stamps)
            for name, variable, initial in with_slots(part.rows, slots, "rows"):
                value = np.full(variable.shape, initial, variable.dtype)
                value[: len(mine)], value[-1] = content[name][mine], content[f"spare/{name}"][0]
                variable.assign(value)
        for name, variable, _ in self._shared(slots):
            variable.assign(content[name])
        return warnings

    def _shared(self, slots: Slots) -> list[tuple]:
        """`with_slots` of the variable every part shares: the fallback rows or the default row."""
        if self.fallback is not None:
            return with_slots(self.fallback, slots, "fallback")
        return with_slots(self.default_row, slots, "default")

    def describe(self) -> dict:
        """The table's policy, its parts (where each is, its bound, ids and bytes held), a line."""
        parts = []
        for part in self.parts:
            figures = part.figures()
            parts.append(
                {
                    "part": part.index,
                    "device": part.table.index.resource_handle.device,  # where the index is
                    "lock": part.table.lock_device(),
                    "capacity": part.capacity,
                    "ids_held": figures["ids_held"],
                    "bytes_held": figures["bytes_held"],
                }
            )
        policy = {
            "key_dtype": self.key_dtype,
            "width": self.output_dim,
            "capacity": self.capacity,
            "min_count": self.min_count,
            "ttl_steps": self.ttl_steps,
            "eviction": self.eviction,
            "fallback_rows": self.fallback_rows,
            "sketch_width": self.sketch_width,
            "sketch_depth": self.sketch_depth,
        }
        where = ", ".join(
            f"part {p['part']} on {p['device']} ({p['capacity']} rows)" for p in parts
        )
        split = f"split by id hash over {len(parts)} parts: " if len(parts) > 1 else ""
        line = (
            f"table {self.name}: dynamic {self.key_dtype} ids, {self.output_dim} wide, at most "
            f"{self.capacity} rows (eviction {self.eviction}), min_count {self.min_count}, "
            f"ttl_steps {self.ttl_steps}, fallback_rows {self.fallback_rows}; {split}{where}"
        )
        held = sum(p["ids_held"] for p in parts)
        size = sum(p["bytes_held"] for p in parts)
        return {**policy, "ids_held": held, "bytes_held": size, "parts": parts, "line": line}

    def figures(self) -> list[dict[str, int]]:
        """Each part's counters, ids held and bytes held (`_TablePart.figures`), read now."""
        return [part.figures() for part in self.parts]

    def call(self, inputs, training=False):
        keys, valid = self._keys(inputs)
        return self._shaped(inputs, self._vectors(keys, valid, training), valid, self.combiner)

    def _keys(self, inputs) -> tuple[tf.Tensor, tf.Tensor]:
        """The ids of `inputs` as flat int64 keys (`tables.key64`), and which are not `mask_id`."""
        ids = inputs.flat_values if isinstance(inputs, tf.RaggedTensor) else inputs
        ids = tf.convert_to_tensor(ids)
        if ids.dtype != tf.string:
            ids = tf.cast(ids, tf.int64)
        flat = tf.reshape(ids, [-1])
        valid = tf.ones_like(flat, tf.bool)
        if self.mask_id is not None:
            valid = tf.not_equal(flat, tf.constant(self.mask_id, flat.dtype))
        return tables.key64(flat), valid

    def _shaped(self, inputs, vectors: tf.Tensor, valid: tf.Tensor, combiner: str | None):
        """The flat `vectors` of the ids of `inputs` in their shape, or reduced by `combiner`."""
        ragged = isinstance(inputs, tf.RaggedTensor)
        ids = inputs.flat_values if ragged else tf.convert_to_tensor(inputs)
        flat = tf.reshape(ids, [-1])
        if combiner is None:
            vectors = tf.reshape(vectors, tf.concat([tf.shape(ids), [self.output_dim]], 0))
            return inputs.with_flat_values(vectors) if ragged else vectors
        if ragged:
            segments, groups = inputs.value_rowids(), inputs.nrows()
            shape = tf.stack([groups, self.output_dim])
        else:
            width = tf.shape(ids, out_type=tf.int64)[-1]
            segments = tf.range(tf.size(flat, out_type=tf.int64)) // width
            groups = tf.size(flat, out_type=tf.int64) // width
            shape = tf.concat([tf.shape(ids)[:-1], [self.output_dim]], 0)
        total = tf.math.unsorted_segment_sum(vectors, segments, groups)
        count = tf.math.unsorted_segment_sum(tf.cast(valid, tf.float32), segments, groups)
        count = tf.maximum(count, 1.0)[:, None]
        if combiner == "mean":
            total /= count
        elif combiner == "sqrtn":
            total /= tf.sqrt(count)
        return tf.reshape(total, shape)

    def __call__(self, inputs, *args, **kwargs):
        # Checked before Keras's `__call__`, which adds lines about the call to any error.
        self._check_ids(inputs, f"`DynamicEmbedding` '{self.name}'")
        return super().__call__(inputs, *args, **kwargs)

    def _check_ids(self, inputs, what: str) -> None:
        """Raises `UserError` if `inputs` (fed to `what`) are not ids this table can take.

        That is ids of `key_dtype`, and under a strategy of several processes
        (`multi_worker`) ids of one shape: its collectives (the ids gathered for
        admission, the rows' sparse gradient) need one shape on every worker,
        and a ragged batch of one worker holds more ids than another's.
        """
        if getattr(inputs, "ragged", False) or isinstance(inputs, tf.RaggedTensor):
            strategy = tf.distribute.get_strategy()
            replicas = strategy.num_replicas_in_sync  # 1 for the default strategy
            if replicas > 1 and replicas > len(strategy.extended.worker_devices):
                raise UserError(
                    f"{what} cannot take lists of ids of no fixed length (ragged) under a "
                    "strategy of several processes, whose collectives need one shape on every "
                    "worker; pad each list to one width and set `mask_id` (e.g. "
                    "`ids.to_tensor(default_value=0, shape=[None, WIDTH])`, `mask_id=0`)."
                )
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        strings = dtype == "string"
        if strings != (self.key_dtype == "string") or dtype.startswith(("float", "bool")):
            other = "int64" if self.key_dtype == "string" else "string"
            raise UserError(
                f"{what} has `key_dtype` {self.key_dtype} but got {dtype} ids; pass "
                f'{self.key_dtype} ids, or build it with `key_dtype="{other}"`.'
            )

    def _vectors(self, keys: tf.Tensor, valid: tf.Tensor, training) -> tf.Tensor:
        """The vector of each of `keys` (1-D int64): its row, the default row, or 0 if not `valid`.

        With several parts, each part looks up (and admits) its own ids on its device.
        """
        if len(self.parts) == 1:
            return self.parts[0].vectors(keys, valid, training)
        parts = tables.part_of(keys, len(self.parts))
        positions = tf.dynamic_partition(tf.range(tf.size(keys)), parts, len(self.parts))
        keys_by_part = tf.dynamic_partition(keys, parts, len(self.parts))
        valid_by_part = tf.dynamic_partition(valid, parts, len(self.parts))
        vectors = [
            part.vectors(part_keys, part_valid, training)
            for part, part_keys, part_valid in zip(
                self.parts, keys_by_part, valid_by_part, strict=True
            )
        ]
        return tf.dynamic_stitch(positions, vectors)

    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return (*input_shape, self.output_dim)
        return (*input_shape[:-1], self.output_dim)

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
        }


def _part_devices() -> list[str | None]:
    """The device of each part of a table, as the sharding policy says (`part_devices`).

    A part per ps member, on it on the coordinator of `parameter_server`;
    outside a policy one part, on the strategy's own devices (None).
    """
    policy = sharding.current()
    return policy.part_devices() if policy else [None]


class _Place:
    """Where to put a variable under `parameter_server`: the `colocate_with` of its creator.

    `ParameterServerStrategy` places a variable created `colocate_with`
    something on that thing's device (otherwise round-robin over the ps members,
    whatever the device scope); it reads the thing's `name` and `device`.
    """

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device

    def scope(self):
        """Variables created inside go to `device`."""

        def creator(next_creator, **kwargs):
            return next_creator(**kwargs, use_resource=True, colocate_with=self)

        return tf.variable_creator_scope(creator)


class _TablePart:
    """One part of a `DynamicEmbedding`'s table: its index, rows and row stamps, on one device.

    Under `parameter_server` a part sits on one ps member: its index and lock are
    created there, its variables placed there, and its lookups, admissions and
    updates run there (inside the workers' scheduled steps). The optimizers of
    `trainer.loop.optim` find a part from its rows (`tables.owner_of`).
    """

    def __init__(self, layer: DynamicEmbedding, index: int, device: str | None, capacity: int):
        self.layer, self.index, self.device, self.capacity = layer, index, device, capacity
        self.placed_by = tf.distribute.get_strategy()  # the strategy whose scope placed it
        self.suffix = "" if index == 0 else f"_{index}"
        self.optimizer_slots = 0  # slot variables beside the rows (`trained_by`)
        with self._on_device():
            self.table = tables.DynamicTable(
                capacity,
                layer.min_count,
                layer.ttl_steps,
                layer.eviction,
                name=layer.name + self.suffix,
                sketch_width=layer.sketch_width,
                sketch_depth=layer.sketch_depth,
            )
        if index:
            setattr(layer, f"table{self.suffix}", self.table)  # tracked: saved in checkpoints

    def _on_device(self):
        """On this part's ps member, while the strategy that placed it is the current one.

        Not in a traced export: a SavedModel keeps explicit devices, and the
        process that loads it has no ps members.
        """
        placed = self.device and tf.distribute.get_strategy() is self.placed_by
        return tf.device(self.device) if placed else contextlib.nullcontext()

    def build(self) -> None:
        placed = contextlib.nullcontext()
        if self.device:
            placed = _Place(self.table.name, self.device).scope()
        # One row past the capacity, which no id holds, is read by every lookup (with
        # no effect) so that the rows' gradient is never empty: an empty sparse
        # gradient crashes the cross-worker all-reduce of `multi_worker` (TF 2.21).
        rows = self.capacity + 1
        with placed:
            # Refuses an optimizer that is not row-aware, at its first update (`RowAwareOnly`).
            self.rows = self.layer.add_weight(
                (rows, self.layer.output_dim),
                "zeros",
                name="rows" + self.suffix,
                constraint=RowAwareOnly(self.layer.name),
            )
            # Which admission each row's values belong to (see `trainer.layers.tables`); every
            # copy sets its own in the optimizer's update.
            self.row_stamps = self.layer.add_weight(
                (rows,),
                keras.initializers.Constant(-1),
                dtype="int64",
                trainable=False,
                aggregation="none",
                name="row_stamps" + self.suffix,
            )
        if self.index:  # tracked as attributes of the layer: exported with it
            setattr(self.layer, f"rows{self.suffix}", self.rows)
            setattr(self.layer, f"row_stamps{self.suffix}", self.row_stamps)
        tables.register_rows(self.rows, self)

    def trained_by(self, step: tf.Variable, optimizer_slots: int) -> None:
        """Called by the optimizer that trains the rows: its step, and its slots per row."""
        self.table.use_clock(step)
        self.optimizer_slots = optimizer_slots

    def figures(self) -> dict[str, int]:
        """The table's counters and ids held (`DynamicTable.figures`), and `bytes_held`.

        `bytes_held` is the memory of one copy of the part (the replicas of
        `mirrored` each hold one): its rows, their optimizer slots and row
        stamps, allocated whole for `capacity + 1` rows up front, and its
        index, which grows with the ids held and counted (an estimate, see
        `trainer.layers.tables.ENTRY_BYTES`); the first part's also the layer's
        `fallback_rows` and their optimizer slots.
        """
        figures = self.table.figures()
        width, itemsize = self.layer.output_dim, tf.as_dtype(self.rows.dtype).size
        row_bytes = width * itemsize * (1 + self.optimizer_slots) + 8  # + its int64 stamp
        figures["bytes_held"] = (self.capacity + 1) * row_bytes + figures.pop("index_bytes")
        if self.index == 0:  # the layer's fallback rows (and their slots), counted once
            fallback_bytes = width * itemsize * (1 + self.optimizer_slots)
            figures["bytes_held"] += self.layer.fallback_rows * fallback_bytes
        return figures

    def changed_since(self, step: int, variables: list) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """The slots whose rows changed at `step` or later, and their rows in `variables`.

        The slots of `DynamicTable.changed_slots` and the spare row past the
        capacity (every step's lookups read it); their values in each of
        `variables` (the rows, the row stamps, the rows' optimizer slots),
        gathered on this part's device (its ps member under `parameter_server`).
        """
        with self._on_device():
            slots = tf.concat([self.table.changed_slots(step), [self.capacity]], 0)
            return slots, [tf.gather(tf.convert_to_tensor(v), slots) for v in variables]

    def initial_rows(self, slots: tf.Tensor) -> tf.Tensor:
        """The initial values of the rows of `slots` for the ids they hold now."""
        layer = self.layer
        return tables.initial_rows(layer.seed, self.table.keys_of(slots), layer.output_dim)

    def vectors(self, keys: tf.Tensor, valid: tf.Tensor, training) -> tf.Tensor:
        """The vector of each of `keys` (this part's ids): its row, the default row, or 0.

        Every key reads a row, a missing one the spare row past the capacity
        (no id holds it), and its vector is then replaced: the rows' sparse
        gradient has a row per key, so it has the same length on every worker
        for inputs of one shape, and is never empty (an empty one, or ones of
        different lengths, break the cross-worker all-reduce of `multi_worker`
        in TF 2.21).
        """
        seed, width = self.layer.seed, self.layer.output_dim
        with self._on_device():
            admitted = self._admit(keys, valid, self.table.now()) if training else None
            with tf.control_dependencies([admitted] if admitted is not None else []):
                slots, stamps = self.table.find(keys)  # ids admitted now read their own row
            hit = (slots >= 0) & valid
            slots = tf.where(hit, slots, self.capacity)
            rows = tf.gather(tf_patches.replica_copy(self.rows.value), slots)
            # A new id, or a reused slot, reads the id's initial value; the gradient
            # still reaches the row, which the optimizer resets before applying it.
            row_stamps = tf_patches.replica_copy(self.row_stamps.value)
            stale = tf.where(tf.not_equal(tf.gather(row_stamps, slots), stamps))
            initial = tables.initial_rows(seed, tf.gather_nd(keys, stale), width)
            fresh = tf.scatter_nd(
                stale, initial - tf.gather_nd(rows, stale), tf.shape(rows, tf.int64)
            )
        rows += tf.stop_gradient(fresh)
        return tf.where(hit[:, None], rows, self.layer.defaults(keys, valid))

    def _admit(self, keys: tf.Tensor, valid: tf.Tensor, step: tf.Tensor) -> tf.Tensor | None:
        """Admits the `valid` ids of the whole global batch, once per process.

        Each replica gathers every replica's ids and admits them all, the table
        changed by whichever replica comes first (`DynamicTable.admit`'s `once`):
        the same ids in the same step under any split, every worker's table the
        same, and each replica's lookups after the admission. `step`: the
        table's `now()`. A table without the optimizer's clock (`use_clock`)
        cannot tell the replicas' calls of one step apart: there the first
        replica of each worker admits, and the others may read the default row
        for ids admitted at that step.
        """
        replica = tf.distribute.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return self.table.admit(tf.boolean_mask(keys, valid), step)
        keys, valid = replica.all_gather([keys, tf.cast(valid, tf.int64)], 0)
        everyone = tf.boolean_mask(keys, tf.cast(valid, tf.bool))
        if self.table.clocked:
            return self.table.admit(everyone, step, once=True)
        local = len(tf.distribute.get_strategy().extended.worker_devices)
        first = tf.equal(replica.replica_id_in_sync_group % local, 0)
        if tf.get_static_value(first) is not None:
            return self.table.admit(everyone, step) if tf.get_static_value(first) else None
        return tf.cond(first, lambda: self.table.admit(everyone, step), lambda: tf.constant(False))


# The vocabulary of Keras-RS (`keras_rs.layers.TableConfig`, `FeatureConfig`,
