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

Checkpoints and SavedModels hold each shard as its own variable, so restoring
needs the same number of shards: pass `num_shards` to pin it.
"""

from __future__ import annotations

import random

import keras
import tensorflow as tf

from strategies import sharding


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


@keras.saving.register_keras_serializable(package="towerflow")
class ShardedEmbedding(keras.layers.Layer):
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

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int64)  # float ids are exact up to 2**24
        return tf.nn.embedding_lookup([shard.value for shard in self.shards], ids)

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
class ShardedDense(keras.layers.Layer):
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
        self.step.value.assign_add(1)
        scale = tf.cast(1.0 / (1.0 - self.rate), inputs.dtype)
        return tf.where(keep, inputs * scale, tf.zeros_like(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
