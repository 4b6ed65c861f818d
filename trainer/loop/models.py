"""Model builders by name, or the user's own as "module.path:function".

A builder is `fn(spec: DataSpec, config: ConfigDict) -> keras.Model`; it gets
the data's shape and class count and `config.model` (by name when its
parameters are named so, in any order; else in that order: `towerflow.calls`). A classifier outputs
`num_classes` logits, or probabilities when its output layer ends in a softmax
(or, for two classes, one sigmoid unit), as Keras Applications models do:
`output_kind` tells which, and the loss and the export follow. A regression
model outputs one value per example. The built-in models output logits and
use `trainer.layers.Dropout`, whose masks do not depend on the replicas.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import ml_collections
import tensorflow as tf

from towerflow import calls
from towerflow.errors import UserError
from towerflow.registry import Registry
from trainer.data import DataSpec
from trainer.layers import Dropout, DynamicEmbedding, ShardedEmbedding
from trainer.layers.table_training import TableOptimizer
from trainer.loop import compiled
from trainer.loop import options as loop_options

Builder = Callable[[DataSpec, ml_collections.ConfigDict], keras.Model]
BUILDER = calls.Signature("build", ("spec", "config"), "keras.Model")
_BUILDERS = Registry("Model")
builder = _BUILDERS.register  # `@builder("name")` registers a built-in model builder


def names() -> list[str]:
    """The built-in model names."""
    return _BUILDERS.names()


def resolve(name: str) -> Builder:
    """The builder for a built-in `name` or a "module.path:function" reference.

    Raises:
      UserError: an unknown name, a module that does not import, or a missing function.
    """
    return _BUILDERS.lookup("model.name", name, "a function returning a keras.Model")


def build(config: ml_collections.ConfigDict, spec: DataSpec) -> keras.Model:
    """Builds `config.model.name` for data described by `spec`.

    Raises:
      UserError: the name does not resolve, a built-in builder rejects the config,
        or the builder returns no keras.Model. An exception from the user's own
        builder is theirs: it keeps its traceback.
    """
    builder = resolve(config.name)
    if config.name not in _BUILDERS:
        model = calls.adapt(builder, BUILDER, f"`model.name` '{config.name}'")(spec, config)
    elif spec.input_shape is None:
        raise UserError(
            f"`model.name` '{config.name}' takes one input tensor, and the data's features "
            "are named (a dict) or of no fixed shape; give a builder of your own whose model "
            "takes them, `--config.model.name=my_pkg.models:build`."
        )
    else:
        model = _built_in(builder, spec, config)
    if not isinstance(model, keras.Model):
        raise UserError(
            f"`model.name` '{config.name}' returned {type(model).__name__}, not a keras.Model."
        )
    _check_sigmoid(model, spec, config.name)
    return model


def _check_sigmoid(model: keras.Model, spec: DataSpec, name: str) -> None:
    """A sigmoid output is one unit for two classes, unless the model brings its own loss.

    A model the user compiled is trained with its own loss (e.g. one sigmoid
    unit and `binary_crossentropy`), which says what its outputs mean: the
    class count is not asked of the data then.
    """
    if spec.num_classes <= 0 or output_kind(model) != "sigmoid" or compiled.is_compiled(model):
        return
    units = model.outputs[0].shape[-1]
    if spec.num_classes != 2 or units != 1:
        raise UserError(
            f"`model.name` '{name}' ends in a sigmoid over {units} outputs, and the data has "
            f"{spec.num_classes} classes (`data.num_classes`); for two classes set "
            "`--config.data.num_classes=2` and end the model in one sigmoid unit, else end it "
            "in `data.num_classes` logits or a softmax (or compile it with its own loss)."
        )


def _built_in(builder: Builder, spec: DataSpec, config: ml_collections.ConfigDict) -> keras.Model:
    """A built-in model; Keras rejecting a value of our `model` config is a config mistake."""
    try:
        return builder(spec, config)
    except UserError:
        raise  # already one line naming the field
    except (ValueError, TypeError) as e:
        raise UserError(
            f"`model.name` '{config.name}' could not be built from the `model` config: "
            f"{str(e).strip().splitlines()[0]}"
        ) from None


def output_kind(model: keras.Model) -> str:
    """What a classifier outputs: "logits", "probabilities" (softmax) or "sigmoid".

    Read from the activation of the layer that makes the model's output (a
    `Dense(..., activation="softmax")`, a `Softmax` or an `Activation` layer);
    a model whose output layer cannot be seen (a subclassed model) outputs logits.
    """
    # A functional or Sequential model lists its layers in order, the output's last.
    if len(getattr(model, "outputs", None) or []) != 1 or not model.layers:
        return "logits"
    layer = model.layers[-1]
    if isinstance(layer, keras.layers.Softmax):
        return "probabilities"
    activation = getattr(getattr(layer, "activation", None), "__name__", "")
    return {"softmax": "probabilities", "sigmoid": "sigmoid"}.get(activation, "logits")


def _outputs(spec: DataSpec) -> int:
    return spec.num_classes if spec.num_classes > 0 else 1


def _regularizer(config: ml_collections.ConfigDict):
    return keras.regularizers.L2(config.weight_decay) if config.weight_decay else None


def _head(x, spec: DataSpec, config: ml_collections.ConfigDict):
    if config.dropout:
        x = Dropout(config.dropout)(x)
    return keras.layers.Dense(_outputs(spec), kernel_regularizer=_regularizer(config))(x)


@builder("mlp")
def mlp(spec: DataSpec, config: ml_collections.ConfigDict) -> keras.Model:
    """Flatten, then `hidden_units` ReLU layers, then the output layer."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    for units in config.hidden_units:
        x = keras.layers.Dense(units, activation="relu", kernel_regularizer=_regularizer(config))(x)
    return keras.Model(inputs, _head(x, spec, config), name="mlp")


