"""How a `DynamicEmbedding` turns ids into vectors, in the order a call takes its steps.

1. `check_ids`: ids of the layer's `key_dtype`, and of one shape under a
   strategy of several processes (a one-line `UserError` otherwise).
2. `keys_of`: the ids as flat int64 keys (`tables.key64`), and which are not
   `mask_id`.
3. `vectors_by_part`: in training, each part of the table
   (`trainer.layers.dynamic_parts`) looks up its own ids on its device
   (`part_packed`), first admitting the ids of the whole global batch
   (`admit_global_batch`); a new id, or one whose slot was reused, reads its
   initial row (`_packed_rows`). An id without a row reads the default or
   fallback row (`DynamicEmbedding.defaults`), taken once for the ids of
   every part. Outside training (eval, an export's serving) the lookup is
   `trainer.layers.dynamic_serving`'s: read-only, a few ops a part, and an
   id the table has not seen lately (its seen-filter,
   `trainer.layers.table_seen`) reads zeros.
4. `shaped`: the vectors in the ids' shape, or reduced over each example's
   list by the `combiner`.

Plain functions of the layer's settings and parts: every variable and index
they read is the layer's (`DynamicEmbeddings` calls them with its tables' parts for
several features at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from strategies import tf_patches
from towerflow.errors import UserError
from trainer.layers import dynamic_serving, tables

if TYPE_CHECKING:
    from trainer.layers.dynamic_types import Part


def check_ids(inputs, key_dtype: str, what: str) -> None:
    """Raises `UserError` if `inputs` (fed to `what`) are not ids a table of `key_dtype` takes.

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
    if strings != (key_dtype == "string") or dtype.startswith(("float", "bool")):
        other = "int64" if key_dtype == "string" else "string"
        raise UserError(
            f"{what} has `key_dtype` {key_dtype} but got {dtype} ids; pass "
            f'{key_dtype} ids, or build it with `key_dtype="{other}"`.'
        )


def keys_of(inputs, mask_id) -> tuple[tf.Tensor, tf.Tensor]:
    """The ids of `inputs` as flat int64 keys (`tables.key64`), and which are not `mask_id`."""
    ids = inputs.flat_values if isinstance(inputs, tf.RaggedTensor) else inputs
    ids = tf.convert_to_tensor(ids)
    if ids.dtype != tf.string:
        ids = tf.cast(ids, tf.int64)
    flat = tf.reshape(ids, [-1])
    valid = tf.ones_like(flat, tf.bool)
    if mask_id is not None:
        valid = tf.not_equal(flat, tf.constant(mask_id, flat.dtype))
    return tables.key64(flat), valid


def vectors_by_part(parts: list[Part], keys: tf.Tensor, valid: tf.Tensor, training) -> tf.Tensor:
    """The vector of each of `keys` (1-D int64): its row, the default row, or 0 if not `valid`.

    With several parts (`parameter_server`), each part looks up (and admits)
    its own `valid` ids on its ps member, which gets those ids and sends back
    one tensor (`part_packed`). What the ids without a row read is taken once,
    here; the default row (without fallback rows) comes with the first part's
    rows, whose member holds it, and its gradient goes back with theirs. Each
    tensor that crosses is a message between the worker and the member.
    The vectors are of the layer's compute dtype (under mixed precision the
    rows are float32 variables read as they are). Outside training:
    `dynamic_serving.served_vectors`.
    """
    if not training:
        return dynamic_serving.served_vectors(parts, keys, valid)
    layer = parts[0].layer
    default = layer.default_row  # None with fallback rows
    if len(parts) == 1:
        packed = part_packed(parts[0], keys, valid, default)
        return _rows_or_defaults(*_default_of(packed, default), layer, keys, valid)
    count = len(parts)
    owners = tf.where(valid, tables.part_of(keys, count), count)  # the last: not looked up
    positions = tf.dynamic_partition(tf.range(tf.size(keys)), owners, count + 1)
    keys_by_part = tf.dynamic_partition(keys, owners, count + 1)[:count]
    packed = [
        part_packed(part, part_keys, None, default if i == 0 else None)
        for i, (part, part_keys) in enumerate(zip(parts, keys_by_part, strict=True))
    ]
    packed[0], default_row = _default_of(packed[0], default)
    left = tf.zeros([tf.size(positions[count]), layer.output_dim + 1], packed[0].dtype)
    both = tf.dynamic_stitch(positions, [*packed, left])  # `left`: the ids not valid
    return _rows_or_defaults(both, default_row, layer, keys, valid)


