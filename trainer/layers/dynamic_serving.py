"""How a `DynamicEmbedding` reads its rows outside training: evaluation, and an export's serving.

Outside training a lookup changes nothing (no admission, no count, no lock)
and takes no gradient, so it is a few ops a part, each over the whole batch:

1. the ids' slots and stamps, one lookup in the index, which holds a held
   id's stamp and so its slot (`DynamicTable.find`);
2. their rows, gathered at once from the rows variable; a row not written
   since its id was admitted (its `row_stamps` entry differs from the
   index's stamp) reads the id's initial value, computed only when the batch
   holds such a row (`tf.cond`);
3. ids without a row read the default or fallback rows
   (`DynamicEmbedding.defaults`), and, with a seen-filter
   (`trainer.layers.table_seen`), zeros where the table has not seen them in
   training lately: computed only when the batch holds such an id.

A lookup reads exactly what a training lookup of the same ids reads at that
point (`trainer.layers.dynamic_lookup.part_packed`: the same rows, the same
initial values with the same float operations, the same default or fallback
rows), except for ids the seen-filter has not seen, which read zeros
(tests/test_table_serving.py).

An export reads a frozen index (`frozen`): for each part, a
`tf.lookup.StaticHashTable` made when the export is written, from each id
held to its slot, or to `-2 - slot` where the row is not written since the
id's admission. Step 1 is then one lookup in a flat hash map, with no row
stamps to gather. The table is a stock TensorFlow op (`HashTableV2`), its
content constants of the SavedModel's graph (16 bytes an id held), which TF
Serving loads; the live index is saved beside it as before.

Under `parameter_server` each part reads its own ids on its ps member and
sends back one tensor: the rows and a column saying which hold one (1), and
which the seen-filter has not seen (-1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import tensorflow as tf

from strategies import tf_patches
from trainer.layers import tables

if TYPE_CHECKING:
    from trainer.layers.dynamic_types import Part, TableLayer


@contextlib.contextmanager
def frozen(layers: list[TableLayer]) -> Iterator[list[tf.lookup.StaticHashTable]]:
    """Inside, lookups outside training of `layers` read their index as it is now, frozen.

    Gives the frozen tables (`frozen_index`), which the exported module must
    track, so that the SavedModel holds them. For an export's serving
    function, traced inside.
    """
    parts = [part for layer in layers for part in layer.parts]
    try:
        for part in parts:
            part.frozen = frozen_index(part)
        yield [part.frozen for part in parts]
    finally:
        for part in parts:
            part.frozen = None


def frozen_index(part: Part) -> tf.lookup.StaticHashTable:
    """`part`'s ids held, each to its slot, or to `-2 - slot` where its row is not written.

    Other ids find -1. Read eagerly from the index (`slot_info`: each held
    slot's stamp and id) and the row stamps, on the part's device.
    """
    slots, info = part.table.slot_info.export()
    slots, info = tf.reshape(slots, [-1]), tf.reshape(info, [-1, 3])
    row_stamps = tf_patches.replica_copy(part.row_stamps.value)
    written = tf.equal(tf.gather(row_stamps, slots), info[:, 0])
    codes = tf.where(written, slots, -2 - slots)
    with tf.init_scope():  # its content built once, here; its initializer saved with it
        return tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(info[:, 2], codes), default_value=-1
        )


def served_vectors(parts: list[Part], keys: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """The vector of each of `keys` (1-D int64) outside training; zeros where not `valid`.

    Of the layer's compute dtype (the rows are float32 variables read as they are).
    """
    layer = parts[0].layer
    every = None if layer.mask_id is None else valid  # None: every key is valid
    if len(parts) == 1:
        part = parts[0]
        with part.on_device():
            rows, held = _held_rows(part, keys, every)

        def or_defaults() -> tf.Tensor:
            with part.on_device():
                seen = _seen(part.table, keys, held)
            return _or_defaults(layer, keys, valid, rows, held, seen)

        vectors = tf.cond(tf.reduce_all(held), lambda: rows, or_defaults)
    else:
        vectors = _by_part(parts, keys, valid)
    return tf.cast(vectors, layer.compute_dtype)


def _by_part(parts: list[Part], keys: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """`served_vectors` of a table in parts: each part reads its own valid ids on its device."""
    layer, count = parts[0].layer, len(parts)
    owners = tf.where(valid, tables.part_of(keys, count), count)  # the last: not looked up
    positions = tf.dynamic_partition(tf.range(tf.size(keys)), owners, count + 1)
    keys_by_part = tf.dynamic_partition(keys, owners, count + 1)[:count]
    packed = [_packed(part, part_keys) for part, part_keys in zip(parts, keys_by_part, strict=True)]
    left = tf.zeros([tf.size(positions[count]), layer.output_dim + 1], packed[0].dtype)
    both = tf.dynamic_stitch(positions, [*packed, left])  # `left`: the ids not valid, read 0
    rows, column = both[:, :-1], both[:, -1]
    held = column > 0
    return tf.cond(
        tf.reduce_all(held),
        lambda: rows,
        lambda: _or_defaults(layer, keys, valid, rows, held, column >= 0),
    )


def _packed(part: Part, keys: tf.Tensor) -> tf.Tensor:
    """`part`'s rows of `keys` and a column: 1 where held, -1 where unseen, else 0.

    Made on the part's device, the one tensor that crosses back.
    """
    with part.on_device():
        rows, held = _held_rows(part, keys, None)
        column = tf.cast(held, rows.dtype)
        if part.table.seen is not None:
            unseen = tf.cond(
                tf.reduce_all(held),
                lambda: tf.zeros_like(held),
                lambda: ~_seen(part.table, keys, held),
            )
            column -= tf.cast(unseen, rows.dtype)
        return tf.concat([rows, column[:, None]], 1)


def _held_rows(part: Part, keys: tf.Tensor, valid: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """The row of each of `keys` in `part` (any row where none), and whether it holds one.

    A key without a row (or not `valid`; None: all are) reads the spare row
    past the capacity, which the caller replaces. A row not written since its
    id was admitted reads the id's initial value, as `dynamic_lookup`'s
    training lookup gives it: the row plus (initial - row).
    """
    slots, stale = _slots(part, keys)
    held = slots >= 0 if valid is None else (slots >= 0) & valid
    slots = tf.where(held, slots, part.capacity)
    rows = tf.gather(tf_patches.replica_copy(part.rows.value), slots)
    stale &= held

    def initial() -> tf.Tensor:
        at = tf.where(stale)
        fresh = tables.initial_rows(part.layer.seed, tf.gather_nd(keys, at), part.layer.output_dim)
        return tf.tensor_scatter_nd_add(rows, at, fresh - tf.gather_nd(rows, at))

    return tf.cond(tf.reduce_any(stale), initial, lambda: rows), held


def _slots(part: Part, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The slot of each of `keys` in `part` (-1: none), and whether its row is not written.

    From the frozen index while an export is traced, else from the live one.
    """
    index = part.frozen
    if index is not None:
        codes = index.lookup(keys)
        return tf.where(codes >= -1, codes, -2 - codes), codes < -1
    slots, stamps = part.table.find(keys)
    row_stamps = tf_patches.replica_copy(part.row_stamps.value)
    return slots, tf.not_equal(tf.gather(row_stamps, tf.maximum(slots, 0)), stamps)


def _seen(table: tables.DynamicTable, keys: tf.Tensor, held: tf.Tensor) -> tf.Tensor:
    """Whether each of `keys` is held or seen by `table`'s seen-filter (all, without one)."""
    if table.seen is None:
        return tf.ones_like(held)
    return held | table.seen_ids(keys)


def _or_defaults(layer, keys, valid, rows, held, seen) -> tf.Tensor:
    """`rows` where `held`, else what `keys` read without a row (zeros if not valid or not seen)."""
    default_row = None
    if layer.default_row is not None:
        default_row = tf.convert_to_tensor(tf_patches.replica_copy(layer.default_row.value))
    return tf.where(held[:, None], rows, layer.defaults(keys, valid & seen, default_row))
