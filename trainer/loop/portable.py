"""Restoring a checkpoint written with another split of the tables and sharded layers.

A checkpoint holds each part of a `trainer.layers.Portable` layer (a shard of
a `ShardedEmbedding` or `ShardedDense`, the part of a `DynamicEmbedding`'s
table on one ps member) as variables of its own in the `Checkpointer`'s list of
model variables, with the optimizer's slots beside each. When that list
differs from the model's only by how such layers are split (a cluster of 2 ps
members restored under `one_device`, or on 3 ps members), `plan` finds each
layer's split in the checkpoint, and `restore`:

1. builds a `twin` of each layer split as in the checkpoint, on this host,
   and an optimizer of the same kind over the checkpoint's variables;
2. restores the checkpoint into those twins, that optimizer and the model's
   other variables, through the structure that wrote it;
3. moves each twin's logical content (`export_logical`: a whole table or
   kernel, or every id's row, slots, counts and last-seen step) into the
   model's layer (`import_logical`), and the step and the other variables'
   slots into the model's optimizer.

Any other difference (an ordinary layer's shape, a table's capacity) finds no
plan, and the checkpoint is refused as one of another model. While it runs,
the host holds a second copy of the model and its optimizer slots.
Checkpoints written before tables were listed in them (`tables`) restore
into the same split only.
"""

from __future__ import annotations

import dataclasses
import os

import keras
import numpy as np
import tensorflow as tf

from trainer import layers
from trainer.layers import table_seen
from trainer.loop import deltas, optim

Segment = keras.Variable | layers.Portable  # an ordinary variable, or a split layer's


@dataclasses.dataclass
class RestorePlan:
    """Each split layer of a model and its number of parts in a checkpoint."""

    segments: list[Segment]  # the model's variables, a split layer's together
    parts: dict[int, int]  # id of a split layer -> its parts in the checkpoint

    def resplit(self) -> list[layers.Portable]:
        """The layers split otherwise in the checkpoint than in the model."""
        return [s for s in self.segments if _is_layer(s) and self.parts[id(s)] != s.num_parts]


def _is_layer(segment: Segment) -> bool:
    return isinstance(segment, layers.Portable)


def plan(model: keras.Model, shapes: list[tuple[int, ...]]) -> RestorePlan | None:
    """How the checkpoint's model variables of `shapes` map to `model`'s; None if they do not.

    They map when each of `model`'s variables has its shape there, in order,
    except that each split layer's variables may be split into another number
    of parts.
    """
    segments = _segments(model)
    if segments is None:
        return None
    parts = _match(segments, [tuple(s) for s in shapes], 0)
    if parts is None:
        return None
    split = [s for s in segments if _is_layer(s)]
    return RestorePlan(segments, {id(layer): n for layer, n in zip(split, parts, strict=True)})


def _segments(model: keras.Model) -> list[Segment] | None:
    """`model.variables` with each split layer's variables as the layer; None if interleaved."""
    owners = {id(v): layer for layer in layers.portable_layers(model) for v in layer.variables}
    segments: list[Segment] = []
    for variable in model.variables:
        layer = owners.get(id(variable))
        if layer is None:
            segments.append(variable)
        elif not segments or segments[-1] is not layer:
            if any(s is layer for s in segments):
                return None
            segments.append(layer)
    return segments


def _match(segments: list[Segment], shapes: list[tuple], start: int) -> list[int] | None:
    """The parts of each split layer in `segments` that give `shapes[start:]`, or None."""
    for at, segment in enumerate(segments):
        if _is_layer(segment):
            return _match_layer(segment, segments[at + 1 :], shapes, start)
        if start >= len(shapes) or shapes[start] != tuple(segment.shape):
            return None
        start += 1
    return [] if start == len(shapes) else None


def _match_layer(
    layer: layers.Portable, rest: list[Segment], shapes: list[tuple], start: int
) -> list[int] | None:
    """The parts of `layer`, then of each split layer in `rest`, that give `shapes[start:]`."""
    for parts in range(1, len(shapes) - start + 1):
        wanted = layer.split_shapes(parts)
        if wanted is None:  # more parts than rows
            return None
        if shapes[start : start + len(wanted)] == [tuple(s) for s in wanted]:
            tail = _match(rest, shapes, start + len(wanted))
            if tail is not None:
                return [parts, *tail]
    return None


def restore(
    path: str,
    found: RestorePlan,
    optimizer: keras.optimizers.Optimizer,
    save_counter: tf.Variable,
    delta: str | None = None,
) -> tuple[str, list[str]]:
    """Restores checkpoint `path` into the model of `found` and `optimizer` (see the module).

    With `delta` (a delta of `path`, `trainer.loop.deltas`), replays it over the
    twins and stand-ins (written with their split) before moving them.

    Returns:
      The line saying what was re-split, and a warning for each part that
      had to evict ids to fit.

    Raises:
      AssertionError, ValueError: the checkpoint does not fit the twins after all.
    """
    twins = {id(layer): layer.twin(found.parts[id(layer)]) for layer in found.resplit()}
    variables, indexes = [], []
    stand_ins = []  # (a stand-in on this host, the model's variable it stands for)
    for segment in found.segments:
        twin = twins.get(id(segment))
        if twin is not None:
            variables += twin.variables
            indexes += twin.indexes()
            continue
        for variable in segment.variables if _is_layer(segment) else [segment]:
            stand_ins.append((_stand_in(variable), variable))
            variables.append(stand_ins[-1][0])
        indexes += segment.indexes() if _is_layer(segment) else []
    trainable = [variable for variable in variables if variable.trainable]
    there = optim.like(optimizer)
    there.build(trainable)
    stand_in = tf.train.Checkpoint(variables=variables, tables=indexes, optimizer=there)
    table_seen.restore_matched(stand_in, path, indexes)
    if delta is not None:
        originals = {id(s): v for s, v in stand_ins}
        found_there = deltas.layout(variables, there, lambda v: originals.get(id(v), v))
        deltas.replay(delta, found_there, indexes, stand_in.save_counter)
    save_counter.assign(stand_in.save_counter)
    own = zip(optim.own_variables(there), optim.own_variables(optimizer), strict=True)
    for source, target in own:
        target.assign(source)  # the step, and whatever else is not a slot
    for source, target in stand_ins:
        target.assign(source)
        pairs = zip(optim.slots_of(there, source), optim.slots_of(optimizer, target), strict=True)
        for (slot_there, _), (slot_here, _) in pairs:
            slot_here.assign(slot_there)
    warnings = []
    for layer in found.resplit():
        content = twins[id(layer)].export_logical(lambda v: optim.slots_of(there, v))
        warnings += layer.import_logical(content, lambda v: optim.slots_of(optimizer, v))
    what = ", ".join(
        f"{layer.name} in {found.parts[id(layer)]} parts into {layer.num_parts}"
        for layer in found.resplit()
    )
    return f"restored {os.path.basename(delta or path)} written with {what}", warnings


def _stand_in(variable: keras.Variable) -> keras.Variable:
    """A zero variable like `variable` on this host, to restore its value and slots into."""
    zeros = np.zeros(variable.shape, variable.dtype)
    return keras.Variable(
        zeros, dtype=variable.dtype, trainable=variable.trainable, name=variable.name
    )
