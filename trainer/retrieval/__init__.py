"""Retrieval: two towers over dynamic tables, trained with in-batch negatives, served as top-k.

The other half of a recommender (ranking is the click models of
docs/recommendation.md): a query tower and an item tower, their dot product
the score, trained with a softmax over the batch's items corrected by how
often the item table has seen each one (log-Q), evaluated by recall@k and
MRR against every item the table holds, and exported as a SavedModel whose
`serving_default` takes the query features and returns the top-k raw item
ids and scores with stock TensorFlow ops.

* `softmax`: the loss (`InBatchSoftmax`, `Negatives`).
* `model`: the `Retrieval` model (loss, metrics, serving), `item_table`.
* `index`: what an export searches (`Catalogue`; `Partitioned`, k-means cells).

`export(model, path)` writes the SavedModel outside a run; inside one the
loop's own exports (`train.export`, versions with `export.every_steps`)
write the same. See docs/retrieval.md.
"""

from __future__ import annotations

import keras

from towerflow.errors import UserError
from trainer.loop import export as loop_export
from trainer.retrieval.index import Catalogue, Partitioned
from trainer.retrieval.model import KS, Retrieval, RetrievalMetrics, item_table
from trainer.retrieval.softmax import InBatchSoftmax, Negatives

__all__ = [
    "KS",
    "Catalogue",
    "InBatchSoftmax",
    "Negatives",
    "Partitioned",
    "Retrieval",
    "RetrievalMetrics",
    "export",
    "item_table",
]


def export(model: Retrieval, path: str) -> str:
    """Writes `model`'s SavedModel at `path`: query features in, top `model.k` item ids out.

    `serving_default` takes the query tower's features (raw ids) and returns
    `item_ids` `[batch, k]` (int64) and `scores`; the items are those the
    table holds now.

    Raises:
      UserError: the table holds fewer items than `model.k`, or than the
        index's partitions. Nothing is written then.
    """
    held = int(keras.ops.size(model.catalogue_ids()))
    if model.k > held:
        raise UserError(
            f"`k` ({model.k}) is more than the {held} items the item table "
            f"'{model.item_table.name}' holds; export with a `k` of at most {held}, or train "
            "on more items first."
        )
    if model.index is not None and model.index.partitions > held:
        raise UserError(
            f"`Partitioned.partitions` ({model.index.partitions}) is more than the {held} items "
            f"held; use at most {held} (e.g. about sqrt(items)), or brute force (`index=None`)."
        )
    return loop_export.export(model, path, None, 0, raw_outputs=True)
