"""Incremental checkpoints: between two full ones, only the table rows changed since the full one.

With `train.full_checkpoint_every=K` (steps; 0: every checkpoint full), the
`Checkpointer` writes a checkpoint full when it is the first at or past a
multiple of K steps (with `train.checkpoint_every` dividing K: exactly at
the multiples of K), or the first of a run that has no full one to build on
(a fresh `model_dir`, or a restore that re-split the tables). The others
are *deltas* of the last full one, written (synchronously: they are small)
under the same names (`ckpt-<step>`). A delta holds:

* for each part of each `DynamicEmbedding`'s table, the rows changed since
  the full checkpoint (`dynamic_parts.TablePart.changed_since`: the slots whose ids were
  looked up in training since, the free ones and the spare row), with
  their optimizer slots and row stamps, and those slots' numbers;
* everything else whole: the tables' indexes (ids, counts, last-seen steps,
  counters), every other variable (static tables included) with its
  optimizer slots, the optimizer's own variables (its step), the save
  counter;
* `base_step`, the step of its full checkpoint (`ckpt-<base_step>` beside it).

Deltas are cumulative: restoring one is its full checkpoint, then that one
delta replayed over it (`replay`), which gives the same values, bit for
bit, as a full checkpoint written at the delta's step. A row changes only
where a training lookup found it (the optimizers of `trainer.loop.optim` update
a table's rows sparsely, whatever `optimizer.sparse_updates` says), and a
lookup marks the row's slot seen at that step, so the rows seen at or after
the full checkpoint's step (each part's clock then: its `mark`) are all
that changed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import keras
import tensorflow as tf

from strategies import tf_private
from trainer.layers import table_seen, tables
from trainer.loop import optim
from trainer.loop.writes import TracedWrite

BASE_KEY = "delta/.ATTRIBUTES/base_step"  # where a delta names its full checkpoint's step


@dataclasses.dataclass
class Family:
    """One part of a dynamic table: its rows, row stamps and the rows' optimizer slots."""

    part: object  # the `trainer.layers.dynamic_parts.TablePart` (`tables.owner_of` the rows)
    rows: keras.Variable
    stamps: keras.Variable
    slots: list[keras.Variable]

    def variables(self) -> list[keras.Variable]:
        return [self.rows, self.stamps, *self.slots]


@dataclasses.dataclass
class Layout:
    """What a delta saves whole (`small`, by name) and by changed rows (`families`)."""

    small: dict[str, keras.Variable]
    families: list[Family]


def layout(
    variables: list,
    optimizer: keras.optimizers.Optimizer,
    original: Callable = lambda variable: variable,
) -> Layout:
    """The layout of a delta of `variables` (a checkpoint's model variables) and `optimizer`.

    `original(v)` is the model's variable that `v` stands for (`v` itself but
    while `trainer.loop.portable` restores into stand-ins): it finds the table parts.
    """
    position = {id(original(v)): i for i, v in enumerate(variables)}
    families, by_rows = [], set()
    for variable in variables:
        part = tables.owner_of(original(variable))
        if part is not None:
            stamps = variables[position[id(part.row_stamps)]]
            slots = [slot for slot, _ in optim.slots_of(optimizer, variable)]
            families.append(Family(part, variable, stamps, slots))
            by_rows |= {id(v) for v in families[-1].variables()}
    small = {}
    for i, variable in enumerate(variables):
        if id(variable) in by_rows:
            continue
        small[f"v{i}"] = variable
        for k, (slot, _) in enumerate(optim.slots_of(optimizer, variable)):
            small[f"v{i}_slot{k}"] = slot
    for j, variable in enumerate(optim.own_variables(optimizer)):
        small[f"o{j}"] = variable
    return Layout(small, families)


def marks(found: Layout) -> list[int]:
    """Each table part's step now: a delta of a full checkpoint holds rows seen since."""
    return [int(family.part.table.now()) for family in found.families]


class Writer:
    """Writes deltas of a layout's tables: one traced write (`trainer.loop.writes`) for all.

    The changed rows are gathered in the traced function, on each part's own
    member, and written from there; only the prefix, the base step and the
    parts' steps cross from the caller. Eager, each delta would be written
    through a new function wherever the tables live on other members.
    """

    def __init__(self, found: Layout, indexes: list[tf.Module]):
        """`found`: what a delta holds (`layout`); `indexes`: the tables' indexes, held whole."""
        self._families, self._tensors = found.families, tf_private.SavedTensors()
        self._checkpoint = tf.train.Checkpoint(
            small=found.small, tables=indexes, delta=self._tensors
        )
        here = self._checkpoint.save_counter.device  # made here, not in the traced write
        self._write = TracedWrite(self._checkpoint, here, prepare=self._gather)

    def write(
        self, prefix: str, base_step: int, since: list[int], save_counter: tf.Variable
    ) -> str:
        """Writes at `prefix` the delta of the full one of `base_step` (parts' steps `since`)."""
        self._checkpoint.save_counter.assign(save_counter)
        return self._write(prefix, tf.constant(base_step, tf.int64), tf.constant(since, tf.int64))

    def _gather(self, base_step: tf.Tensor, since: tf.Tensor) -> None:
        tensors = {"base_step": tf.identity(base_step)}  # placed here, with the save counter
        for p, family in enumerate(self._families):
            slots, values = family.part.changed_since(since[p], family.variables())
            tensors[f"part{p}_slots"] = slots
            for k, value in enumerate(values):
                tensors[f"part{p}_{k}"] = value
        self._tensors.tensors = tensors


def base_step(path: str) -> int | None:
    """The step of the full checkpoint that checkpoint `path` is a delta of; None if full."""
    reader = tf.compat.v1.train.NewCheckpointReader(path)
    return int(reader.get_tensor(BASE_KEY)) if reader.has_tensor(BASE_KEY) else None


def changed_rows(path: str) -> int:
    """The rows delta `path` holds, over every table part (each part's spare row left out)."""
    shapes = tf.compat.v1.train.NewCheckpointReader(path).get_variable_to_shape_map()
    slots = [k for k in shapes if re.fullmatch(r"delta/\.ATTRIBUTES/part\d+_slots", k)]
    return sum(shapes[key][0] - 1 for key in slots)


def replay(path: str, found: Layout, indexes: list[tf.Module], save_counter: tf.Variable) -> None:
    """Restores delta `path` over its full checkpoint, restored into `found`'s variables.

    Raises:
      AssertionError: the delta does not fit `found` (another model).
    """
    checkpoint = tf.train.Checkpoint(small=found.small, tables=indexes)
    table_seen.restore_matched(checkpoint, path, indexes)
    save_counter.assign(checkpoint.save_counter)
    reader = tf.compat.v1.train.NewCheckpointReader(path)
    for p, family in enumerate(found.families):
        slots = reader.get_tensor(f"delta/.ATTRIBUTES/part{p}_slots")
        for k, variable in enumerate(family.variables()):
            value = variable.numpy()  # whole: a mirrored variable is assigned in every copy
            value[slots] = reader.get_tensor(f"delta/.ATTRIBUTES/part{p}_{k}")
            variable.assign(value)
