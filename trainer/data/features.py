"""The feature spec of file sources, `data.features`: "name:dtype:shape[,...]"."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from strategies.errors import UserError

DTYPES = {"float32": tf.float32, "int64": tf.int64}


@dataclasses.dataclass(frozen=True)
class Feature:
    """One fixed-size TFRecord feature, from "name:dtype:shape"."""

    name: str
    dtype: tf.DType
    shape: tuple[int, ...]


def parse_features(text: str) -> list[Feature]:
    """Parses "name:dtype:shape[,name:dtype:shape...]", shapes like 64 or 8x8x1."""
    features = []
    for item in text.split(","):
        name, dtype, dims = (item.strip().split(":") + ["", "", ""])[:3]
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = ()
        if not name or dtype not in DTYPES or not shape or min(shape) < 1:
            raise UserError(
                f"`data.features` '{text}' is not 'name:dtype:shape' with dtype "
                f"{' or '.join(DTYPES)} and a shape like 64 or 8x8x1; "
                "e.g. `--config.data.features=x:float32:8x8x1`."
            )
        features.append(Feature(name, DTYPES[dtype], shape))
    return features
