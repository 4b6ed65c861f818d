"""A `DynamicEmbedding`'s logical content: the rows of every id, whatever the number of parts.

What the layer's `Portable` methods move between splits of one table (a
checkpoint written with another number of ps members, a warm start):
`export_logical` gathers every part's ids, rows, optimizer slots, counts and
counters into one content; `import_logical` sends each id to its part
(`tables.part_of`) and loads it there, a part over its capacity keeping its
most recently seen ids. The default or fallback rows, which every part
shares, go whole (`shared_variables`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from trainer.layers import tables
from trainer.layers.portable import Slots, with_slots

if TYPE_CHECKING:
    from trainer.layers.dynamic_types import Part, TableLayer


def export_logical(layer: TableLayer, slots: Slots) -> dict[str, np.ndarray]:
    """Every id's row, optimizer slots, admission and last-seen step, count; counters.

    `fresh` marks rows not written since their id was admitted (they read
    the id's initial row). `spare/...` is the spare row past the capacity.
    """
    parts = []
    for part in layer.parts:
        content = part.table.contents()
        held = content.pop("slots")
        stamps = content.pop("stamps")
        content["fresh"] = part.row_stamps.numpy()[held] != stamps
        for name, variable, _ in with_slots(part.rows, slots, "rows"):
            value = variable.numpy()
            content[name], content[f"spare/{name}"] = value[held], value[-1:]
        parts.append(content)
    counters = tables.merged_counters([content.pop("counters") for content in parts])
    # An id's count is in its part's sketch: the parts' largest cell is at least as large.
    sketch = np.max([content.pop("sketch") for content in parts], axis=0)
    # An id's bits are in its part's seen-filter: the parts' union holds them all.
    seen = np.bitwise_or.reduce([content.pop("seen") for content in parts], axis=0)
    merged = {name: np.concatenate([c[name] for c in parts]) for name in parts[0]}
    merged["sketch"], merged["seen"] = sketch, seen
    for name, variable, _ in shared_variables(layer, slots):
        merged[name] = variable.numpy()
    return {**merged, "counters": counters}


def import_logical(layer: TableLayer, content: dict[str, np.ndarray], slots: Slots) -> list[str]:
    """Each id goes to its part (`tables.part_of`); a part over its capacity evicts LRU."""
    keys, last_seen = content["keys"], content["last_seen"]
    owners = tables.part_of(tf.constant(keys, tf.int64), len(layer.parts)).numpy()
    waiting = content["waiting"]
    waiting_owners = tables.part_of(tf.constant(waiting, tf.int64), len(layer.parts)).numpy()
    counters = tables.split_counters(content["counters"], len(layer.parts))
    warnings = []
    for part in layer.parts:
        mine, evicted = _ids_kept(part, np.flatnonzero(owners == part.index), keys, last_seen)
        if evicted:
            warnings.append(
                f"table {layer.name} part {part.index} holds {part.capacity} rows and the "
                f"checkpoint {len(mine) + evicted} of its ids: evicted the {evicted} least "
                "recently seen"
            )
        waits = waiting_owners == part.index
        _load_part(part, content, mine, waits, counters[part.index], evicted, slots)
    for name, variable, _ in shared_variables(layer, slots):
        variable.assign(content[name])
    return warnings


def _ids_kept(
    part: Part, mine: np.ndarray, keys: np.ndarray, last_seen: np.ndarray
) -> tuple[np.ndarray, int]:
    """The positions of `mine` (`part`'s ids) it keeps, in the order of their ids; how many not.

    A part over its capacity evicts the least recently seen first, ties by
    id, as the table evicts.
    """
    evicted = max(0, len(mine) - part.capacity)
    if evicted:
        mine = mine[np.lexsort((keys[mine], last_seen[mine]))[evicted:]]
    return mine[np.argsort(keys[mine], kind="stable")], evicted


def _load_part(
    part: Part,
    content: dict[str, np.ndarray],
    mine: np.ndarray,
    waits: np.ndarray,
    counters,
    evicted: int,
    slots: Slots,
) -> None:
    """Loads `part`'s ids (positions `mine` of `content`) and waiting ids (`waits`) into it.

    Its index takes the ids, their counts and the `counters` (the ids whose
    rows are written marked so, `DynamicTable.mark_written`); its row stamps
    and rows (and their optimizer `slots`) the ids' rows, in the slots the
    index gave them; the other rows start as a new variable would.
    """
    counts = content.get("counts")  # None from a checkpoint written before counts were kept
    sketch = content.get("sketch")  # the parts' largest cells: each part takes them all
    stamps = part.table.load(
        content["keys"][mine],
        content["admitted"][mine],
        content["last_seen"][mine],
        content["waiting"][waits],
        content["waiting_values"][waits],
        counters,
        evicted,
        counts[mine] if counts is not None else None,
        sketch,
        content.get("seen"),  # the parts' union: each part takes it all
    )
    row_stamps = np.full(part.row_stamps.shape, -1, np.int64)
    row_stamps[: len(mine)] = np.where(content["fresh"][mine], -1, stamps)
    part.row_stamps.assign(row_stamps)
    part.table.mark_written(np.arange(len(mine)), lambda at: tf.gather(row_stamps, at))
    for name, variable, initial in with_slots(part.rows, slots, "rows"):
        value = np.full(variable.shape, initial, variable.dtype)
        value[: len(mine)], value[-1] = content[name][mine], content[f"spare/{name}"][0]
        variable.assign(value)


def shared_variables(layer: TableLayer, slots: Slots) -> list[tuple]:
    """`with_slots` of the variable every part shares: the fallback rows or the default row."""
    if layer.fallback is not None:
        return with_slots(layer.fallback, slots, "fallback")
    return with_slots(layer.default_row, slots, "default")
