"""`tf.train.Example` records in TFRecord files (`data.name=tfrecord`).

`data.features` names the features to read (see `features.py`): fixed-size
float32, int64 or string features, and `var` ones of any length, read as
`tf.RaggedTensor`s, each maybe with a default for an example that lacks it.
The label is one scalar, `data.label` of `data.label_dtype`, or a class name
with `data.label_vocabulary` (`labels.py`). At start-up the first records of
the first train file are read, so a feature the files do not have, or have as
another dtype, is named before training; then every record is looked at (its
features' presence and its label only), so an example that lacks a feature
without a default, or has a label not in the vocabulary, is named by its file
and record (or, with `data.incomplete=drop`, left out and counted). That look
parses only those features, in parallel: 400,000 records of 4 features took
2-4 s on the project's shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

from towerflow.errors import UserError
from trainer.data import labels
from trainer.data.base import (
    Dataset,
    as_labels,
    check_classes,
    check_shape,
    file_dataset,
    glob_files,
    register,
)
from trainer.data.features import (
    DTYPES,
    FeatureSpec,
    Missing,
    check_named,
    missing,
    one_tensor,
    parse_features,
)

_LABEL_DTYPES = {name: DTYPES[name] for name in ("int64", "float32")}
_RECORDS_LOOKED_AT = 100  # records whose feature names and kinds are checked at start-up
_RECORDS_SCANNED_AT_ONCE = 4096  # records whose presence is checked in one op at start-up
_RECORDS_FILTERED_AT_ONCE = 1024  # records checked in one op for `incomplete=drop`
_KINDS = {"float_list": tf.float32, "int64_list": tf.int64, "bytes_list": tf.string}


@register("tfrecord")
def _tfrecord(config: ml_collections.ConfigDict) -> Dataset:
    """`tf.train.Example` records with the features of `data.features` and a scalar label."""
    names = labels.vocabulary(config)
    classes = 0 if names else check_classes("data.num_classes", config.num_classes)
    if config.label_dtype not in _LABEL_DTYPES:
        raise UserError(
            f"Unknown `data.label_dtype` '{config.label_dtype}'; known: "
            f"{', '.join(_LABEL_DTYPES)} (int64 for classes, float32 for regression; for "
            "class names set `data.label_vocabulary`)."
        )
    label_dtype = tf.string if names else _LABEL_DTYPES[config.label_dtype]
    features, shape = _features(config)
    files = glob_files(config, "TFRecord")
    _check_records(files["train_files"][0], features, config.label, label_dtype)
    records = _Records(tuple(features), config.label, label_dtype, missing(config), names)
    scans = {field: [records.scan(path) for path in files[field]] for field in files}
    seen = set().union(*(scan.labels for field in scans for scan in scans[field]))
    records = dataclasses.replace(records, names=labels.resolved(names, seen, "the TFRecord files"))
    classes = len(records.names) or classes
    dropped = {field: sum(scan.dropped for scan in scans[field]) for field in scans}
    schema = {f.name: _parsed_as(f) for f in features}
    schema[config.label] = tf.io.FixedLenFeature([], label_dtype)

    def read(path: tf.Tensor) -> tf.data.Dataset:
        serialized = tf.data.TFRecordDataset(path)
        if not any(dropped.values()):
            return serialized
        batches = serialized.batch(_RECORDS_FILTERED_AT_ONCE)
        return batches.map(records.complete_records).unbatch()

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        parsed = tf.io.parse_example(serialized, schema)
        y = parsed.pop(config.label)
        y = labels.indices(y, records.names)[0] if records.names else as_labels(y, classes)
        if shape is not None:
            return tf.reshape(parsed[features[0].name], [-1, *shape]), y
        return parsed, y

    label_kind = "class names" if names else config.label_dtype
    layout = (
        f"`tf.train.Example`s with `data.features` '{config.features}' and `data.label` "
        f"'{config.label}' ({label_kind})"
    )
    notes = tuple(
        f"data: dropped {dropped[field]} of {dropped[field] + size} examples of `data.{field}` "
        "that lack a feature without a default (`data.incomplete=drop`)"
        for field, size in ((f, sum(s.rows for s in scans[f])) for f in scans)
        if dropped[field]
    )
    return file_dataset(
        config, files, read, decode, shape, classes, layout, (None, None), records.names, notes
    )


def _features(config: ml_collections.ConfigDict) -> tuple[list[FeatureSpec], tuple | None]:
    """The features to read, and the shape of one tensor of them (None: a dict of features).

    Raises:
      UserError: a bad `data.features`, or one tensor whose size `data.input_shape` does
        not match.
    """
    if not config.features:  # as before named features: one float feature `x`
        shape = check_shape("data.input_shape", config.input_shape)
        return [FeatureSpec("x", tf.float32, (math.prod(shape),))], shape
    features = parse_features(config.features)
    if not one_tensor(features):
        return features, None
    shape = check_shape("data.input_shape", config.input_shape)
    if features[0].size != math.prod(shape):
        raise UserError(
            f"`data.features` '{config.features}' holds {features[0].size} values but "
            f"`data.input_shape` {shape} needs {math.prod(shape)}; make them agree."
        )
    return features, shape


def _parsed_as(feature: FeatureSpec) -> tf.io.FixedLenFeature | tf.io.RaggedFeature:
    if feature.variable:
        return tf.io.RaggedFeature(feature.dtype, row_splits_dtype=tf.int64)
    if feature.default is None:
        return tf.io.FixedLenFeature(feature.shape, feature.dtype)
    value = feature.default if feature.dtype == tf.string else float(feature.default)
    default = np.full(feature.shape, value, dtype=object if feature.dtype == tf.string else None)
    return tf.io.FixedLenFeature(feature.shape, feature.dtype, default_value=default.tolist())


@dataclasses.dataclass(frozen=True)
class _Records:
    """Which records are complete, and their labels: what start-up checks of every record.

    Attributes:
      features: the features read, with their defaults.
      label: the label feature.
      label_dtype: how it is stored (tf.string for class names).
      missing: whether a record that lacks a feature without a default is dropped.
      names: the class names; `labels.AUTO` while start-up finds them; None or ().
    """

    features: tuple[FeatureSpec, ...]
    label: str
    label_dtype: tf.DType
    missing: Missing
    names: tuple[str, ...] | str | None

    @property
    def _needed(self) -> list[str]:
        """What a record must hold: the fixed features without a default, and the label."""
        needed = [f.name for f in self.features if f.default is None and not f.variable]
        return [*needed, self.label]

    def presence(self, serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Which records hold each of `_needed`, and the labels.

        Returns:
          (bool [needed, records], the labels as stored, one per record, 0 or "" where none).
        """
        dtypes = {f.name: f.dtype for f in self.features} | {self.label: self.label_dtype}
        schema = {
            name: tf.io.RaggedFeature(dtypes[name], row_splits_dtype=tf.int64)
            for name in self._needed
        }
        parsed = tf.io.parse_example(serialized, schema)
        held = tf.stack([parsed[name].row_lengths() > 0 for name in self._needed])
        nothing = "" if self.label_dtype == tf.string else 0
        return held, parsed[self.label][:, :1].to_tensor(default_value=nothing)[:, 0]

    def _look(self, serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """What `scan` needs of a batch: `presence`, and which labels are in the vocabulary."""
        held, values = self.presence(serialized)
        known = tf.ones_like(held[0])
        if isinstance(self.names, tuple) and self.names:
            known = labels.indices(values, self.names)[1]
        return held, known, values

    def complete_records(self, serialized: tf.Tensor) -> tf.Tensor:
        """The records of a batch that hold every feature without a default, and the label."""
        held, _ = self.presence(serialized)
        return tf.boolean_mask(serialized, tf.reduce_all(held, axis=0))

    def scan(self, path: str) -> labels.Scan:
        """Looks at every record of a file: what it holds, and its label.

        A file that is not TFRecords of Examples is left to `Dataset.check`, which names it.

        Raises:
          UserError: a record that lacks a feature without a default (unless
            `data.incomplete=drop`), or whose label is not in the vocabulary.
        """
        rows = dropped = 0
        seen: set[str] = set()
        batches = tf.data.TFRecordDataset(path).batch(_RECORDS_SCANNED_AT_ONCE)
        # Parsed in parallel, in order; only what is needed comes back to Python.
        looked_at = batches.map(self._look, num_parallel_calls=tf.data.AUTOTUNE)
        try:
            for held, known, values in looked_at.prefetch(tf.data.AUTOTUNE):
                held, known = held.numpy(), known.numpy()
                first = rows + dropped + 1  # records are counted from 1
                complete = held.all(axis=0)
                if not complete.all() and not self.missing.drop:
                    at = int((~complete).argmax())
                    lacked = self._needed[int((~held[:, at]).argmax())]
                    raise self._lack_error(path, first + at, lacked)
                if (complete & ~known).any():
                    at = int((complete & ~known).argmax())
                    where = f"TFRecord file '{path}' record {first + at}"
                    raise labels.unknown(where, values[at].numpy().decode(), self.names)
                if self.names == labels.AUTO:
                    kept = tf.strings.strip(tf.boolean_mask(values, complete))
                    seen.update(v.decode() for v in tf.unique(kept).y.numpy())
                rows += int(complete.sum())
                dropped += int((~complete).sum())
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError):
            pass  # not TFRecords of Examples (or a feature of another kind): `check` names it
        return labels.Scan(rows, dropped, frozenset(seen))

    def _lack_error(self, path: str, record: int, name: str) -> UserError:
        where = f"TFRecord file '{path}' record {record} lacks `{name}`"
        if name == self.label:
            fix = "a label has no default: set `--config.data.incomplete=drop` to leave such"
            return UserError(f"{where}; {fix} examples out.")
        dtype = next(f.dtype.name for f in self.features if f.name == name)
        return UserError(
            f"{where}; give it a default in `data.features` (e.g. '{name}:{dtype}=0'), or set "
            "`--config.data.incomplete=drop` to leave such examples out."
        )


def _check_records(
    path: str, features: list[FeatureSpec], label: str, label_dtype: tf.DType
) -> None:
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
    stored = kinds[label] - {label_dtype}
    if stored and label_dtype == tf.string:
        raise UserError(
            f"`data.label_vocabulary` reads `data.label` '{label}' as class names, and '{path}' "
            f"holds it as {', '.join(sorted(d.name for d in stored))}; set "
            "`--config.data.label_vocabulary=` (empty) for numeric labels."
        )
    if stored:
        raise UserError(
            f"`data.label_dtype` is {label_dtype.name}, and '{path}' holds `data.label` '{label}' "
            f"as {', '.join(sorted(d.name for d in stored))}; set `data.label_dtype` to it "
            "(class names: set `data.label_vocabulary`)."
        )
