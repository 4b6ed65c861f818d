"""What the modules of a `DynamicEmbedding` see of one another: two small interfaces.

`dynamic_parts`, `dynamic_lookup`, `dynamic_serving` and `dynamic_content`
take a table's layer and its parts by these protocols, so that none of them
imports another (or `dynamic`) for its types: `DynamicEmbedding` is a
`TableLayer`, `dynamic_parts.TablePart` a `Part`. Each names only what
those modules read.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import tensorflow as tf

from trainer.layers.tables import DynamicTable


class TableLayer(Protocol):
    """A dynamic table's layer as its parts and lookups read it: settings, parts, shared rows."""

    name: str
    key_dtype: str
    combiner: str | None
    output_dim: int
    capacity: int
    min_count: int
    ttl_steps: int
    eviction: str | None
    mask_id: Any
    seed: int
    fallback_rows: int
    fallback_hashes: int
    fallback_combiner: str
    sketch_width: int
    sketch_depth: int
    seen_bits: int
    compute_dtype: Any
    parts: list[Part]
    table: DynamicTable  # the first part's
    default_row: Any  # a variable; None with fallback rows
    fallback: Any  # a variable; None without fallback rows

    def defaults(self, keys: tf.Tensor, valid: tf.Tensor, default_row=None) -> tf.Tensor:
        """What each of `keys` reads without a row (zeros where not `valid`)."""

    def add_weight(self, *args, **kwargs) -> Any:
        """A Keras weight of the layer (a part's `rows`, `row_stamps`)."""


class Part(Protocol):
    """One part of a table: its index (`table`), variables and device."""

    layer: TableLayer
    index: int  # which part
    capacity: int
    device: str | None
    table: DynamicTable
    rows: Any  # a Keras variable, `[capacity + 1, output_dim]`
    row_stamps: Any  # a Keras variable, `[capacity + 1]` int64
    frozen: tf.lookup.StaticHashTable | None  # while an export's serving is traced

    def on_device(self) -> AbstractContextManager:
        """On the part's device (its ps member), while the strategy that placed it is current."""