def _require_image(spec: DataSpec, name: str) -> None:
    if len(spec.input_shape) != 3:
        raise UserError(
            f"`model.name` '{name}' needs image inputs of shape (height, width, channels); "
            f"the data has shape {spec.input_shape}. Use `--config.model.name=mlp`."
        )


@builder("cnn")
def cnn(spec: DataSpec, config: ml_collections.ConfigDict) -> keras.Model:
    """Two conv blocks (conv, conv, pool), global average pooling, the output layer."""
    _require_image(spec, "cnn")
    inputs = keras.Input(spec.input_shape)
    x = inputs
    for filters in (config.filters, 2 * config.filters):
        for _ in range(2):
            x = keras.layers.Conv2D(
                filters,
                3,
                padding="same",
                activation="relu",
                kernel_regularizer=_regularizer(config),
            )(x)
        x = keras.layers.MaxPooling2D(padding="same")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _head(x, spec, config), name="cnn")


def _batch_norm() -> keras.layers.BatchNormalization:
    """Batch normalization over the global batch: the same statistics under any replicas.

    With more than one replica in sync (built under `mirrored`, `multi_worker`,
    ...), each replica's batch statistics are summed over the replicas in the
    step (Keras's `synchronized`), so the replicas normalize, and update the
    moving statistics, as one device would with the whole batch.
    """
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return keras.layers.BatchNormalization(synchronized=replicas > 1)


def _residual_block(x, filters: int, stride: int, config: ml_collections.ConfigDict):
    shortcut = x
    y = keras.layers.Conv2D(
        filters, 3, stride, padding="same", use_bias=False, kernel_regularizer=_regularizer(config)
    )(x)
    y = _batch_norm()(y)
    y = keras.layers.ReLU()(y)
    y = keras.layers.Conv2D(
        filters, 3, padding="same", use_bias=False, kernel_regularizer=_regularizer(config)
    )(y)
    y = _batch_norm()(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, stride, use_bias=False)(shortcut)
        shortcut = _batch_norm()(shortcut)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))


