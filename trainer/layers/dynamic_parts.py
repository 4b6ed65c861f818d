"""A `DynamicEmbedding`'s table in parts: where each part goes, what it holds, what it reports.

Under `parameter_server` the table is split by id (`tables.part_of`) into one
part per ps member (`part_devices`, `make_parts`); elsewhere it is one part,
on the strategy's own devices. A `TablePart` owns one part: its index and
lock (a `tables.DynamicTable`), created on its device, and its `rows` and
`row_stamps` variables, placed there (`_Place`). It also answers the
optimizers of `trainer.loop.optim` (`trained_by`, `initial_rows`) and the
incremental checkpoints (`changed_since`), and counts what it holds
(`figures`). `describe` says where every part of a layer is and what it holds.

The part's lookups are in `trainer.layers.dynamic_lookup`. The variables and
index a part creates are the layer's own (Keras weights named `rows`,
`row_stamps`, and attributes `table_1`, `rows_1`, ... for the parts after the
first), so a checkpoint's keys are those of the layer.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from strategies import sharding
from trainer.layers import tables
from trainer.layers.table_training import RowAwareOnly

if TYPE_CHECKING:
    from trainer.layers.dynamic_types import TableLayer


def part_devices() -> list[str | None]:
    """The device of each part of a table, as the sharding policy says (`part_devices`).

    A part per ps member, on it on the coordinator of `parameter_server`;
    outside a policy one part, on the strategy's own devices (None).
    """
    policy = sharding.current()
    return policy.part_devices() if policy else [None]


def make_parts(layer: TableLayer) -> list[TablePart]:
    """The parts of `layer`'s table, its `capacity` split evenly over them.

    One part per ps member under `parameter_server` (ids split by
    `tables.part_of`), each with its index, lock, rows and row stamps on that
    member; else one, here.
    """
    devices = part_devices()
    capacities = sharding.split_rows(layer.capacity, len(devices))
    return [
        TablePart(layer, index, device, part_capacity)
        for index, (device, part_capacity) in enumerate(zip(devices, capacities, strict=True))
    ]


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


class TablePart:
    """One part of a `DynamicEmbedding`'s table: its index, rows and row stamps, on one device.

    Under `parameter_server` a part sits on one ps member: its index and lock are
    created there, its variables placed there, and its lookups, admissions and
    updates run there (inside the workers' scheduled steps). The optimizers of
    `trainer.loop.optim` find a part from its rows (`tables.owner_of`).
    """

    def __init__(self, layer: TableLayer, index: int, device: str | None, capacity: int):
        self.layer, self.index, self.device, self.capacity = layer, index, device, capacity
        self.placed_by = tf.distribute.get_strategy()  # the strategy whose scope placed it
        self.suffix = "" if index == 0 else f"_{index}"
        self.optimizer_slots = 0  # slot variables beside the rows (`trained_by`)
        # The index as it was when an export's serving began to be traced
        # (`dynamic_serving.frozen`), which its lookups read then; else None.
        self.frozen: tf.lookup.StaticHashTable | None = None
        with self.on_device():
            self.table = tables.DynamicTable(
                capacity,
                layer.min_count,
                layer.ttl_steps,
                layer.eviction,
                name=layer.name + self.suffix,
                sketch_width=layer.sketch_width,
                sketch_depth=layer.sketch_depth,
                seen_bits=layer.seen_bits if layer.fallback_rows else 0,  # see the layer's
            )
        if index:
            setattr(layer, f"table{self.suffix}", self.table)  # tracked: saved in checkpoints

    def on_device(self):
        """On this part's ps member, while the strategy that placed it is the current one.

        Not in a traced export: a SavedModel keeps explicit devices, and the
        process that loads it has no ps members.
        """
        placed = self.device and tf.distribute.get_strategy() is self.placed_by
        return tf.device(self.device) if placed else contextlib.nullcontext()

    def placed(self):
        """Variables created inside go to this part's device (none given: where they would)."""
        if not self.device:
            return contextlib.nullcontext()
        return _Place(self.table.name, self.device).scope()

    def build(self) -> None:
        """Creates the part's `rows` and `row_stamps`: weights of the layer, on its device."""
        # One row past the capacity, which no id holds, is read by every lookup (with
        # no effect) so that the rows' gradient is never empty: an empty sparse
        # gradient crashes the cross-worker all-reduce of `multi_worker` (TF 2.21).
        rows = self.capacity + 1
        with self.placed():
            # Refuses an optimizer that is not row-aware, at its first update (`RowAwareOnly`).
            # Read as the variable it is under mixed precision too (`dynamic_lookup` passes
            # its handle); the layer casts the vectors it gives.
            self.rows = self.layer.add_weight(
                (rows, self.layer.output_dim),
                "zeros",
                name="rows" + self.suffix,
                constraint=RowAwareOnly(self.layer.name),
                autocast=False,
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
        with self.on_device():
            slots = tf.concat([self.table.changed_slots(step), [self.capacity]], 0)
            return slots, [tf.gather(tf.convert_to_tensor(v), slots) for v in variables]

    def initial_rows(self, slots: tf.Tensor) -> tf.Tensor:
        """The initial values of the rows of `slots` for the ids they hold now."""
        layer = self.layer
        return tables.initial_rows(layer.seed, self.table.keys_of(slots), layer.output_dim)


def describe(layer: TableLayer) -> dict:
    """`layer`'s policy, its parts (where each is, its bound, ids and bytes held), a line."""
    parts = [_part_summary(part) for part in layer.parts]
    policy = {
        "key_dtype": layer.key_dtype,
        "width": layer.output_dim,
        "capacity": layer.capacity,
        "min_count": layer.min_count,
        "ttl_steps": layer.ttl_steps,
        "eviction": layer.eviction,
        "fallback_rows": layer.fallback_rows,
        "fallback_hashes": layer.fallback_hashes,
        "fallback_combiner": layer.fallback_combiner,
        "sketch_width": layer.sketch_width,
        "sketch_depth": layer.sketch_depth,
        "seen_bits": layer.table.seen_bits,  # with fallback rows only
    }
    where = ", ".join(f"part {p['part']} on {p['device']} ({p['capacity']} rows)" for p in parts)
    split = f"split by id hash over {len(parts)} parts: " if len(parts) > 1 else ""
    hashes = ""
    if layer.fallback_rows:
        hashes = (
            f" (read {layer.fallback_hashes} at a time, {layer.fallback_combiner}; "
            f"seen_bits {layer.table.seen_bits})"
        )
    line = (
        f"table {layer.name}: dynamic {layer.key_dtype} ids, {layer.output_dim} wide, at most "
        f"{layer.capacity} rows (eviction {layer.eviction}), min_count {layer.min_count}, "
        f"ttl_steps {layer.ttl_steps}, fallback_rows {layer.fallback_rows}{hashes}; {split}{where}"
    )
    held = sum(p["ids_held"] for p in parts)
    size = sum(p["bytes_held"] for p in parts)
    return {**policy, "ids_held": held, "bytes_held": size, "parts": parts, "line": line}


def _part_summary(part: TablePart) -> dict:
    """Where `part` is (its index's device, its lock's), its bound, the ids and bytes it holds."""
    figures = part.figures()
    return {
        "part": part.index,
        "device": part.table.index.resource_handle.device,  # where the index is
        "lock": part.table.lock_device(),
        "capacity": part.capacity,
        "ids_held": figures["ids_held"],
        "bytes_held": figures["bytes_held"],
    }
