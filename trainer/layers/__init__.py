"""Keras 3 layers for distributed training: sharded variables, and dropout by example.

`Dropout` draws its masks by step and by each example's position in the
global batch, so they do not depend on how the batch is split over replicas
(see its docstring). The other layers split their big variable into shards
along axis 0.

Under `parameter_server` with a partitioner (see `strategies.sharding`), a big
embedding table or kernel should not sit whole on one ps task. TF can shard a
variable itself, but a Keras 3 variable cannot wrap TF's `ShardedVariable`;
these layers shard instead. Each shard is an ordinary Keras weight
(`embeddings_0`, `embeddings_1`, ...) holding a contiguous block of rows, the
strategy places the weights round-robin, so consecutive shards land on
different ps tasks. The math is that of one unsharded variable: the same
lookups and products, the same gradients, and with a seeded initializer the
very same initial values. Outside a sharding policy there is one shard and
the layers behave like `keras.layers.Embedding` and `keras.layers.Dense`.

    with strategy.scope():  # parameter_server, partitioner "fixed", num_shards=2
        table = ShardedEmbedding(200_000, 32)  # two 100,000-row variables

Checkpoints and SavedModels hold each shard as its own variable; a checkpoint
written with another number of shards restores all the same (the three layers
here are `Portable`: `trainer.loop.portable` re-splits their logical content).

`DynamicEmbedding` looks raw ids (int64 or strings) up in a table that grows
as ids arrive (`trainer.layers.tables`): no vocabulary size, no collisions. Under
`parameter_server` its table is split by id over the ps tasks.
`DynamicEmbeddings` speaks Keras-RS's words (`TableConfig`, `FeatureConfig`):
a dict of features, several of which may share one table.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from strategies import sharding, tf_patches
from towerflow.errors import UserError
from trainer.layers import tables


class _RowSlice(keras.initializers.Initializer):
    """Rows `start:stop` of what `initializer` gives the whole variable.

    A shard gets exactly its rows of the unsharded variable's initial value (the
    same fan-in and fan-out, and with a seeded initializer the same numbers), at
    the cost of computing the whole value once per shard.
    """

    def __init__(self, initializer, full_shape: tuple[int, ...], start: int, stop: int):
        self.initializer = initializer
        self.full_shape = full_shape
        self.start, self.stop = start, stop

    def __call__(self, shape, dtype=None):
        return self.initializer(self.full_shape, dtype=dtype)[self.start : self.stop]


def _add_shards(
    layer: keras.layers.Layer,
    name: str,
    shape: tuple[int, ...],
    num_shards: int | None,
    initializer,
    regularizer=None,
) -> list[keras.Variable]:
    """Adds the weights `name_0`, `name_1`, ... that together hold a `shape` variable.

    Each is also the layer attribute of its name: TF checkpoints and SavedModels
    track a Keras 3 layer's variables through its attributes, not through lists.
    """
    count = min(num_shards or sharding.num_shards(shape, layer.variable_dtype), shape[0])
    weights, start = [], 0
    for index, rows in enumerate(sharding.split_rows(shape[0], count)):
        init = initializer if count == 1 else _RowSlice(initializer, shape, start, start + rows)
        weight = layer.add_weight(
            (rows, *shape[1:]), init, regularizer=regularizer, name=f"{name}_{index}"
        )
        setattr(layer, f"{name}_{index}", weight)
        weights.append(weight)
        start += rows
    return weights


def _check_shards(layer: str, num_shards: int | None) -> None:
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"`{layer}` `num_shards` ({num_shards}) must be None or >= 1.")


# A trainable variable -> its optimizer slots, as `(slot variable, initial value)`.
Slots = Callable[[keras.Variable], list[tuple]]


class Portable(abc.ABC):
    """A layer whose variables are split into parts, restorable under any other split.

    The layer's *logical* content (a whole table, kernel, or the rows of every
    id, with their optimizer slots) does not depend on how many parts hold it.
    `trainer.loop.portable` restores a checkpoint written with another split by
    building a `twin` with that split, restoring the checkpoint into it, and
    moving `export_logical()` of the twin into `import_logical()` of the layer.
    """

    @property
    @abc.abstractmethod
    def num_parts(self) -> int:
        """How many parts the layer's variables are split into."""

    @abc.abstractmethod
    def split_shapes(self, parts: int) -> list[tuple[int, ...]] | None:
        """The shapes of `self.variables` when split into `parts`; None if it cannot be."""

    @abc.abstractmethod
    def twin(self, parts: int) -> keras.layers.Layer:
        """A built copy of this layer split into `parts`, its variables zeros on this host."""

    @abc.abstractmethod
    def export_logical(self, slots: Slots) -> dict[str, np.ndarray]:
        """The content of this layer and of its optimizer `slots`, whatever its split."""

    @abc.abstractmethod
    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        """Sets this layer and its `slots` to `content` (another split's export); warnings."""

    def indexes(self) -> list[tf.Module]:
        """The lookup tables this layer checkpoints beside its variables."""
        return []


