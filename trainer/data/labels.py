"""String labels of the file sources: `data.label_vocabulary`, the class names in order.

A label column (CSV) or feature (TFRecord) that holds class names, e.g.
`Adelie`, `Chinstrap`, `Gentoo`, becomes class indices through the
vocabulary: `data.label_vocabulary=Adelie,Chinstrap,Gentoo` (index = position),
or `auto`: the sorted distinct values the train and eval files hold, read at
start-up (and written to `config.json`, so a run says which index is which).
The class count is then the vocabulary's length. The names reach
`results.json`, TensorBoard's per-class eval accuracy and the export, which
returns each example's class name beside its index.

The lookup is a comparison with a constant (no table), so it runs in any
input pipeline, a parameter-server worker's included.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data.base import listed

AUTO = "auto"  # the vocabulary is the sorted distinct label values of the files


@dataclasses.dataclass(frozen=True)
class Scan:
    """What start-up found in one file: rows (records) kept and dropped, label values seen."""

    rows: int
    dropped: int
    labels: frozenset[str]


def vocabulary(config: ml_collections.ConfigDict) -> tuple[str, ...] | str | None:
    """`data.label_vocabulary`: None (numeric labels), `AUTO`, or the class names in order.

    Raises:
      UserError: fewer than two names, or a name given twice.
    """
    text = config.get("label_vocabulary", "").strip()
    if not text:
        return None
    if text == AUTO:
        return AUTO
    names = tuple(name.strip() for name in text.split(","))
    twice = sorted({name for name in names if names.count(name) > 1})
    if len(names) < 2 or twice or "" in names:
        problem = f"names {', '.join(twice)} twice" if twice else "has not two names"
        raise UserError(
            f"`data.label_vocabulary` '{text}' {problem}; give the class names in order, each "
            "once, e.g. `--config.data.label_vocabulary=Adelie,Chinstrap,Gentoo`, or `auto`."
        )
    return names


def indices(values: tf.Tensor, names: tuple[str, ...]) -> tuple[tf.Tensor, tf.Tensor]:
    """Each label value's class index (int32), and whether it is one of `names`.

    A value that is no class gets index 0; the start-up scan makes sure none reaches training.
    """
    equal = tf.equal(tf.strings.strip(values)[:, None], tf.constant(names)[None, :])
    return tf.argmax(tf.cast(equal, tf.int32), axis=1, output_type=tf.int32), tf.reduce_any(
        equal, axis=1
    )


def unknown(where: str, value: str, names: tuple[str, ...]) -> UserError:
    """The error for a label value that is not in the vocabulary, found at `where`."""
    return UserError(
        f"{where}: the label '{value}' is not in `data.label_vocabulary` ({listed(list(names))}); "
        "add it to the vocabulary (or use `auto`), or fix that value."
    )


def resolved(names: tuple[str, ...] | str | None, seen: set[str], where: str) -> tuple[str, ...]:
    """The class names: `names`, or with `AUTO` the sorted values `seen` in the files.

    Raises:
      UserError: `auto` found fewer than two distinct values.
    """
    if names != AUTO:
        return names or ()
    found = tuple(sorted(seen))
    if len(found) < 2:
        raise UserError(
            f"`data.label_vocabulary` 'auto' found {len(found)} distinct label value(s) in "
            f"{where} ({listed(list(found))}); a classifier needs at least two classes."
        )
    return found
