"""Keras 3 layers for distributed training: sharded variables, and dropout by example.

`Dropout` draws its masks by step and by each example's position in the
global batch, so they do not depend on how the batch is split over replicas
(see its docstring). The other layers split their big variable into shards
along axis 0.

Under `parameter_server` with a partitioner (see `strategies.sharding`), a big
embedding table or kernel should not sit whole on one ps member. TF can shard a
variable itself, but a Keras 3 variable cannot wrap TF's `ShardedVariable`;
these layers shard instead. Each shard is an ordinary Keras weight
(`embeddings_0`, `embeddings_1`, ...) holding a contiguous block of rows, the
strategy places the weights round-robin, so consecutive shards land on
different ps members. The math is that of one unsharded variable: the same
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
`parameter_server` its table is split by id over the ps members.
`DynamicEmbeddings` speaks Keras-RS's words (`TableConfig`, `FeatureConfig`):
a dict of features, several of which may share one table.

Each layer family has its module (`sharded`, `dropout`, `dynamic`,
`feature_configs`; `portable` the protocol; beside `dynamic`, `dynamic_parts`
its table's parts, where each goes and what it reports, `dynamic_lookup` a
call's steps from ids to vectors, `dynamic_content` its logical content for
another split; `tables` the dynamic tables' index, its hash tables in
`table_store`, with `table_policy` its admission, count sketch and eviction,
`table_seen` its seen-filter and `table_encoding`
the hashes and packed counts they share, `table_training` who may train a
table's rows: `TableOptimizer`), re-exported here.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from strategies import tf_patches
from trainer.layers import tables
from trainer.layers.dropout import Dropout
from trainer.layers.dynamic import DynamicEmbedding
from trainer.layers.feature_configs import DynamicEmbeddings, FeatureConfig, TableConfig
from trainer.layers.portable import Portable, Slots
from trainer.layers.sharded import ShardedDense, ShardedEmbedding
from trainer.layers.table_training import TableOptimizer

__all__ = [
    "DynamicEmbedding",
    "DynamicEmbeddings",
    "Dropout",
    "FeatureConfig",
    "Portable",
    "ShardedDense",
    "ShardedEmbedding",
    "Slots",
    "TableConfig",
    "TableOptimizer",
    "describe_tables",
    "dynamic_tables",
    "portable_layers",
    "table_figures",
    "table_indexes",
    "tables",
]


def dynamic_tables(model: keras.Model) -> list[DynamicEmbedding]:
    """Every `DynamicEmbedding` in `model`, nested ones (`DynamicEmbeddings`) included."""
    return [layer for layer in tf_patches.flat_layers(model) if isinstance(layer, DynamicEmbedding)]


def table_figures(model: keras.Model) -> dict[str, list[dict[str, int]]]:
    """`DynamicEmbedding.figures()` of each dynamic table in `model`, by layer name."""
    return {layer.name: layer.figures() for layer in dynamic_tables(model)}


def portable_layers(model: keras.Model) -> list[Portable]:
    """The layers of `model` whose variables are split into parts, in order."""
    return [layer for layer in tf_patches.flat_layers(model) if isinstance(layer, Portable)]


def table_indexes(model: keras.Model) -> list[tf.Module]:
    """The index of each part of each dynamic table in `model`, in order."""
    return [index for layer in portable_layers(model) for index in layer.indexes()]


def describe_tables(model: keras.Model) -> dict[str, dict]:
    """`DynamicEmbedding.describe()` of each dynamic table in `model`, by layer name."""
    return {layer.name: layer.describe() for layer in dynamic_tables(model)}
