"""`tf.train.Example` records in TFRecord files (`data.name=tfrecord`).

`data.features` names the features to read (see `features.py`): fixed-size
float32, int64 or string features, and `var` ones of any length, read as
`tf.RaggedTensor`s. The label is one scalar, `data.label` of `data.label_dtype`.
At start-up the first records of the first train file are read, so a feature
the files do not have, or have as another dtype, is named before training.
"""

from __future__ import annotations

import math

import ml_collections
import tensorflow as tf
from google.protobuf.message import DecodeError

from strategies.errors import UserError
from trainer.data.base import (
    Dataset,
    as_labels,
    check_classes,
    check_shape,
    file_dataset,
    glob_files,
    register,
)
from trainer.data.features import DTYPES, Feature, check_named, one_tensor, parse_features

_LABEL_DTYPES = {name: DTYPES[name] for name in ("int64", "float32")}
_RECORDS_LOOKED_AT = 100  # records whose feature names and kinds are checked at start-up
_KINDS = {"float_list": tf.float32, "int64_list": tf.int64, "bytes_list": tf.string}


@register("tfrecord")
def _tfrecord(config: ml_collections.ConfigDict) -> Dataset:
    """`tf.train.Example` records with the features of `data.features` and a scalar label."""
    classes = check_classes("data.num_classes", config.num_classes)
    if config.label_dtype not in _LABEL_DTYPES:
        raise UserError(
            f"Unknown `data.label_dtype` '{config.label_dtype}'; known: "
            f"{', '.join(_LABEL_DTYPES)} (int64 for classes, float32 for regression)."
        )
    shape = None
    if config.features:
        features = parse_features(config.features)
    else:  # as before named features: one float feature `x` of `data.input_shape`
        shape = check_shape("data.input_shape", config.input_shape)
        features = [Feature("x", tf.float32, (math.prod(shape),))]
    if one_tensor(features):
        shape = check_shape("data.input_shape", config.input_shape)
        if features[0].size != math.prod(shape):
            raise UserError(
                f"`data.features` '{config.features}' holds {features[0].size} values but "
                f"`data.input_shape` {shape} needs {math.prod(shape)}; make them agree."
            )
    files = glob_files(config, "TFRecord")
    _check_records(files["train_files"][0], features, config.label, config.label_dtype)
    schema = {f.name: _parsed_as(f) for f in features}
    schema[config.label] = tf.io.FixedLenFeature([], _LABEL_DTYPES[config.label_dtype])

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        parsed = tf.io.parse_example(serialized, schema)
        labels = as_labels(parsed.pop(config.label), classes)
        if shape is not None:
            return tf.reshape(parsed[features[0].name], [-1, *shape]), labels
        return parsed, labels

    layout = (
        f"`tf.train.Example`s with `data.features` '{config.features}' and `data.label` "
        f"'{config.label}' ({config.label_dtype})"
    )
    return file_dataset(config, files, tf.data.TFRecordDataset, decode, shape, classes, layout)


def _parsed_as(feature: Feature) -> tf.io.FixedLenFeature | tf.io.RaggedFeature:
    if feature.variable:
        return tf.io.RaggedFeature(feature.dtype, row_splits_dtype=tf.int64)
    return tf.io.FixedLenFeature(feature.shape, feature.dtype)


def _check_records(path: str, features: list[Feature], label: str, label_dtype: str) -> None:
    """The first records of `path` have every feature and the label, of the dtypes named.

    Raises:
      UserError: a name none of them has, or a feature stored as another dtype.
    """
    kinds: dict[str, set[tf.DType]] = {}
    try:
        for record in tf.data.TFRecordDataset(path).take(_RECORDS_LOOKED_AT):
            example = tf.train.Example.FromString(record.numpy())
            for name, value in example.features.feature.items():
                kind = value.WhichOneof("kind")
                kinds.setdefault(name, set()).update([_KINDS[kind]] if kind else [])
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError, DecodeError):
        return  # not TFRecords of Examples: `check` names the file and the error
    if not kinds:
        return  # no records: `check` says so
    check_named(features, label, kinds, f"TFRecord file '{path}'", "features")
    for feature in features:
        stored = kinds[feature.name] - {feature.dtype}
        if stored:
            raise UserError(
                f"`data.features` reads `{feature.name}` as {feature.dtype.name}, and "
                f"'{path}' holds it as {', '.join(sorted(d.name for d in stored))}; "
                "give its dtype in `data.features`."
            )
    stored = kinds[label] - {_LABEL_DTYPES[label_dtype]}
    if stored:
        raise UserError(
            f"`data.label_dtype` is {label_dtype}, and '{path}' holds `data.label` '{label}' "
            f"as {', '.join(sorted(d.name for d in stored))}; set `data.label_dtype` to it."
        )
