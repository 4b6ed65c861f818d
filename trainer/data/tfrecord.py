"""`tf.train.Example` records in TFRecord files (`data.name=tfrecord`)."""

from __future__ import annotations

import math

import ml_collections
import tensorflow as tf

from strategies.errors import UserError
from trainer.data.base import (
    Dataset,
    as_labels,
    file_dataset,
    file_spec,
    glob_files,
    register,
)
from trainer.data.features import DTYPES, parse_features


@register("tfrecord")
def _tfrecord(config: ml_collections.ConfigDict) -> Dataset:
    """`tf.train.Example` records with fixed-size features and a scalar label."""
    features = parse_features(config.features)
    shape, classes = file_spec(config)
    values = sum(math.prod(f.shape) for f in features)
    if values != math.prod(shape):
        raise UserError(
            f"`data.features` '{config.features}' holds {values} values but "
            f"`data.input_shape` {shape} needs {math.prod(shape)}; make them agree."
        )
    if config.label_dtype not in DTYPES:
        raise UserError(
            f"Unknown `data.label_dtype` '{config.label_dtype}'; known: {', '.join(DTYPES)} "
            "(int64 for classes, float32 for regression)."
        )
    schema = {f.name: tf.io.FixedLenFeature(f.shape, f.dtype) for f in features}
    schema[config.label] = tf.io.FixedLenFeature([], DTYPES[config.label_dtype])

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        parsed = tf.io.parse_example(serialized, schema)
        flat = [
            tf.reshape(tf.cast(parsed[f.name], tf.float32), [-1, math.prod(f.shape)])
            for f in features
        ]
        x = tf.reshape(tf.concat(flat, axis=1), [-1, *shape])
        return x, as_labels(parsed[config.label], classes)

    layout = (
        f"`tf.train.Example`s with `data.features` '{config.features}' and `data.label` "
        f"'{config.label}' ({config.label_dtype})"
    )
    files = glob_files(config, "TFRecord")
    return file_dataset(config, files, tf.data.TFRecordDataset, decode, shape, classes, layout)
