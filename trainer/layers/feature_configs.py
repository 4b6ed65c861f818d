"""Keras-RS's vocabulary (`TableConfig`, `FeatureConfig`, `DynamicEmbeddings`) over dynamic tables.

A dict of features, several of which may share one table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import keras
import tensorflow as tf

from towerflow.errors import UserError
from trainer.layers import dynamic_lookup, tables
from trainer.layers.dynamic import COMBINERS, DynamicEmbedding, check_dynamic
from trainer.layers.table_training import OPTIMIZER_NAMES, TableOptimizer

PLACEMENTS = ("auto", "default_device")  # Keras-RS's, but "sparsecore" (TPU only)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One dynamic table for `DynamicEmbeddings`, as `keras_rs.layers.TableConfig` names it.

    The first arguments are Keras-RS's, in its order; `vocabulary_size` is
    optional and bounds the rows (a `DynamicEmbedding`'s `capacity`: ids past
    it evict by `eviction`, where Keras-RS's would be an error). The
    rest are `DynamicEmbedding`'s (`key_dtype`, `min_count`, `ttl_steps`,
    `eviction`, `mask_id`, `seed`, `fallback_rows`, `fallback_hashes`,
    `fallback_combiner`, `seen_bits`). Keras-RS's
    `initializer` has no counterpart here: a row starts from a value of (`seed`, id). `optimizer`
    (a name, `trainer.layers.table_training.OPTIMIZER_NAMES`) and
    `learning_rate` give the table its own optimizer (e.g. "adagrad" for the
    tables, Adam for the dense layers); left out, the model's optimizer
    trains the table. Either way the rows are updated sparsely.

    Attributes:
      name: the table's name, also its layer's (TensorBoard's `tables/<name>/...`).
      vocabulary_size: the most rows held; None: `trainer.layers.tables.DEFAULT_CAPACITY`.
      embedding_dim: the width of a row.
      combiner: how a feature's list of ids is reduced: "mean", "sum" or "sqrtn"
        (a `FeatureConfig` may choose its own).
      placement: "auto" or "default_device": the strategy places the table
        (split over the ps members under `parameter_server`).
      optimizer: the name of the table's own optimizer ("sgd", "momentum",
        "adam", "adamw", "adagrad", "ftrl"); None: the model's kind.
      learning_rate: the table's own peak learning rate (the model's schedule
        scaled to it); None: the model's.
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
    eviction: str | None = tables.DEFAULT_EVICTION
    fallback_rows: int = 0
    fallback_hashes: int = tables.FALLBACK_HASHES
    fallback_combiner: str = tables.FALLBACK_COMBINER
    seen_bits: int = tables.SEEN_BITS
    mask_id: object = None
    seed: int = 0
    learning_rate: float | None = None

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
                self.optimizer is None or isinstance(self.optimizer, str),
                f"`optimizer` must be an optimizer's name (one of {', '.join(OPTIMIZER_NAMES)}), "
                f"not a {type(self.optimizer).__name__}; set `learning_rate` beside it",
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
        self.table_optimizer.check(where)
        check_dynamic(
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

    @property
    def table_optimizer(self) -> TableOptimizer:
        """The table's own optimizer (`optimizer`, `learning_rate`), if any."""
        return TableOptimizer(self.optimizer, self.learning_rate)

    def layer(self) -> DynamicEmbedding:
        """The `DynamicEmbedding` that holds the table, named after it."""
        names = (
            "key_dtype",
            "combiner",
            "min_count",
            "ttl_steps",
            "eviction",
            "mask_id",
            "seed",
            "fallback_rows",
            "fallback_hashes",
            "fallback_combiner",
            "seen_bits",
        )
        options = {name: getattr(self, name) for name in names}
        width, capacity = self.embedding_dim, self.capacity
        layer = DynamicEmbedding(width, capacity=capacity, name=self.name, **options)
        layer.table_optimizer = self.table_optimizer
        return layer

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> TableConfig:
        # A table saved before `fallback_hashes` existed read one fallback row per id; one
        # saved before `fallback_combiner`, their sum; one saved before `seen_bits`, the
        # default or fallback rows for every id.
        return cls(**{"fallback_hashes": 1, "fallback_combiner": "sum", "seen_bits": 0, **config})


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
            what = f"`DynamicEmbeddings` feature '{key}' (table '{table.name}')"
            dynamic_lookup.check_ids(ids, table.key_dtype, what)
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, training=False):
        # A table's features are looked up together: `dynamic_lookup`'s steps over the table's
        # public settings and parts, as `DynamicEmbedding.call` takes them for one feature.
        outputs = {}
        for name, table in self.tables.items():
            keys = [k for k, f in self.feature_configs.items() if f.table.name == name]
            lists = {key: _as_lists(inputs[key]) for key in keys}
            looked_up = [dynamic_lookup.keys_of(lists[key], table.mask_id) for key in keys]
            sizes = [tf.size(ids) for ids, _ in looked_up]
            valid = [is_id for _, is_id in looked_up]
            vectors = dynamic_lookup.vectors_by_part(
                table.parts,
                tf.concat([ids for ids, _ in looked_up], 0),
                tf.concat(valid, 0),
                training,
            )
            for key, feature_vectors, feature_valid in zip(
                keys, tf.split(vectors, tf.stack(sizes), num=len(keys)), valid, strict=True
            ):
                combiner = self.feature_configs[key].combiner or table.combiner
                outputs[key] = dynamic_lookup.shaped(
                    lists[key], feature_vectors, feature_valid, combiner, table.output_dim
                )
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
