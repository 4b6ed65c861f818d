"""The features that file sources read, `data.features`: "name:dtype[:shape|:var],...".

Each item names one feature (a TFRecord feature, a CSV column), its dtype
(float32, int64 or string) and its shape per example: none for a scalar, a
shape like 64 or 8x8x1, or `var` for a list of any length (TFRecord only; a
`tf.RaggedTensor`). For example::

    age:float32,country:string,ids:int64:var,img:float32:8x8x1

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

from strategies.errors import UserError
from trainer.data.base import listed

DTYPES = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}
VARIABLE = "var"  # the shape of a feature of any length


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature of `data.features`.

    Attributes:
      name: the TFRecord feature or CSV column.
      dtype: tf.float32, tf.int64 or tf.string.
      shape: per example; () for a scalar, ignored when `variable`.
      variable: any number of values per example (a ragged tensor).
    """

    name: str
    dtype: tf.DType
    shape: tuple[int, ...] = ()
    variable: bool = False

    @property
    def size(self) -> int:
        """Values per example (fixed-size features)."""
        return math.prod(self.shape)


def parse_features(text: str) -> list[Feature]:
    """Parses `data.features`, "name:dtype[:shape|:var][,...]".

    Raises:
      UserError: an item that is not of that form, or a name given twice.
    """
    features = []
    for item in text.split(","):
        parts = item.strip().split(":")
        name, dtype, dims = (parts + ["", ""])[:3] if len(parts) <= 3 else ("", "", "")
        shape = () if dims in ("", VARIABLE) else _shape(dims)
        if not name or dtype not in DTYPES or shape is None:
            raise UserError(
                f"`data.features` item '{item.strip()}' is not 'name:dtype[:shape|:var]' with "
                f"dtype {', '.join(DTYPES)} and a shape like 64 or 8x8x1 (none for a "
                "scalar); e.g. `--config.data.features=age:float32,ids:int64:var,img:float32:8x8`."
            )
        if name in {f.name for f in features}:
            raise UserError(f"`data.features` '{text}' names `{name}` twice; name it once.")
        features.append(Feature(name, DTYPES[dtype], shape, dims == VARIABLE))
    return features


def _shape(dims: str) -> tuple[int, ...] | None:
    """ "8x8x1" as (8, 8, 1); None if it is not positive ints joined by "x"."""
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        return None
    return shape if min(shape) >= 1 else None


def one_tensor(features: list[Feature]) -> bool:
    """Whether `features` reach the model as one float tensor (one float32 feature with a shape)."""
    return len(features) == 1 and features[0].dtype == tf.float32 and bool(features[0].shape)


def check_named(
    features: list[Feature], label: str, present: Iterable[str], where: str, kind: str
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
