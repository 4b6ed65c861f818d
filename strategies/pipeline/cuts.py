"""Where the `pipeline` plugin cuts a model: stage boundaries by name or balanced by parameters.

A model splits between two layers where exactly one tensor carries
everything from the layers before to the layers after (`layers_and_cuts`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towerflow.errors import UserError


def layers_and_cuts(model: keras.Model) -> tuple[list, list]:
    """The model's layers in order, and before each the tensor a stage starting there takes.

    `cuts[j]` is the one tensor that carries everything from layers `< j` to
    layers `>= j`, or a `_Crossing` naming what else crosses there.

    Raises:
      UserError: a model that is not a built functional or Sequential model, or
        a layer used at several places.
    """
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise UserError(
            f"`strategy.pipeline` splits Keras functional or Sequential models built on "
            f"`keras.Input`; model `{model.name}` ({type(model).__name__}) has no symbolic "
            "inputs; build it with `keras.Input`, or use another strategy."
        )
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    producer: dict[int, int] = {id(t): -1 for t in inputs}  # tensor -> index of its layer
    consumed: list[list[int]] = []  # per layer: the tensors it takes
    for j, layer in enumerate(layers):
        try:
            ins, outs = tf.nest.flatten(layer.input), tf.nest.flatten(layer.output)
        except (AttributeError, ValueError):
            raise UserError(
                f"`strategy.pipeline`: layer `{layer.name}` of `{model.name}` is used at several "
                "places (or is a nested model used so); pipeline splits a chain of layers each "
                "called once; use another strategy."
            ) from None
        consumed.append([id(t) for t in ins])
        for t in outs:
            producer[id(t)] = j
    tensors = {id(t): t for layer in layers for t in tf.nest.flatten(layer.output)}
    tensors.update({id(t): t for t in inputs})
    final = [id(t) for t in outputs]
    cuts: list = []
    for j in range(len(layers)):
        later = {t for taken in consumed[j:] for t in taken} | set(final)
        crossing = sorted((t for t in later if producer.get(t, len(layers)) < j), key=producer.get)
        if len(crossing) == 1:
            cuts.append(tensors[crossing[0]])
        else:
            names = [
                layers[producer[t]].name if producer[t] >= 0 else "the input" for t in crossing
            ]
            cuts.append(_Crossing(layers[j].name, names))
    return layers, cuts


class _Crossing:
    """A place a stage cannot start: more than one tensor crosses it."""

    def __init__(self, layer: str, sources: list[str]):
        self.layer, self.sources = layer, sources

    def message(self) -> str:
        return (
            f"a stage cannot start at layer `{self.layer}`: the outputs of "
            f"{', '.join(f'`{s}`' for s in self.sources)} all cross there (a branch crosses "
            "the boundary); pipeline passes one tensor between stages"
        )


def named_cuts(names: list[str], layers: list, cuts: list) -> list[int]:
    """The indices of the layers `names` (from `strategy.pipeline.boundaries`), checked."""
    index = {layer.name: j for j, layer in enumerate(layers)}
    starts = []
    for name in names:
        if name not in index:
            raise UserError(
                f"`strategy.pipeline.boundaries` names layer '{name}', which the model does not "
                f"have; its layers: {', '.join(index)}."
            )
        j = index[name]
        if j == 0 or (starts and j <= starts[-1]):
            raise UserError(
                f"`strategy.pipeline.boundaries` ({', '.join(names)}): each layer must come after "
                f"the previous one and not be the first (`{layers[0].name}`); '{name}' does not."
            )
        if isinstance(cuts[j], _Crossing):
            raise UserError(
                f"`strategy.pipeline.boundaries`: {cuts[j].message()}; "
                "pick another layer, or use another strategy."
            )
        starts.append(j)
    return starts


def balanced_cuts(stages: int, layers: list, cuts: list) -> list[int]:
    """Where stages 1.. start so that each holds about the same number of parameters."""
    valid = [j for j in range(1, len(layers)) if not isinstance(cuts[j], _Crossing)]
    if len(valid) < stages - 1:
        crossing = [c.message() for c in cuts[1:] if isinstance(c, _Crossing)]
        why = f"; e.g. {crossing[0]}" if crossing else ""
        raise UserError(
            f"`strategy.pipeline.stages` ({stages}): the model can be cut in only "
            f"{len(valid)} place(s){why}; use at most {len(valid) + 1} stages."
        )
    params = [layer.count_params() for layer in layers]
    before = [sum(params[:j]) for j in range(len(layers) + 1)]
    total, starts = before[-1], []
    for i in range(1, stages):
        # Leave a place for every later stage; pick the one nearest this stage's share.
        room = [j for j in valid if (not starts or j > starts[-1])]
        room = room[: len(room) - (stages - 1 - i)]
        starts.append(min(room, key=lambda j: abs(before[j] - total * i / stages)))
    return starts


def symbolic(model: keras.Model, end: str) -> Any:
    """The model's symbolic inputs or outputs (`end`), in the structure it was built with."""
    try:
        return getattr(model, end)  # a functional model's dict, list or tensor
    except AttributeError:  # a Sequential model has them as a list only
        flat = getattr(model, end + "s")
        return flat[0] if len(flat) == 1 else flat