@builder("resnet")
def resnet(spec: DataSpec, config: ml_collections.ConfigDict) -> keras.Model:
    """A small ResNet: a conv stem, two stages of `blocks` residual blocks, pooling."""
    _require_image(spec, "resnet")
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Conv2D(config.filters, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(_batch_norm()(x))
    for stage, filters in enumerate((config.filters, 2 * config.filters)):
        for block in range(config.blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _residual_block(x, filters, stride, config)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _head(x, spec, config), name="resnet")


@builder("ctr")
def ctr(spec: DataSpec, config: ml_collections.ConfigDict) -> keras.Model:
    """Click-through model: ids -> one embedding table -> `hidden_units` ReLU -> logits.

    `model.embedding` "hashed": a `ShardedEmbedding` of `model.vocab_size` rows
    (under `parameter_server` with a partitioner, split over the ps members);
    "dynamic": a `DynamicEmbedding` of the raw ids, at most `model.capacity`
    rows, admitting ids seen `model.min_count` times, freeing those unseen for
    `model.ttl_steps` steps, evicting by `model.eviction`, ids without a row
    reading `model.fallback_rows` hashed rows. Both are `model.embedding_dim` wide (configs/ctr.py
    sets the fields). Raw ids (int64 or string features, `data.ctr.id_space=raw`)
    go into the hashed table through `keras.layers.Hashing` into `vocab_size`
    rows (distinct ids collide), into the dynamic one as they are; the last
    `model.multi_valued` columns are one list, padded with 0 (or ""), whose
    vectors are summed over sqrt(its length). The table's options, their defaults and
    rules are declared in `trainer.loop.options.TableOptions`.
    """
    vocab, width = config.get("vocab_size"), config.get("embedding_dim")
    if not vocab or not width:
        raise ValueError(
            "it needs `model.vocab_size` and `model.embedding_dim`; use `--config=configs/ctr.py`"
        )
    options = loop_options.TABLES.parse(config)
    kind = options.embedding
    listed = config.get("multi_valued", 0)
    if not 0 <= listed < spec.input_shape[-1]:
        raise UserError(
            f"`model.multi_valued` ({listed}) must be below the {spec.input_shape[-1]} columns "
            "of the data; leave it following `data.ctr.multi_valued` (configs/ctr.py)."
        )
    own = _table_optimizer(options)
    raw = spec.dtype != "float32"  # int64 or string ids over the whole id space
    padding = ("" if spec.dtype == "string" else 0) if raw else None
    inputs = keras.Input(spec.input_shape, dtype=spec.dtype)
    if kind == "dynamic":
        table = DynamicEmbedding(
            width,
            key_dtype="string" if spec.dtype == "string" else "int64",
            capacity=options.capacity or vocab,
            min_count=options.min_count,
            ttl_steps=options.ttl_steps,
            eviction=options.eviction or None,
            fallback_rows=options.fallback_rows,
            fallback_hashes=options.fallback_hashes,
            fallback_combiner=options.fallback_combiner,
            sketch_width=options.sketch_width,
            sketch_depth=options.sketch_depth,
            seen_bits=options.seen_bits,
            mask_id=padding,
            seed=options.table_seed,
            name="embedding",
        )
        table.table_optimizer = own
        x = table(inputs if raw else keras.ops.cast(inputs, "int64"))
    else:
        # `model.table_seed` keys which ids share a row (0: Keras's unsalted hash, as before).
        salt = options.table_seed or None
        ids = keras.layers.Hashing(vocab, salt=salt, name="hashing")(inputs) if raw else inputs
        x = ShardedEmbedding(vocab, width, name="embedding")(ids)
    if listed:
        x = single_and_listed(inputs, x, listed, padding)
    x = keras.layers.Flatten()(x)
    for units in config.hidden_units:
        x = keras.layers.Dense(units, activation="relu", kernel_regularizer=_regularizer(config))(x)
    return keras.Model(inputs, _head(x, spec, config), name="ctr")


def _table_optimizer(options: loop_options.TableOptions) -> TableOptimizer:
    """The dynamic table's own optimizer (`model.table_optimizer`, `model.table_learning_rate`)."""
    name, rate = options.table_optimizer, options.table_learning_rate
    own = TableOptimizer(name or None, rate or None)
    own.check("", ("model.table_optimizer", "model.table_learning_rate"))
    if own.is_own and options.embedding != "dynamic":
        raise UserError(
            f"`model.table_optimizer` ('{name}') and `model.table_learning_rate` ({rate}) train "
            "a dynamic table; set `--config.model.embedding=dynamic`, or leave them unset."
        )
    return own


def single_and_listed(ids, vectors, listed: int, padding):
    """The vectors of the single ids, then the list's (the last `listed`) summed / sqrt(length).

    Args:
      ids: [batch, columns] ids, the last `listed` columns one list padded with `padding`.
      vectors: [batch, columns, width], the vector of each id (padding's: any).

    Returns:
      [batch, columns - listed + 1, width] Keras tensor.
    """
    present = keras.ops.cast(keras.ops.not_equal(ids[:, -listed:], padding), "float32")
    summed = keras.ops.sum(vectors[:, -listed:] * present[:, :, None], axis=1, keepdims=True)
    length = keras.ops.maximum(keras.ops.sum(present, axis=1), 1.0)
    pooled = summed / keras.ops.sqrt(length)[:, None, None]
    return keras.ops.concatenate([vectors[:, :-listed], pooled], axis=1)