def _rows_or_defaults(packed: tf.Tensor, default_row, layer, keys, valid) -> tf.Tensor:
    """The rows of `packed` (`part_packed`'s) where they hold one, else what `keys` read without."""
    held = packed[:, -1:]
    rows = tf.where(held > 0, packed[:, :-1], layer.defaults(keys, valid, default_row))
    return tf.cast(rows, layer.compute_dtype)


def _default_of(packed: tf.Tensor, default) -> tuple[tf.Tensor, tf.Tensor | None]:
    """`packed` without the default row that `part_packed` put last, and that row (or None)."""
    if default is None:
        return packed, None
    # Split, not sliced: a slice's gradient takes the shape of what it sliced, which is
    # on the part's device (one more message from its member).
    rows, last = tf.split(packed, [-1, 1])
    return rows, last[0, :-1]


def part_packed(part: Part, keys: tf.Tensor, valid: tf.Tensor | None, default=None) -> tf.Tensor:
    """The row of each of `keys` (`part`'s ids) in training, and a last column: 1 where held.

    The ids are admitted first (`admit_global_batch`). Held: held and
    `valid` (None: every key is). Every key reads a row, a missing one the
    spare row past the capacity (no id holds it), whose vector the caller
    replaces: the rows' sparse gradient has a row per key, so it has the same
    length on every worker for inputs of one shape, and is never empty (an
    empty one, or ones of different lengths, break the cross-worker
    all-reduce of `multi_worker` in TF 2.21). With `default` (the layer's
    default row, a variable on this part's device), one more row: its value.
    """
    table = part.table
    with part.on_device():
        admitted = admit_global_batch(table, keys, valid, table.now())
        with tf.control_dependencies([admitted] if admitted is not None else []):
            slots, stamps = table.find(keys)  # ids admitted now read their own row
        hit = slots >= 0 if valid is None else (slots >= 0) & valid
        slots = tf.where(hit, slots, part.capacity)
        return _packed_rows(part, keys, slots, stamps, hit, default)


def _packed_rows(
    part: Part,
    keys: tf.Tensor,
    slots: tf.Tensor,
    stamps: tf.Tensor,
    hit: tf.Tensor,
    default=None,
) -> tf.Tensor:
    """The rows of `slots` and a column: 1 where `hit`; new ids' rows initial.

    A new id, or a reused slot (its row's stamp is not the one the index
    holds: `stamps`), reads the id's initial value; the gradient still
    reaches the row, which the optimizer resets before applying it. The
    gradient (the rows' sparse one, indexed by `slots`) is made on the part's
    device: only the gradient of the packed rows crosses from a worker to the
    part's ps member (made where the gradient is taken, the gather's indices,
    the rows and the column would each cross back, only to give shapes). It
    goes to the variable's handle, an input of the packing: a variable read
    inside a `tf.custom_gradient` is read whole (a copy of every row, each
    step, once rows were updated sparsely). With `default`, its value is one
    more row (read here, beside it), and its gradient that row's.

    Training only: a `tf.custom_gradient` traced in a function registers its
    gradient for the whole process, and that holds the function's graph for
    good (about 3 MB for each export of a model with a dynamic table, which
    traces its serving function anew); `dynamic_serving`'s lookup is plain ops.
    """
    seed, width = part.layer.seed, part.layer.output_dim
    variable = tf_patches.replica_copy(part.rows.value)
    shape = tf.constant(variable.shape.as_list(), tf.int64)  # not a read of the variable
    row_stamps = tf_patches.replica_copy(part.row_stamps.value)
    stale = tf.where(tf.not_equal(tf.gather(row_stamps, slots), stamps))
    rows = tf.gather(variable, slots)  # the rows asked for, not the whole variable
    inputs, default_value = [variable.handle, rows], None
    if default is not None:  # its handle (the gradient's way, as the rows') and its value,
        default = tf_patches.replica_copy(default.value)  # read here: a tape watches it then
        default_value = tf.convert_to_tensor(default)
        inputs += [default.handle, default_value]

    def pack(rows, default_value=None):
        initial = tables.initial_rows(seed, tf.gather_nd(keys, stale), width)
        fresh = tf.scatter_nd(stale, initial - tf.gather_nd(rows, stale), tf.shape(rows, tf.int64))
        rows += tf.stop_gradient(fresh)
        more = [] if default_value is None else [default_value[None]]
        column = tf.cast(tf.concat([hit, tf.ones([len(more)], tf.bool)], 0), rows.dtype)
        return tf.concat([tf.concat([rows, *more], 0), column[:, None]], 1)

    @tf.custom_gradient
    def packed(handle, rows, *default):
        def gradient(upstream):
            # The default row's too, on this device: differentiated where the gradient is
            # taken (a worker), its read would be a message there and back.
            with part.on_device():
                held = tf.IndexedSlices(upstream[: tf.size(slots), :width], slots, shape)
                return held, None, *([upstream[-1, :width], None] if default else [])

        return pack(rows, *default[1:]), gradient

    return packed(*inputs)


