"""CSV files with a header row (`data.name=csv`), every value checked at start-up."""

from __future__ import annotations

import math
import re

import ml_collections
import tensorflow as tf

from strategies.errors import UserError
from trainer.data.base import (
    Dataset,
    as_labels,
    check_classes,
    check_shape,
    file_dataset,
    gist,
    glob_files,
    listed,
    register,
)
from trainer.data.features import check_named, parse_features


@register("csv")
def _csv(config: ml_collections.ConfigDict) -> Dataset:
    """CSV files with a header row: the label column and the feature columns.

    With `data.features` "" every column but the label is a number, and together
    they make one tensor of `data.input_shape`; else `data.features` names the
    columns to read and their dtypes (float32, int64, string; one value each),
    the features are a dict by column name, and other columns are ignored.
    """
    classes = check_classes("data.num_classes", config.num_classes)
    files = glob_files(config, "CSV")
    first, *others = files["train_files"] + files["eval_files"]
    columns = _header(first)
    for path in others:
        if (header := _header(path)) != columns:
            raise UserError(
                f"CSV file '{path}' has columns {listed(header)}, unlike '{first}' "
                f"({listed(columns)}); give every file the same header."
            )
    if config.label not in columns:
        raise UserError(
            f"`data.label` '{config.label}' is not a column of '{first}'; its columns: "
            f"{listed(columns)}; set `data.label` to the label column."
        )
    label = columns.index(config.label)
    if config.features:
        shape, features = None, _named_columns(config, columns, first)
        inputs = [columns.index(f.name) for f in features]
        # Columns not read still parse (as strings), so every line's count is checked.
        defaults = [[""]] * len(columns)
        for i, feature in zip(inputs, features):
            defaults[i] = [tf.constant(0, feature.dtype) if feature.dtype != tf.string else ""]
        defaults[label] = [0.0]
    else:
        shape = check_shape("data.input_shape", config.input_shape)
        inputs = [i for i in range(len(columns)) if i != label]
        if len(inputs) != math.prod(shape):
            raise UserError(
                f"'{first}' has {len(inputs)} feature columns besides `data.label` "
                f"'{config.label}', but `data.input_shape` {shape} needs {math.prod(shape)}; "
                "make them agree."
            )
        defaults = [[0.0]] * len(columns)
    read_cols = sorted([*inputs, label])
    read_defaults = [defaults[i] for i in read_cols]

    def decode(lines: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        parsed = tf.io.decode_csv(lines, record_defaults=read_defaults, select_cols=read_cols)
        values = dict(zip(read_cols, parsed))
        labels = as_labels(values[label], classes)
        if shape is None:
            return {columns[i]: values[i] for i in inputs}, labels
        return tf.reshape(tf.stack([values[i] for i in inputs], axis=1), [-1, *shape]), labels

    def read(path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TextLineDataset(path).skip(1)  # the header

    # Every value is checked here, with the op training parses with, so a bad one
    # is named by its file and line instead of failing a shuffled batch mid-run.
    sizes = [
        sum(_csv_rows(p, columns, defaults) for p in files[f])
        for f in ("train_files", "eval_files")
    ]
    if config.features:
        layout = f"CSV with `data.features` '{config.features}', label '{config.label}'"
    else:
        layout = f"numeric CSV with `data.label` column '{config.label}'"
    return file_dataset(config, files, read, decode, shape, classes, layout, sizes)


def _named_columns(config: ml_collections.ConfigDict, columns: list[str], path: str) -> list:
    """The features of `data.features`, each one column of `path`.

    Raises:
      UserError: a feature with a shape or `var` (a column holds one value), a
        name that is not a column, or the label among them.
    """
    features = parse_features(config.features)
    for feature in features:
        if feature.shape or feature.variable:
            raise UserError(
                f"`data.features` gives CSV column `{feature.name}` a shape; a column holds "
                f"one value: write it as '{feature.name}:{feature.dtype.name}'."
            )
    check_named(features, config.label, columns, f"CSV file '{path}'", "columns")
    return features


_CSV_LINES_AT_ONCE = 1 << 16  # lines parsed in one op while checking a CSV file


def _csv_rows(path: str, columns: list[str], defaults: list) -> int:
    """Parses every line of a CSV file as training will; returns how many rows it has.

    Args:
      path: the file.
      columns: its header.
      defaults: each column's `record_defaults` (its dtype).

    Raises:
      UserError: a line that does not parse; names the file, line, column and value.
    """
    rows = 0
    for lines in tf.data.TextLineDataset(path).skip(1).batch(_CSV_LINES_AT_ONCE):
        try:
            tf.io.decode_csv(lines, record_defaults=defaults)
        except tf.errors.InvalidArgumentError:
            bad = _first_unparsed(lines, defaults)
            line = rows + bad + 2  # 1-based, after the header
            text = lines[bad : bad + 1]
            raise UserError(_csv_line_error(path, line, text, columns, defaults)) from None
        rows += int(lines.shape[0])
    return rows


def _first_unparsed(lines: tf.Tensor, defaults: list) -> int:
    """The index of the first line that fails to parse on its own (a bisection)."""
    begin, end = 0, int(lines.shape[0])  # the first bad line is in [begin, end)
    while end - begin > 1:
        middle = (begin + end) // 2
        try:
            tf.io.decode_csv(lines[begin:middle], record_defaults=defaults)
            begin = middle
        except tf.errors.InvalidArgumentError:
            end = middle
    return begin


def _csv_line_error(
    path: str, line: int, text: tf.Tensor, columns: list[str], defaults: list
) -> str:
    """One line naming what is wrong with line `line` of a CSV file."""
    try:
        tf.io.decode_csv(text, record_defaults=defaults)
        reason = "does not parse"
    except tf.errors.InvalidArgumentError as error:
        reason = re.sub(r" \[Op:\w+\]$", "", gist(error))
    field = re.match(r"Field (\d+) in record \d+ is not a valid (\w+): (.*)$", reason)
    if field:
        index, value = int(field.group(1)), field.group(3)
        wanted = "an integer" if field.group(2).startswith("int") else "a number"
        return (
            f"CSV file '{path}' line {line}, column `{columns[index]}` (column {index + 1}): "
            f"'{value}' is not {wanted}; fix or remove that line."
        )
    fields = re.match(r"Expect (\d+) fields but have (\d+)", reason)
    if fields:
        return (
            f"CSV file '{path}' line {line} has {fields.group(2)} values, and the header "
            f"{fields.group(1)} columns; fix or remove that line."
        )
    reason = re.sub(r" in record \d+", "", reason)
    return f"CSV file '{path}' line {line} does not parse ({reason}); fix or remove that line."


def _header(path: str) -> list[str]:
    with tf.io.gfile.GFile(path) as f:
        return [name.strip() for name in f.readline().strip().split(",")]
