"""`ShardedEmbedding` and `ShardedDense`: a big variable split into shards of rows.

Each shard is an ordinary Keras weight holding a contiguous block of rows; the
active sharding policy (`strategies.sharding`) says how many. The math is that
of one unsharded variable.
"""

from __future__ import annotations

import abc

import keras
import numpy as np
import tensorflow as tf

from strategies import sharding, tf_patches
from trainer.layers.portable import Portable, Slots, with_slots


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
            per_shard = [with_slots(shard, slots, name) for shard in shards]
            for column in zip(*per_shard, strict=True):  # the value's shards, then each slot's
                content[column[0][0]] = np.concatenate([v.numpy() for _, v, _ in column])
        return content

    def import_logical(self, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
        for name, shards in self._sharded().items():
            bounds = np.cumsum([shard.shape[0] for shard in shards])[:-1]
            per_shard = [with_slots(shard, slots, name) for shard in shards]
            for column in zip(*per_shard, strict=True):  # the value's shards, then each slot's
                for (_, variable, _), rows in zip(column, np.split(content[column[0][0]], bounds)):
                    variable.assign(rows)
        return []


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