def admit_global_batch(
    table: tables.DynamicTable, keys: tf.Tensor, valid: tf.Tensor | None, step: tf.Tensor
) -> tf.Tensor | None:
    """Admits the `valid` ids (None: all) of the whole global batch into `table`, once per process.

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
        return table.admit(keys if valid is None else tf.boolean_mask(keys, valid), step)
    if valid is None:
        valid = tf.ones_like(keys, tf.bool)
    keys, valid = replica.all_gather([keys, tf.cast(valid, tf.int64)], 0)
    everyone = tf.boolean_mask(keys, tf.cast(valid, tf.bool))
    if table.clocked:
        return table.admit(everyone, step, once=True)
    local = len(tf.distribute.get_strategy().extended.worker_devices)
    first = tf.equal(replica.replica_id_in_sync_group % local, 0)
    if tf.get_static_value(first) is not None:
        return table.admit(everyone, step) if tf.get_static_value(first) else None
    return tf.cond(first, lambda: table.admit(everyone, step), lambda: tf.constant(False))


def shaped(inputs, vectors: tf.Tensor, valid: tf.Tensor, combiner: str | None, width: int):
    """The flat `vectors` (`width` wide) of the ids of `inputs` in their shape, or combined.

    With a `combiner` ("sum", "mean", "sqrtn"), reduced over the last axis
    (each example's list), leaving out the ids not `valid`.
    """
    ragged = isinstance(inputs, tf.RaggedTensor)
    ids = inputs.flat_values if ragged else tf.convert_to_tensor(inputs)
    flat = tf.reshape(ids, [-1])
    if combiner is None:
        vectors = tf.reshape(vectors, tf.concat([tf.shape(ids), [width]], 0))
        return inputs.with_flat_values(vectors) if ragged else vectors
    if ragged:
        segments, groups = inputs.value_rowids(), inputs.nrows()
        shape = tf.stack([groups, width])
    else:
        columns = tf.shape(ids, out_type=tf.int64)[-1]
        segments = tf.range(tf.size(flat, out_type=tf.int64)) // columns
        groups = tf.size(flat, out_type=tf.int64) // columns
        shape = tf.concat([tf.shape(ids)[:-1], [width]], 0)
    total = tf.math.unsorted_segment_sum(vectors, segments, groups)
    count = tf.math.unsorted_segment_sum(tf.cast(valid, tf.float32), segments, groups)
    count = tf.maximum(count, 1.0)[:, None]
    if combiner == "mean":
        total /= count
    elif combiner == "sqrtn":
        total /= tf.sqrt(count)
    return tf.reshape(total, shape)
