"""How a `DynamicEmbedding` reads its rows outside training: evaluation, and an export's serving.

Outside training a lookup changes nothing (no admission, no count, no lock)
and takes no gradient, so it is a few ops a part, each over the whole batch:

1. the ids' codes, one lookup in the index (`DynamicTable.codes`), which
   holds a held id's stamp and so its slot, and marks it `WRITTEN` once the
   optimizer wrote its row (`DynamicTable.mark_written`);
2. where every id of the batch is marked (after training, the usual batch),
   their rows, gathered at once from the rows variable, as they are: nothing
   else (`_if_all_written`);
3. otherwise, each id's row; a row not written since its id was admitted
   (its `row_stamps` entry differs from the index's stamp) reads the id's
   initial value: the row stamps are read only when the batch holds an id
   not marked (`tf.cond`), an index written before it marked rows (a
   checkpoint's) reading as ever; ids without a row read the default or
   fallback rows (`DynamicEmbedding.defaults`), and, with a seen-filter
   (`trainer.layers.table_seen`), zeros where the table has not seen them in
   training lately: computed only when the batch holds such an id.

A lookup reads exactly what a training lookup of the same ids reads at that
point (`trainer.layers.dynamic_lookup.part_packed`: the same rows, the same
initial values with the same float operations, the same default or fallback
rows), except for ids the seen-filter has not seen, which read zeros
(tests/test_table_serving.py).

An export reads a frozen index (`frozen`): for each part, a
`tf.lookup.StaticHashTable` made when the export is written, from each id
held to its code, marked written exactly (from the row stamps then). Step 1
is then one lookup in a flat hash map. The table is a stock TensorFlow op (`HashTableV2`), its
content constants of the SavedModel's graph (16 bytes an id held), which TF
Serving loads; the live index is saved beside it as before.

Under `parameter_server` each part reads its own ids on its ps member and
sends back one tensor: the rows and a column saying which hold one (1), and
which the seen-filter has not seen (-1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
    """`part`'s ids held, each to its code in the index, marked `WRITTEN` exactly.

    Other ids find -1. Read eagerly from the index (`slot_info`: each held
    slot's stamp and id) and the row stamps, on the part's device: an id
    unmarked here is one whose row is not written since its admission.
    """
    slots, info = part.table.slot_info.export()
    slots, info = tf.reshape(slots, [-1]), tf.reshape(info, [-1, 3])
    row_stamps = tf_patches.replica_copy(part.row_stamps.value)
    written = tf.equal(tf.gather(row_stamps, slots), info[:, 0])
    codes = part.table.held_code(info[:, 0], written)
    with tf.init_scope():  # its content built once, here; its initializer saved with it
        return tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(info[:, 2], codes), default_value=-1
        )


def served_vectors(parts: list[Part], keys: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """The vector of each of `keys` (1-D int64) outside training; zeros where not `valid`.

    Of the layer's compute dtype (the rows are float32 variables read as they are).
    """
    layer = parts[0].layer
    if len(parts) > 1:
        return tf.cast(_by_part(parts, keys, valid), layer.compute_dtype)
    part = parts[0]
    every = None if layer.mask_id is None else valid  # None: every key is valid
    with part.on_device():
        codes = _codes(part, keys)

    def held_or_defaults() -> tf.Tensor:
        with part.on_device():
            rows, held = _held_rows(part, keys, codes, every)

        def or_defaults() -> tf.Tensor:
            with part.on_device():
                seen = _seen(part.table, keys, held)
            return _or_defaults(layer, keys, valid, rows, held, seen)

        return tf.cond(tf.reduce_all(held), lambda: rows, or_defaults)

    vectors = _if_all_written(part, codes, every, lambda rows: rows, held_or_defaults)
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

    def with_column(rows: tf.Tensor, column: tf.Tensor) -> tf.Tensor:
        return tf.concat([rows, column[:, None]], 1)

    def held_or_not() -> tf.Tensor:
        with part.on_device():
            rows, held = _held_rows(part, keys, codes, None)
            column = tf.cast(held, rows.dtype)
            if part.table.seen is not None:
                unseen = tf.cond(
                    tf.reduce_all(held),
                    lambda: tf.zeros_like(held),
                    lambda: ~_seen(part.table, keys, held),
                )
                column -= tf.cast(unseen, rows.dtype)
            return with_column(rows, column)

    with part.on_device():
        codes = _codes(part, keys)
        return _if_all_written(
            part, codes, None, lambda rows: with_column(rows, tf.ones_like(rows[:, 0])), held_or_not
        )


def _codes(part: Part, keys: tf.Tensor) -> tf.Tensor:
    """What `part`'s index holds for each of `keys` (`DynamicTable.codes`).

    From the frozen index while an export is traced, else from the live one.
    """
    if part.frozen is not None:
        return part.frozen.lookup(keys)
    return part.table.codes(keys)


def _if_all_written(part: Part, codes, valid, then: Callable, otherwise: Callable) -> tf.Tensor:
    """`then(rows)` if every one of `codes` (where `valid`; None: all) is a `written` id's, else
    `otherwise()`.

    The rows of written ids are read as they are: the index says their slots,
    and that no initial value, default or fallback row stands in for one.
    """
    written = part.table.written(codes)
    if valid is not None:
        written &= valid

    def rows() -> tf.Tensor:
        with part.on_device():
            slots = part.table.written_slots(codes)
            return then(tf.gather(tf_patches.replica_copy(part.rows.value), slots))

    return tf.cond(tf.reduce_all(written), rows, otherwise)


def _held_rows(
    part: Part, keys: tf.Tensor, codes: tf.Tensor, valid: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor]:
    """The row of each of `keys` in `part` (any row where none), and whether it holds one.

    `codes`: the index's (`_codes`). A key without a row (or not `valid`;
    None: all are) reads the spare row past the capacity, which the caller
    replaces. A row not written since its id was admitted reads the id's
    initial value, as `dynamic_lookup`'s training lookup gives it: the row
    plus (initial - row). The index marks rows written (`WRITTEN`); only a
    batch that holds an id not marked compares row stamps.
    """
    slots, stamps = part.table.decoded(codes)
    held = slots >= 0 if valid is None else (slots >= 0) & valid
    slots = tf.where(held, slots, part.capacity)
    rows = tf.gather(tf_patches.replica_copy(part.rows.value), slots)
    unsure = held & ~part.table.written(codes)

    def initial() -> tf.Tensor:
        row_stamps = tf_patches.replica_copy(part.row_stamps.value)
        at = tf.where(unsure & tf.not_equal(tf.gather(row_stamps, slots), stamps))
        fresh = tables.initial_rows(part.layer.seed, tf.gather_nd(keys, at), part.layer.output_dim)
        return tf.tensor_scatter_nd_add(rows, at, fresh - tf.gather_nd(rows, at))

    return tf.cond(tf.reduce_any(unsure), initial, lambda: rows), held


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