class _ShardedRows(Portable):
    """`Portable` for layers whose variables are shards of rows (`_add_shards`)."""

    @abc.abstractmethod
    def _sharded(self) -> dict[str, list[keras.Variable]]:
        """Each logical variable by name, as its shards in order (an unsplit one, one)."""

    @property
    def num_parts(self) -> int:
        return self.num_shards

    def _twin(self, parts: int, input_shape, **zeros) -> keras.layers.Layer:
        """A copy split into `parts`, built for `input_shape`, with the initializers `zeros`."""
        twin = type(self).from_config({**self.get_config(), "num_shards": parts, **zeros})
        twin.build(input_shape)
        return twin

    def export_logical(self, slots: Slots) -> dict[str, np.ndarray]:
        content = {}
        for name, shards in self._sharded().items():
            per_shard = [_with_slots(shard, slots, name) for shard in shards]
            for column in zip(*per_shard, strict=True):  # the value's shards, then each slot's
                content[column[0][0]] = np.concatenate([v.numpy() for _, v, _ in column])
        return content

    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        for name, shards in self._sharded().items():
            bounds = np.cumsum([shard.shape[0] for shard in shards])[:-1]
            per_shard = [_with_slots(shard, slots, name) for shard in shards]
            for column in zip(*per_shard, strict=True):  # the value's shards, then each slot's
                for (_, variable, _), rows in zip(column, np.split(content[column[0][0]], bounds)):
                    variable.assign(rows)
        return []


def _with_slots(variable: keras.Variable, slots: Slots, name: str) -> list[tuple]:
    """`(name, variable, 0.0)`, then `(f"{name}/slot{k}", slot, initial)` for each of its slots."""
    found = enumerate(slots(variable))
    return [(name, variable, 0.0), *((f"{name}/slot{k}", s, init) for k, (s, init) in found)]


