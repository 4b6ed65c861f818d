"""CSV files with a header row (`data.name=csv`), every value checked at start-up.

Values are read as text and then converted, so that a missing value (an
empty one, or one of `data.na_values`, e.g. `NA`) is told apart from a bad
one: it takes its feature's default (`age:float32=0` in `data.features`), or
its row is dropped or an error, as `data.incomplete` says. A label of class
names becomes class indices through `data.label_vocabulary` (`labels.py`).
Start-up parses every line with the ops training uses: it names a bad value's
file, line and column, counts the rows (the split sizes) and the rows
dropped, and finds the class names for `data.label_vocabulary=auto`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data import labels
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
from trainer.data.features import FeatureSpec, Missing, check_named, missing, parse_features

_CSV_LINES_AT_ONCE = 1 << 16  # lines parsed in one op while checking a CSV file
_LINES_FILTERED_AT_ONCE = 1024  # lines checked for missing values in one op (`incomplete=drop`)


@register("csv")
def _csv(config: ml_collections.ConfigDict) -> Dataset:
    """CSV files with a header row: the label column and the feature columns.

    With `data.features` "" every column but the label is a number, and together
    they make one tensor of `data.input_shape`; else `data.features` names the
    columns to read and their dtypes (float32, int64, string; one value each)
    and defaults, the features are a dict by column name, and other columns are
    ignored. With `data.label_vocabulary` the label column holds class names.
    """
    names = labels.vocabulary(config)
    classes = 0 if names else check_classes("data.num_classes", config.num_classes)
    files = glob_files(config, "CSV")
    first, columns = _columns(config, files["train_files"] + files["eval_files"])
    features, shape = _features(config, columns, first)
    rows = _Rows(
        tuple(columns), tuple(features), config.label, missing(config), names, bool(config.features)
    )
    # Every value is checked here, with the ops training parses with, so a bad one
    # is named by its file and line instead of failing a shuffled batch mid-run.
    scans = {field: [rows.scan(path) for path in files[field]] for field in files}
    seen = set().union(*(scan.labels for field in scans for scan in scans[field]))
    rows = dataclasses.replace(rows, names=labels.resolved(names, seen, "the CSV files"))
    classes = len(rows.names) or classes
    dropped = {field: sum(scan.dropped for scan in scans[field]) for field in scans}

    def read(path: tf.Tensor) -> tf.data.Dataset:
        lines = tf.data.TextLineDataset(path).skip(1)  # the header
        if not any(dropped.values()):
            return lines
        return lines.batch(_LINES_FILTERED_AT_ONCE).map(rows.complete_lines).unbatch()

    def decode(lines: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        parsed = rows.parse(lines)
        y = parsed.labels if rows.names else as_labels(parsed.labels, classes)
        if shape is None:
            return parsed.features, y
        x = tf.stack([parsed.features[f.name] for f in features], axis=1)
        return tf.reshape(x, [-1, *shape]), y

    sizes = [sum(scan.rows for scan in scans[field]) for field in scans]
    if config.features:
        layout = f"CSV with `data.features` '{config.features}', label '{config.label}'"
    else:
        layout = f"numeric CSV with `data.label` column '{config.label}'"
    notes = tuple(
        f"data: dropped {dropped[field]} of {dropped[field] + size} rows of `data.{field}` "
        "with a missing value and no default (`data.incomplete=drop`)"
        for field, size in zip(scans, sizes)
        if dropped[field]
    )
    return file_dataset(
        config, files, read, decode, shape, classes, layout, sizes, rows.names, notes
    )


def _columns(config: ml_collections.ConfigDict, paths: list[str]) -> tuple[str, list[str]]:
    """The first file and its header's columns, checked: every file has them, the label too."""
    first, *others = paths
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
    return first, columns


