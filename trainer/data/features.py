"""The features that file sources read, `data.features`: "name:dtype[:shape|:var][=default],...".

Each item names one feature (a TFRecord feature, a CSV column), its dtype
(float32, int64 or string) and its shape per example: none for a scalar, a
shape like 64 or 8x8x1, or `var` for a list of any length (TFRecord only; a
`tf.RaggedTensor`), and maybe the value that stands in where it is missing
(a CSV value among `data.na_values`, a TFRecord example without it). For example::

    age:float32=0,country:string=unknown,ids:int64:var,img:float32:8x8x1

A row (an example) with a missing value and no default is dropped or an error,
as `data.incomplete` says (see `Missing`).

What the model receives:

- one tensor shaped `data.input_shape`, when `data.features` is "" (TFRecord:
  the float feature `x`; CSV: every column but the label) or is one float32
  feature with a shape, e.g. `x:float32:64`: as before named features existed;
- else a dict of tensors by feature name, each `[batch, *shape]` (ragged
  `[batch, None]` for `var`), in its own dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import tensorflow as tf

from towerflow import renamed
from towerflow.errors import UserError
from trainer.data.base import listed

DTYPES = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}
VARIABLE = "var"  # the shape of a feature of any length
# What becomes of a row with a missing value and no default, `data.incomplete`:
INCOMPLETE = {
    "error": "it is an error naming its file, line and column (the default)",
    "drop": "it is left out, and the rows left out are counted at start-up",
}


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """What `data.features` says of one feature (the loop's `component.Feature` is another thing).

    Attributes:
      name: the TFRecord feature or CSV column.
      dtype: tf.float32, tf.int64 or tf.string.
      shape: per example; () for a scalar, ignored when `variable`.
      variable: any number of values per example (a ragged tensor).
      default: the value where it is missing (as written); None: no default.
    """

    name: str
    dtype: tf.DType
    shape: tuple[int, ...] = ()
    variable: bool = False
    default: str | None = None

    @property
    def size(self) -> int:
        """Values per example (fixed-size features)."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Missing:
    """What a missing value is (`data.na_values`), and what a row that has one becomes.

    Attributes:
      na_values: the CSV values that mean missing (compared without surrounding
        spaces); an empty value always does.
      drop: drop a row with a missing value and no default (`data.incomplete=drop`),
        rather than stop with an error.
    """

    na_values: tuple[str, ...] = ("",)
    drop: bool = False

    def among(self, values: tf.Tensor) -> tf.Tensor:
        """Which of `values` (strings) are missing."""
        stripped = tf.strings.strip(values)[..., None]
        return tf.reduce_any(tf.equal(stripped, tf.constant(self.na_values)), axis=-1)


def missing(config) -> Missing:
    """`data.na_values` and `data.incomplete`, checked.

    Raises:
      UserError: an unknown `data.incomplete`.
    """
    incomplete = config.get("incomplete", "error")
    if incomplete not in INCOMPLETE:
        raise UserError(
            f"Unknown `data.incomplete` '{incomplete}'; known: {', '.join(INCOMPLETE)} "
            "(error: stop at a row with a missing value and no default; drop: leave it out)."
        )
    listed_values = config.get("na_values", "").split(",")
    na_values = ("", *(v.strip() for v in listed_values if v.strip()))
    return Missing(tuple(dict.fromkeys(na_values)), incomplete == "drop")


def parse_features(text: str) -> list[FeatureSpec]:
    """Parses `data.features`, "name:dtype[:shape|:var][=default][,...]".

    Raises:
      UserError: an item that is not of that form, a name given twice, or a
        default that is not of the feature's dtype (or given to a `var` feature).
    """
    features = []
    for item in text.split(","):
        item, equals, default = item.partition("=")
        parts = item.strip().split(":")
        name, dtype, dims = (parts + ["", ""])[:3] if len(parts) <= 3 else ("", "", "")
        shape = () if dims in ("", VARIABLE) else _shape(dims)
        if not name or dtype not in DTYPES or shape is None:
            raise UserError(
                f"`data.features` item '{item.strip()}' is not 'name:dtype[:shape|:var]' with "
                f"dtype {', '.join(DTYPES)} and a shape like 64 or 8x8x1 (none for a "
                "scalar), maybe `=default`; e.g. "
                "`--config.data.features=age:float32=0,ids:int64:var,img:float32:8x8`."
            )
        if name in {f.name for f in features}:
            raise UserError(f"`data.features` '{text}' names `{name}` twice; name it once.")
        default = default.strip() if equals else None
        feature = FeatureSpec(name, DTYPES[dtype], shape, dims == VARIABLE, default)
        features.append(_check_default(feature))
    return features


def _check_default(feature: FeatureSpec) -> FeatureSpec:
    """`feature`, if its default is a value of its dtype (and it is not a `var` feature)."""
    if feature.default is None:
        return feature
    if feature.variable:
        raise UserError(
            f"`data.features` gives `{feature.name}`, a `var` feature, a default; a list of any "
            f"length may be empty instead: write it as '{feature.name}:{feature.dtype.name}:var'."
        )
    try:
        if feature.dtype != tf.string:
            (float if feature.dtype.is_floating else int)(feature.default)
    except ValueError:
        raise UserError(
            f"`data.features` gives `{feature.name}` ({feature.dtype.name}) the default "
            f"'{feature.default}', which is not a {feature.dtype.name}; e.g. "
            f"'{feature.name}:{feature.dtype.name}=0'."
        ) from None
    return feature


def _shape(dims: str) -> tuple[int, ...] | None:
    """ "8x8x1" as (8, 8, 1); None if it is not positive ints joined by "x"."""
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        return None
    return shape if min(shape) >= 1 else None


def one_tensor(features: list[FeatureSpec]) -> bool:
    """Whether `features` reach the model as one float tensor (one float32 feature with a shape)."""
    return len(features) == 1 and features[0].dtype == tf.float32 and bool(features[0].shape)


def check_named(
    features: list[FeatureSpec], label: str, present: Iterable[str], where: str, kind: str
) -> None:
    """Every feature and the label are among the names `present` in the files.

    Args:
      features: the features of `data.features`.
      label: `data.label`.
      present: the feature or column names the files have.
      where: the files, for messages (e.g. "'/data/train-0.csv'").
      kind: what the names are, for messages ("columns" or "features").

    Raises:
      UserError: a name the files do not have, or the label among the features.
    """
    present = sorted(set(present))
    for feature in features:
        if feature.name == label:
            raise UserError(
                f"`data.features` includes `{label}`, the label (`data.label`); the model "
                f"must not see it: drop it from `data.features`."
            )
        if feature.name not in present:
            raise UserError(
                f"`data.features` names `{feature.name}`, which {where} does not have; its "
                f"{kind}: {listed(present)}; fix the name in `data.features`."
            )
    if label not in present:
        raise UserError(
            f"`data.label` '{label}' is not one of the {kind} of {where}: {listed(present)}; "
            "set `data.label` to the label's name."
        )


__getattr__ = renamed.old_names(__name__, {"Feature": "FeatureSpec"}, globals())