@keras.saving.register_keras_serializable(package="towerflow")
class ShardedEmbedding(_ShardedRows, keras.layers.Layer):
    """`keras.layers.Embedding` with its table split into row blocks ("div" partitioning).

    Shard `i` holds a contiguous range of ids, the first shards one row more
    when the rows do not divide evenly. A lookup gathers from each shard on the
    shard's device (`tf.nn.embedding_lookup`), so only the rows used move and
    each shard's gradient is an `IndexedSlices` of those rows.

    Args:
      input_dim: the vocabulary size (rows of the table).
      output_dim: the embedding width.
      embeddings_initializer: for the whole table, as in `keras.layers.Embedding`.
      embeddings_regularizer: applied to each shard (an L2 sum equals the whole table's).
      num_shards: shards of the table; None asks the active sharding policy.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        num_shards: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_shards("ShardedEmbedding", num_shards)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.num_shards = num_shards
        self.shards: list[keras.Variable] = []

    def build(self, input_shape=None):
        self.shards = _add_shards(
            self,
            "embeddings",
            (self.input_dim, self.output_dim),
            self.num_shards,
            self.embeddings_initializer,
            self.embeddings_regularizer,
        )
        self.num_shards = len(self.shards)

    def _sharded(self) -> dict[str, list[keras.Variable]]:
        return {"embeddings": self.shards}

    def split_shapes(self, parts: int) -> list[tuple[int, ...]] | None:
        if parts > self.input_dim:
            return None
        return [(rows, self.output_dim) for rows in sharding.split_rows(self.input_dim, parts)]

    def twin(self, parts: int) -> keras.layers.Layer:
        return self._twin(parts, None, embeddings_initializer="zeros")

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int64)  # float ids are exact up to 2**24
        # Each replica's own copy of a shard, so that only the rows looked up are read.
        shards = [tf_patches.replica_copy(shard.value) for shard in self.shards]
        return tf.nn.embedding_lookup(shards, ids)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
            "num_shards": self.num_shards,
        }


@keras.saving.register_keras_serializable(package="towerflow")
class ShardedDense(_ShardedRows, keras.layers.Layer):
    """`keras.layers.Dense` with its kernel split by input rows.

    With kernel shards `K_i` holding rows `r_i` of the kernel, the output is
    `sum_i inputs[..., r_i] @ K_i + bias`: the product of the whole kernel.
    The bias is small and stays whole.

    Args:
      units: output width.
      activation: as in `keras.layers.Dense`.
      use_bias: whether to add a bias.
      kernel_initializer: for the whole kernel (its fans are the whole kernel's).
      bias_initializer: for the bias.
      kernel_regularizer: applied to each shard.
      num_shards: shards of the kernel; None asks the active sharding policy.
    """

    def __init__(
        self,
        units: int,
        activation=None,
        use_bias: bool = True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        num_shards: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_shards("ShardedDense", num_shards)
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.num_shards = num_shards
        self.kernels: list[keras.Variable] = []
        self.bias = None

    def build(self, input_shape):
        self.kernels = _add_shards(
            self,
            "kernel",
            (int(input_shape[-1]), self.units),
            self.num_shards,
            self.kernel_initializer,
            self.kernel_regularizer,
        )
        self.num_shards = len(self.kernels)
        if self.use_bias:
            self.bias = self.add_weight((self.units,), self.bias_initializer, name="bias")

    def _sharded(self) -> dict[str, list[keras.Variable]]:
        return {"kernel": self.kernels, **({"bias": [self.bias]} if self.use_bias else {})}

    def split_shapes(self, parts: int) -> list[tuple[int, ...]] | None:
        rows = sum(kernel.shape[0] for kernel in self.kernels)
        if parts > rows:
            return None
        kernels = [(r, self.units) for r in sharding.split_rows(rows, parts)]
        return kernels + ([(self.units,)] if self.use_bias else [])

    def twin(self, parts: int) -> keras.layers.Layer:
        rows = sum(kernel.shape[0] for kernel in self.kernels)
        zeros = {"kernel_initializer": "zeros", "bias_initializer": "zeros"}
        return self._twin(parts, (None, rows), **zeros)

    def call(self, inputs):
        outputs, start = None, 0
        for kernel in self.kernels:
            rows = kernel.shape[0]
            part = keras.ops.matmul(inputs[..., start : start + rows], kernel)
            outputs = part if outputs is None else outputs + part
            start += rows
        if self.bias is not None:
            outputs = outputs + self.bias
        return self.activation(outputs)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "units": self.units,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "num_shards": self.num_shards,
        }


@keras.saving.register_keras_serializable(package="towerflow")
class Dropout(keras.layers.Layer):
    """`keras.layers.Dropout` whose mask does not depend on how the global batch is split.

    Keras's `Dropout` keeps its random state in a variable that every replica
    advances alike, so under `mirrored` all replicas draw the same mask (and
    under `central_storage` the variable cannot be updated from a replica at
    all). Here each training call draws the mask of the whole global batch
    from a stateless RNG keyed by `(seed, step)`, and a replica keeps the rows
    at its offset in the global batch (`replica_id * per_replica_batch`), so
    example `i` of step `s` gets the same mask under one device or any number
    of replicas. `step` counts this layer's training calls in a variable that
    checkpoints with the model, so a resumed run goes on with the masks it
    would have drawn.

    Drawing the global batch's mask costs each replica the random numbers of
    the whole batch; dropout sits on small activations here, where that is cheap.

    Args:
      rate: the fraction of inputs set to 0, in [0, 1).
      seed: keys the masks; None draws one from Python's `random` (which
        `keras.utils.set_random_seed` seeds).
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= rate < 1:
            raise ValueError(f"`Dropout` `rate` ({rate}) must be in [0, 1).")
        self.rate = float(rate)
        self.seed = random.randrange(2**31) if seed is None else int(seed)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.step = self.add_weight(
            (),
            "zeros",
            dtype="int64",
            trainable=False,
            # Each replica advances its own copy by one a step, so the copies stay
            # equal with no cross-replica exchange inside the step (which an
            # XLA-compiled forward pass could not hold). Where the replicas share
            # one copy (`central_storage`), the plugin keeps the first one's update.
            aggregation="none",
            name="step",
        )

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        replica = tf.distribute.get_replica_context()
        replicas = replica.num_replicas_in_sync if replica else 1
        replica_id = replica.replica_id_in_sync_group if replica else 0
        rows = tf.shape(inputs)[0]
        first = tf.cast(replica_id, tf.int32) * rows
        seed = tf.stack([tf.constant(self.seed, tf.int64), self.step.value])
        shape = tf.concat([[rows * replicas], tf.shape(inputs)[1:]], axis=0)
        # A fixed algorithm, as "auto_select" may pick another on another device.
        # XLA (`train.jit_compile`) draws other numbers than TF's own kernel does,
        # though as independent of the replicas.
        uniform = tf.random.stateless_uniform(shape, seed, alg="philox")
        keep = uniform[first : first + rows] >= self.rate
        # On the TensorFlow variable: Keras's `assign_add` reads, adds and assigns, and
        # between asynchronous workers of a parameter-server cluster steps were lost.
        # In a stateless call (the stages of `pipeline`) the value is a tensor that
        # Keras's own `assign_add` records as the new state.
        value = self.step.value
        if isinstance(value, tf.Variable):
            value.assign_add(1)
        else:
            self.step.assign_add(1)
        scale = tf.cast(1.0 / (1.0 - self.rate), inputs.dtype)
        return tf.where(keep, inputs * scale, tf.zeros_like(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


COMBINERS = (None, "sum", "mean", "sqrtn")
KEY_DTYPES = {"int64": tf.int64, "string": tf.string}


def _check_dynamic(
    key_dtype: str,
    combiner,
    min_count: int,
    ttl_steps: int,
    capacity: int,
    eviction,
    where: str = "`DynamicEmbedding`",
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
        (eviction in tables.EVICTIONS, f"`eviction` '{eviction}' must be 'lru' or None"),
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
    count ids and admit them (an id admitted at a step reads its row from the
    next step on); eval and serving lookups change nothing, and an id without
    a row reads the default row. Under a synchronous strategy the replicas
    (and the workers of `multi_worker`) agree on the ids admitted each step,
    so every replica and worker holds the same table. Under `multi_worker`,
    feed every worker ids of one shape (ragged lists padded with `mask_id`;
    a ragged batch there is a one-line error saying so).
    Under `parameter_server` the table is split by id (`tables.part_of`) into
    one part per ps task, each part's index, lock and variables on its task
    (`capacity` split evenly); the workers hold no table (`describe()` says
    where each part is). A checkpoint restores into any number of parts
    (`Portable`; an id goes to its part by the same hash).

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
      eviction: "lru": a full table evicts the least recently seen id; None:
        it refuses new ids (they read the default row; `refused` counts them).
      mask_id: an id that means "no id" (padding): it reads zeros, is never
        admitted, and combiners leave it out.
      seed: keys the initial rows.
    """

    def __init__(
        self,
        output_dim: int,
        key_dtype: str = "int64",
        combiner: str | None = None,
        min_count: int = 1,
        ttl_steps: int = 0,
        capacity: int = tables.DEFAULT_CAPACITY,
        eviction: str | None = "lru",
        mask_id=None,
        seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_dynamic(key_dtype, combiner, min_count, ttl_steps, capacity, eviction)
        self.output_dim = int(output_dim)
        self.key_dtype = key_dtype
        self.combiner = combiner
        self.min_count = int(min_count)
        self.ttl_steps = int(ttl_steps)
        self.capacity = int(capacity)
        self.eviction = eviction
        self.mask_id = mask_id
        self.seed = int(seed)
        # One part per ps task under `parameter_server` (ids split by `tables.part_of`),
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
        self.default_row = self.add_weight((self.output_dim,), "zeros", name="default_row")

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
        return [(r, width) for r in rows] + [(width,)] + [(r,) for r in rows]

    def twin(self, parts: int) -> keras.layers.Layer:
        with sharding.policy("none", num_ps=parts):
            twin = type(self).from_config(self.get_config())
        twin.build()
        return twin

    def export_logical(self, slots: Slots) -> dict[str, np.ndarray]:
        """Every id's row, optimizer slots, admission and last-seen step; counts; counters.

        `fresh` marks rows not written since their id was admitted (they read
        the id's initial row). `spare/...` is the spare row past the capacity.
        """
        parts = []
        for part in self.parts:
            content = part.table.contents()
            held = content.pop("slots")
            stamps = content.pop("stamps")
            content["fresh"] = part.row_stamps.numpy()[held] != stamps
            for name, variable, _ in _with_slots(part.rows, slots, "rows"):
                value = variable.numpy()
                content[name], content[f"spare/{name}"] = value[held], value[-1:]
            parts.append(content)
        counters = tables.merged_counters([content.pop("counters") for content in parts])
        merged = {name: np.concatenate([c[name] for c in parts]) for name in parts[0]}
        for name, variable, _ in _with_slots(self.default_row, slots, "default"):
            merged[name] = variable.numpy()
        return {**merged, "counters": counters}

    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        """Each id goes to its part (`tables.part_of`); a part over its capacity evicts LRU."""
        keys, last_seen = content["keys"], content["last_seen"]
        owners = tables.part_of(tf.constant(keys, tf.int64), len(self.parts)).numpy()
        waiting = content["waiting"]
        waiting_owners = tables.part_of(tf.constant(waiting, tf.int64), len(self.parts)).numpy()
        counters = tables.split_counters(content["counters"], len(self.parts))
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
            )
            row_stamps = np.full(part.row_stamps.shape, -1, np.int64)
            row_stamps[: len(mine)] = np.where(content["fresh"][mine], -1, stamps)
            part.row_stamps.assign(row_stamps)
            for name, variable, initial in _with_slots(part.rows, slots, "rows"):
                value = np.full(variable.shape, initial, variable.dtype)
                value[: len(mine)], value[-1] = content[name][mine], content[f"spare/{name}"][0]
                variable.assign(value)
        for name, variable, _ in _with_slots(self.default_row, slots, "default"):
            variable.assign(content[name])
        return warnings

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
        }
        where = ", ".join(
            f"part {p['part']} on {p['device']} ({p['capacity']} rows)" for p in parts
        )
        split = f"split by id hash over {len(parts)} parts: " if len(parts) > 1 else ""
        line = (
            f"table {self.name}: dynamic {self.key_dtype} ids, {self.output_dim} wide, at most "
            f"{self.capacity} rows (eviction {self.eviction}), min_count {self.min_count}, "
            f"ttl_steps {self.ttl_steps}; {split}{where}"
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
        }


def _under_parameter_server() -> bool:
    strategy = tf.distribute.get_strategy()
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def _part_devices() -> list[str | None]:
    """The device of each part of a table: one per ps task under `parameter_server`.

    Elsewhere a part per ps task of the active sharding policy (one outside
    a policy), all on the strategy's own devices (None).
    """
    policy = sharding.current()  # the plugin's scope says how many ps tasks there are
    if not _under_parameter_server():
        return [None] * (policy.num_ps if policy else 1)
    num_ps = policy.num_ps if policy else tf.distribute.get_strategy().extended._num_ps
    return [f"/job:ps/task:{task}/device:CPU:0" for task in range(num_ps)]


class _Place:
    """Where to put a variable under `parameter_server`: the `colocate_with` of its creator.

    `ParameterServerStrategy` places a variable created `colocate_with`
    something on that thing's device (otherwise round-robin over the ps tasks,
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

    Under `parameter_server` a part sits on one ps task: its index and lock are
    created there, its variables placed there, and its lookups, admissions and
    updates run there (inside the workers' scheduled steps). The optimizers of
    `trainer.loop.optim` find a part from its rows (`tables.owner_of`).
    """

    def __init__(self, layer: DynamicEmbedding, index: int, device: str | None, capacity: int):
        self.layer, self.index, self.device, self.capacity = layer, index, device, capacity
        self.suffix = "" if index == 0 else f"_{index}"
        self.optimizer_slots = 0  # slot variables beside the rows (`trained_by`)
        with self._on_device():
            self.table = tables.DynamicTable(
                capacity,
                layer.min_count,
                layer.ttl_steps,
                layer.eviction,
                name=layer.name + self.suffix,
            )
        if index:
            setattr(layer, f"table{self.suffix}", self.table)  # tracked: saved in checkpoints

    def _on_device(self):
        """On this part's ps task, while the strategy that placed it is the current one.

        Not in a traced export: a SavedModel keeps explicit devices, and the
        process that loads it has no ps tasks.
        """
        placed = self.device and _under_parameter_server()
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
            self.rows = self.layer.add_weight(
                (rows, self.layer.output_dim), "zeros", name="rows" + self.suffix
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
        `trainer.layers.tables.ENTRY_BYTES`).
        """
        figures = self.table.figures()
        width, itemsize = self.layer.output_dim, tf.as_dtype(self.rows.dtype).size
        row_bytes = width * itemsize * (1 + self.optimizer_slots) + 8  # + its int64 stamp
        figures["bytes_held"] = (self.capacity + 1) * row_bytes + figures.pop("index_bytes")
        return figures

    def changed_since(self, step: int, variables: list) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """The slots whose rows changed at `step` or later, and their rows in `variables`.

        The slots of `DynamicTable.changed_slots` and the spare row past the
        capacity (every step's lookups read it); their values in each of
        `variables` (the rows, the row stamps, the rows' optimizer slots),
        gathered on this part's device (its ps task under `parameter_server`).
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
            if training:
                step = self.table.now()
                slots, stamps = self.table.find(keys, step)
                with tf.control_dependencies([slots]):  # ids admitted now are found next step
                    self._admit(keys, valid, step)
            else:
                slots, stamps = self.table.find(keys)
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
        default = tf.where(valid[:, None], self.layer.default_row.value[None, :], 0.0)
        return tf.where(hit[:, None], rows, default)

    def _admit(self, keys: tf.Tensor, valid: tf.Tensor, step: tf.Tensor):
        """Admits the `valid` ids of the whole global batch, once per process.

        Each replica gathers every replica's ids, and the first replica of each
        worker admits them all: the same ids in the same step under any split,
        and every worker's table the same. `step`: the table's `now()`.
        """
        replica = tf.distribute.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return self.table.admit(tf.boolean_mask(keys, valid), step)
        keys, valid = replica.all_gather([keys, tf.cast(valid, tf.int64)], 0)
        everyone = tf.boolean_mask(keys, tf.cast(valid, tf.bool))
        local = len(tf.distribute.get_strategy().extended.worker_devices)
        first = tf.equal(replica.replica_id_in_sync_group % local, 0)
        if tf.get_static_value(first) is not None:
            return self.table.admit(everyone, step) if tf.get_static_value(first) else None
        return tf.cond(first, lambda: self.table.admit(everyone, step), lambda: tf.constant(False))


# The vocabulary of Keras-RS (`keras_rs.layers.TableConfig`, `FeatureConfig`,
# `DistributedEmbedding`), over dynamic tables.

PLACEMENTS = ("auto", "default_device")  # Keras-RS's, but "sparsecore" (TPU only)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One dynamic table for `DynamicEmbeddings`, as `keras_rs.layers.TableConfig` names it.

    The first arguments are Keras-RS's, in its order; `vocabulary_size` is
    optional and bounds the rows (a `DynamicEmbedding`'s `capacity`: ids past
    it evict the least recently seen, where Keras-RS's would be an error). The
    rest are `DynamicEmbedding`'s (`key_dtype`, `min_count`, `ttl_steps`,
    `eviction`, `mask_id`, `seed`). Keras-RS's `initializer` and `optimizer`
    have no counterpart here: a row starts from a value of (`seed`, id), and
    the model's optimizer (`optimizer.name`) trains every table, sparsely.

    Attributes:
      name: the table's name, also its layer's (TensorBoard's `tables/<name>/...`).
      vocabulary_size: the most rows held; None: `trainer.layers.tables.DEFAULT_CAPACITY`.
      embedding_dim: the width of a row.
      combiner: how a feature's list of ids is reduced: "mean", "sum" or "sqrtn"
        (a `FeatureConfig` may choose its own).
      placement: "auto" or "default_device": the strategy places the table
        (split over the ps tasks under `parameter_server`).
    """

    name: str
    vocabulary_size: int | None = None
    embedding_dim: int = 0
    initializer: object = None
    optimizer: object = None
    combiner: str = "mean"
    placement: str = "auto"
    key_dtype: str = "int64"
    min_count: int = 1
    ttl_steps: int = 0
    eviction: str | None = "lru"
    mask_id: object = None
    seed: int = 0

    def __post_init__(self):
        where = f"`TableConfig` '{self.name}'"
        rules = [
            (self.embedding_dim >= 1, f"`embedding_dim` ({self.embedding_dim}) must be >= 1"),
            (
                self.initializer is None,
                "takes no `initializer`: a row starts from a value of (`seed`, id); "
                "leave it out, and set `seed`",
            ),
            (
                self.optimizer is None,
                "takes no `optimizer`: the model's optimizer (`optimizer.name`) trains "
                "every table; leave it out",
            ),
            (
                self.combiner in COMBINERS[1:],
                f"`combiner` '{self.combiner}' must be one of sum, mean, sqrtn",
            ),
            (
                self.placement in PLACEMENTS,
                f"`placement` '{self.placement}' must be one of {', '.join(PLACEMENTS)}; the "
                "strategy places the table",
            ),
        ]
        for ok, message in rules:
            if not ok:
                raise UserError(f"{where} {message}.")
        _check_dynamic(
            self.key_dtype,
            self.combiner,
            self.min_count,
            self.ttl_steps,
            self.capacity,
            self.eviction,
            where,
        )

    @property
    def capacity(self) -> int:
        """The `DynamicEmbedding` `capacity`: `vocabulary_size`, or the default."""
        return tables.DEFAULT_CAPACITY if self.vocabulary_size is None else self.vocabulary_size

    def layer(self) -> DynamicEmbedding:
        """The `DynamicEmbedding` that holds the table, named after it."""
        names = ("key_dtype", "combiner", "min_count", "ttl_steps", "eviction", "mask_id", "seed")
        options = {name: getattr(self, name) for name in names}
        width, capacity = self.embedding_dim, self.capacity
        return DynamicEmbedding(width, capacity=capacity, name=self.name, **options)

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> TableConfig:
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One feature looked up in a table, as `keras_rs.layers.FeatureConfig` names it.

    Several features may share one `TableConfig`: they read the same row for
    the same id. The feature's ids are a `[batch]` tensor (one id an example),
    `[batch, n]` or a `tf.RaggedTensor` (a list an example, reduced by the
    combiner); its output is `[batch, embedding_dim]`.

    Attributes:
      name: the feature's name.
      table: the table it is looked up in.
      input_shape: as in Keras-RS, for the reader: the shape comes from the inputs.
      output_shape: as in Keras-RS; if given, its last entry must be the table's width.
      combiner: this feature's combiner ("sum", "mean", "sqrtn"); None: the table's.
    """

    name: str
    table: TableConfig
    input_shape: Sequence[int | None] | None = None
    output_shape: Sequence[int | None] | None = None
    combiner: str | None = None

    def __post_init__(self):
        where = f"`FeatureConfig` '{self.name}'"
        if not isinstance(self.table, TableConfig):
            raise UserError(
                f"{where} `table` is a {type(self.table).__name__}; pass a "
                "`trainer.layers.TableConfig`."
            )
        if self.combiner not in COMBINERS:
            raise UserError(
                f"{where} `combiner` '{self.combiner}' must be one of sum, mean, sqrtn, or None "
                "for the table's."
            )
        width = self.table.embedding_dim
        if self.output_shape and self.output_shape[-1] not in (None, width):
            raise UserError(
                f"{where} `output_shape` {tuple(self.output_shape)} must end with the width "
                f"of table '{self.table.name}' ({width})."
            )

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "table": self.table.get_config(),
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "output_shape": None if self.output_shape is None else list(self.output_shape),
            "combiner": self.combiner,
        }

    @classmethod
    def from_config(cls, config: dict) -> FeatureConfig:
        return cls(**{**config, "table": TableConfig.from_config(config["table"])})


@keras.saving.register_keras_serializable(package="towerflow")
class DynamicEmbeddings(keras.layers.Layer):
    """Features looked up in shared dynamic tables: Keras-RS's `DistributedEmbedding`, growing.

    Built from a dict of `FeatureConfig`s and called on a dict of id tensors
    with the same keys, it returns a dict of `[batch, embedding_dim]` vectors,
    as `keras_rs.layers.DistributedEmbedding` does. Each `TableConfig` becomes
    one `DynamicEmbedding` layer (named after the table), so every strategy
    that takes that layer takes this one; the features of one table are
    looked up (and, in training, admitted) together, once a step.

        users = TableConfig("users", embedding_dim=16, min_count=2)
        embed = DynamicEmbeddings({
            "buyer": FeatureConfig("buyer", users),  # one id an example
            "seller": FeatureConfig("seller", users, combiner="sum"),  # a list, summed
        })
        vectors = embed({"buyer": tf.constant([1, 2]), "seller": tf.constant([[2, 3], [1, 1]])})

    `vectors` holds two `[2, 16]` tensors. Unlike Keras-RS, the tables need
    no vocabulary size and take raw ids of any value; there are no per-id
    `weights`.

    Args:
      feature_configs: `FeatureConfig`s by the key of their input (and output).
    """

    def __init__(self, feature_configs: Mapping[str, FeatureConfig], **kwargs):
        super().__init__(**kwargs)
        if not isinstance(feature_configs, Mapping) or not feature_configs:
            raise UserError(
                f"`DynamicEmbeddings` `feature_configs` must be a non-empty dict of "
                f"`FeatureConfig`s by input key; got {type(feature_configs).__name__}."
            )
        self.feature_configs = dict(feature_configs)
        configs: dict[str, TableConfig] = {}
        for key, feature in self.feature_configs.items():
            table = configs.setdefault(feature.table.name, feature.table)
            if table != feature.table:
                raise UserError(
                    f"`DynamicEmbeddings` feature '{key}': two different `TableConfig`s are "
                    f"named '{table.name}'; give each table its own name, or share one object."
                )
        self.tables = {name: table.layer() for name, table in configs.items()}
        for name, table in self.tables.items():  # TF checkpoints track attributes, not dicts
            setattr(self, f"table_{name}", table)

    def build(self, input_shape=None):
        for table in self.tables.values():
            table.build()

    def __call__(self, inputs, *args, **kwargs):
        # Checked before Keras's `__call__`, which adds lines about the call to any error.
        if not isinstance(inputs, Mapping) or set(inputs) != set(self.feature_configs):
            given = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise UserError(
                f"`DynamicEmbeddings` '{self.name}' takes a dict with the keys "
                f"{sorted(self.feature_configs)}; got {given}."
            )
        for key, ids in inputs.items():
            table = self.tables[self.feature_configs[key].table.name]
            table._check_ids(ids, f"`DynamicEmbeddings` feature '{key}' (table '{table.name}')")
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, training=False):
        outputs = {}
        for name, table in self.tables.items():
            keys = [k for k, f in self.feature_configs.items() if f.table.name == name]
            lists = {key: _as_lists(inputs[key]) for key in keys}
            looked_up = [table._keys(lists[key]) for key in keys]
            sizes = [tf.size(ids) for ids, _ in looked_up]
            valid = [is_id for _, is_id in looked_up]
            vectors = table._vectors(
                tf.concat([ids for ids, _ in looked_up], 0), tf.concat(valid, 0), training
            )
            for key, feature_vectors, feature_valid in zip(
                keys, tf.split(vectors, tf.stack(sizes), num=len(keys)), valid, strict=True
            ):
                combiner = self.feature_configs[key].combiner or table.combiner
                outputs[key] = table._shaped(lists[key], feature_vectors, feature_valid, combiner)
        return {key: outputs[key] for key in self.feature_configs}

    def compute_output_shape(self, input_shape):
        # A list per example is reduced; one id per example (`[batch]`) is a list of one.
        shapes = {}
        for key, shape in input_shape.items():
            width = self.feature_configs[key].table.embedding_dim
            shapes[key] = (*(shape[:-1] if len(shape) > 1 else shape), width)
        return shapes

    def get_config(self) -> dict:
        features = {key: f.get_config() for key, f in self.feature_configs.items()}
        return {**super().get_config(), "feature_configs": features}

    @classmethod
    def from_config(cls, config: dict) -> DynamicEmbeddings:
        features = {k: FeatureConfig.from_config(f) for k, f in config["feature_configs"].items()}
        shared: dict[str, TableConfig] = {}  # one object per table name, as it was built
        for key, feature in features.items():
            table = shared.setdefault(feature.table.name, feature.table)
            features[key] = dataclasses.replace(feature, table=table)
        return cls(**{**config, "feature_configs": features})


def _as_lists(ids):
    """`[batch]` ids as `[batch, 1]`: a list of one id per example, for the combiner."""
    if isinstance(ids, tf.RaggedTensor):
        return ids
    ids = tf.convert_to_tensor(ids)
    return ids[:, None] if ids.shape.rank == 1 else ids


def dynamic_tables(model: keras.Model) -> list[DynamicEmbedding]:
    """Every `DynamicEmbedding` in `model`, nested ones (`DynamicEmbeddings`) included."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, DynamicEmbedding)]


def table_figures(model: keras.Model) -> dict[str, list[dict[str, int]]]:
    """`DynamicEmbedding.figures()` of each dynamic table in `model`, by layer name."""
    return {layer.name: layer.figures() for layer in dynamic_tables(model)}


def portable_layers(model: keras.Model) -> list[Portable]:
    """The layers of `model` whose variables are split into parts, in order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, Portable)]


def table_indexes(model: keras.Model) -> list[tf.Module]:
    """The index of each part of each dynamic table in `model`, in order."""
    return [index for layer in portable_layers(model) for index in layer.indexes()]


def describe_tables(model: keras.Model) -> dict[str, dict]:
    """`DynamicEmbedding.describe()` of each dynamic table in `model`, by layer name."""
    return {layer.name: layer.describe() for layer in dynamic_tables(model)}