def _features(
    config: ml_collections.ConfigDict, columns: list[str], first: str
) -> tuple[list, tuple[int, ...] | None]:
    """The feature columns to read, and the shape of one tensor of them (None: a dict)."""
    if config.features:
        return _named_columns(config, columns, first), None
    shape = check_shape("data.input_shape", config.input_shape)
    features = [FeatureSpec(c, tf.float32) for c in columns if c != config.label]
    if len(features) != math.prod(shape):
        raise UserError(
            f"'{first}' has {len(features)} feature columns besides `data.label` "
            f"'{config.label}', but `data.input_shape` {shape} needs {math.prod(shape)}; "
            "make them agree."
        )
    return features, shape


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


class _Parsed:
    """A batch of lines, parsed: the features, the labels, and what is missing or unknown."""

    def __init__(self, features: dict, labels: tf.Tensor, gaps: dict, known, label_values):
        self.features = features  # by column name, each of its dtype
        self.labels = labels  # class indices with a vocabulary, else float32 values
        self.gaps = gaps  # column name -> which values are missing, with no default
        self.known = known  # which labels are in the vocabulary (or missing)
        self.label_values = label_values  # the label column as written

    @property
    def complete(self) -> tf.Tensor:
        """Which rows have no missing value without a default."""
        gaps = tf.stack(list(self.gaps.values()), axis=0)
        return tf.logical_not(tf.reduce_any(gaps, axis=0))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """How the lines of the CSV files are parsed, as text, then converted column by column.

    Attributes:
      columns: the header.
      features: the feature columns read, with their dtypes and defaults.
      label: the label column.
      missing: which values are missing, and whether a row with one is dropped.
      names: the class names of a string label; `labels.AUTO` while start-up finds
        them; None or () for numeric labels.
      named: whether `data.features` names the features (else every other column is one).
    """

    columns: tuple[str, ...]
    features: tuple[FeatureSpec, ...]
    label: str
    missing: Missing
    names: tuple[str, ...] | str | None
    named: bool = True  # the features come from `data.features` (else: every other column)

    def parse(self, lines: tf.Tensor, every_column: bool = False) -> _Parsed:
        """The features and labels of a batch of lines (every column checked if asked)."""
        wanted = sorted({self.columns.index(f.name) for f in self.features} | {self._label})
        chosen = range(len(self.columns)) if every_column else wanted
        fields = tf.io.decode_csv(
            lines, [[""]] * len(chosen), select_cols=None if every_column else wanted
        )
        text = {self.columns[i]: value for i, value in zip(chosen, fields)}
        features, gaps = {}, {}
        for feature in self.features:
            value, absent = text[feature.name], self.missing.among(text[feature.name])
            if feature.default is None:
                gaps[feature.name] = absent
            if feature.dtype == tf.string:  # as written (a missing one's row never trains)
                if feature.default is not None:
                    value = tf.where(absent, feature.default, value)
                features[feature.name] = value
                continue
            # Where the row is dropped any number will do, so it parses.
            fill = "0" if feature.default is None else feature.default
            value = tf.where(absent, fill, tf.strings.strip(value))
            features[feature.name] = tf.strings.to_number(value, feature.dtype)
        label_values = tf.strings.strip(text[self.label])
        gaps[self.label] = self.missing.among(label_values)
        if isinstance(self.names, tuple) and self.names:
            y, known = labels.indices(label_values, self.names)
            known = tf.logical_or(known, gaps[self.label])
        else:
            known = tf.ones_like(gaps[self.label])
            y = tf.zeros_like(label_values, tf.float32)
            if self.names is None or self.names == ():
                y = tf.strings.to_number(tf.where(gaps[self.label], "0", label_values))
        return _Parsed(features, y, gaps, known, label_values)

    @property
    def _label(self) -> int:
        return self.columns.index(self.label)

    def complete_lines(self, lines: tf.Tensor) -> tf.Tensor:
        """The lines of a batch without a missing value that has no default."""
        return tf.boolean_mask(lines, self.parse(lines).complete)

    def scan(self, path: str) -> labels.Scan:
        """Parses every line of a CSV file as training will.

        Raises:
          UserError: a line that does not parse, a missing value without a default
            (unless `data.incomplete=drop`), or a label not in the vocabulary; names
            the file, line, column and value.
        """
        rows = dropped = 0
        seen: set[str] = set()
        for lines in tf.data.TextLineDataset(path).skip(1).batch(_CSV_LINES_AT_ONCE):
            first_line = rows + dropped + 2  # 1-based, after the header
            try:
                parsed = self.parse(lines, every_column=True)
            except tf.errors.InvalidArgumentError:
                bad = _first_unparsed(lines, lambda part: self.parse(part, every_column=True))
                raise UserError(self._line_error(path, first_line + bad, lines[bad])) from None
            complete = parsed.complete.numpy()
            if not complete.all() and not self.missing.drop:
                raise self._gap_error(path, first_line, parsed, int((~complete).argmax()))
            unknown = complete & ~parsed.known.numpy()
            if unknown.any():
                at = int(unknown.argmax())
                value = parsed.label_values[at].numpy().decode()
                raise labels.unknown(f"CSV file '{path}' line {first_line + at}", value, self.names)
            if self.names == labels.AUTO:
                kept = tf.boolean_mask(parsed.label_values, complete)
                seen.update(v.decode() for v in tf.unique(kept).y.numpy())
            rows += int(complete.sum())
            dropped += int((~complete).sum())
        return labels.Scan(rows, dropped, frozenset(seen))

    def _gap_error(self, path: str, first_line: int, parsed: _Parsed, at: int) -> UserError:
        """The error for row `at` of a batch, which has a missing value and no default."""
        column = next(name for name, gap in parsed.gaps.items() if bool(gap[at]))
        where = f"CSV file '{path}' line {first_line + at}, column `{column}`"
        drop = "set `--config.data.incomplete=drop` to leave such rows out"
        if column == self.label:
            fix = f"a label has no default: {drop}"
        elif not self.named:
            named = f"'{column}:float32=0'"
            fix = f"{drop}, or name the columns in `data.features` with defaults ({named}, ...)"
        else:
            dtype = next(f.dtype.name for f in self.features if f.name == column)
            fix = (
                f"give `{column}` a default in `data.features` (e.g. '{column}:{dtype}=0'), or "
                f"{drop}"
            )
        return UserError(f"{where} is missing (`data.na_values`); {fix}.")

    def _line_error(self, path: str, line: int, text: tf.Tensor) -> str:
        """One line naming what is wrong with line `line` of a CSV file."""
        try:
            values = tf.io.decode_csv(text[None], [[""]] * len(self.columns))
        except tf.errors.InvalidArgumentError as error:
            return _csv_line_error(path, line, error)
        where = f"CSV file '{path}' line {line}"
        numeric = [(f.name, f.dtype) for f in self.features if f.dtype != tf.string]
        if not self.names:
            numeric.append((self.label, tf.float32))
        for name, dtype in numeric:
            index = self.columns.index(name)
            value = tf.strings.strip(values[index])
            if bool(self.missing.among(value)[0]):
                continue
            try:
                tf.strings.to_number(value, dtype)
            except tf.errors.InvalidArgumentError:
                written = value[0].numpy().decode()
                wanted = "an integer" if dtype.is_integer else "a number"
                fix = "fix or remove that line"
                if name == self.label:
                    fix = (
                        "for class names as labels set `--config.data.label_vocabulary=auto` "
                        "(or list them in order); else fix or remove that line"
                    )
                return (
                    f"{where}, column `{name}` (column {index + 1}): '{written}' is not "
                    f"{wanted}; {fix}."
                )
        return f"{where} does not parse; fix or remove that line."


def _first_unparsed(lines: tf.Tensor, parse) -> int:
    """The index of the first line that fails to parse on its own (a bisection)."""
    begin, end = 0, int(lines.shape[0])  # the first bad line is in [begin, end)
    while end - begin > 1:
        middle = (begin + end) // 2
        try:
            parse(lines[begin:middle])
            begin = middle
        except tf.errors.InvalidArgumentError:
            end = middle
    return begin


def _csv_line_error(path: str, line: int, error: tf.errors.InvalidArgumentError) -> str:
    """One line naming why line `line` of a CSV file does not split into its columns."""
    reason = re.sub(r" \[Op:\w+\]$", "", gist(error))
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
