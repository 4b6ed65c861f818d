"""`pipeline`: model parallelism, a model's layers split into stages on several devices.

The model's layers, in order, are cut into consecutive *stages*, one per
device (GPUs, else the logical CPUs of `devices.logical_cpus`): balanced by
parameter count (`strategy.pipeline.stages`), or at the layers named in
`strategy.pipeline.boundaries`, each of which starts a stage. A stage's
variables (and the optimizer's slots for them) live on its device, and its
forward and backward passes run there; only the activations between stages
(and their gradients) cross devices.

GPipe-style, each training batch is split into `strategy.pipeline.micro_batches`
parts that flow through the stages one after another, so stage 1 works on
micro-batch 0 while stage 0 works on micro-batch 1: the steps are one dataflow
graph, and TensorFlow runs every op whose inputs are ready. The model's
outputs are the micro-batches' outputs put back together, so the loss, its
gradients (summed over micro-batches) and the update are those of the whole
global batch, as under `one_device` (up to float rounding).

What splits: Keras Sequential models, and functional models whose graph is a
chain of stages: exactly one tensor crosses each boundary (anything may
branch and merge inside a stage). Layers that see the batch as a whole
differ with micro-batches: `BatchNormalization` normalises each micro-batch
by its own statistics (as in GPipe), and dropout draws other masks; with
`micro_batches = 1` both match `one_device`. Evaluation runs the stages
without micro-batches; export runs the plain model (one device).

How the model runs by stages: the trainer builds the model inside `scope()`
(variables on the host) and hands it to `place_model`, which moves each
stage's variables to its device and makes the model's call run stage by
stage while this plugin's step loops are traced. The trainer's step is the
ordinary one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import ml_collections
import tensorflow as tf

from strategies import devices, tf_patches
from strategies.base import DatasetFn, StepFn, Strategy
from strategies.errors import UserError
from strategies.registry import register


@register("pipeline")
class Pipeline(Strategy):
    """Model parallelism: consecutive layers in stages on GPUs (else logical CPUs), GPipe."""

    supports_jit_compile = False  # variables live away from the devices that compute

    @classmethod
    def local_replicas(cls, options: ml_collections.ConfigDict | None, logical_cpus: int) -> int:
        # One replica, but its stages compute side by side: each op gets one stage's
        # share of the cores (see `devices.op_threads`).
        return _stage_count(options or ml_collections.ConfigDict())

    def _build(self) -> tf.distribute.Strategy:
        self.micro_batches = int(self.options.get("micro_batches", 1))
        if self.micro_batches < 1:
            raise UserError(
                f"`strategy.pipeline.micro_batches` ({self.micro_batches}) must be >= 1 "
                "(1 = no micro-batches)."
            )
        self.boundaries = _names(self.options.get("boundaries", ""))
        count = _stage_count(self.options)
        if count < 1:
            raise UserError(
                f"`strategy.pipeline.stages` ({count}) must be >= 1; e.g. "
                "`--config.strategy.pipeline.stages=2`."
            )
        found = devices.parse_devices(self.options.get("devices", ""), "strategy.pipeline.devices")
        if len(found) < count:
            raise UserError(
                f"`strategy.pipeline` has {count} stages, one per device, and only "
                f"{len(found)} device(s) are in use ({', '.join(found)}); lower "
                "`strategy.pipeline.stages` or raise `devices.logical_cpus` (no GPUs)."
            )
        self.devices = found[:count]
        self.stages: list[Stage] = []  # set by `place_model`
        self._staged = False  # the model runs by stages (while our loops are traced)
        return tf.distribute.get_strategy()  # one replica; placement is done by hand

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables are made on the host; `place_model` moves each to its stage's device."""
        with self.tf_strategy.scope(), tf.device("/device:CPU:0"):
            yield

    def place_model(self, model: keras.Model) -> None:
        """Cuts `model` into stages, moves their variables, and makes its call run by stages.

        Raises:
          UserError: the model cannot be cut as asked (a branch crosses a
            boundary, an unknown layer name, fewer layers than stages).
        """
        layers, cuts = _layers_and_cuts(model)
        starts = (
            _named_cuts(self.boundaries, layers, cuts)
            if self.boundaries
            else _balanced_cuts(len(self.devices), layers, cuts)
        )
        starts = [0, *starts, len(layers)]
        spans = list(zip(self.devices, starts, starts[1:], strict=False))
        for device, a, b in spans:
            for layer in layers[a:b]:
                for variable in layer.variables:
                    _move(variable, device)
        self.stages = [
            Stage(
                device,
                layers[a:b],
                cuts[a] if a else _symbolic(model, "input"),
                cuts[b] if b < len(layers) else _symbolic(model, "output"),
            )
            for device, a, b in spans
        ]
        plain_call = model.call

        def call(inputs, training=None, mask=None, **kwargs):
            if not self._staged:  # e.g. export, or a call outside training and evaluation
                return plain_call(inputs, training=training, mask=mask, **kwargs)
            micro = self.micro_batches if training else 1
            return run_by_stages(self.stages, inputs, micro, training)

        tf_patches.replace_call(model, call)

    @contextlib.contextmanager
    def _by_stages(self) -> Iterator[None]:
        self._staged = True
        try:
            yield
        finally:
            self._staged = False

    def run_steps(self, step_fn: StepFn, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps, the model by stages (traced so on the first call)."""
        with self._by_stages():
            return super().run_steps(step_fn, iterator, n)

    def evaluate(self, step_fn: StepFn, dataset_fn: DatasetFn) -> dict[str, float]:
        """One pass over `dataset_fn`, the model by stages without micro-batches."""
        with self._by_stages():
            return super().evaluate(step_fn, dataset_fn)

    @property
    def compute_devices(self) -> list[str]:
        return list(self.devices)

    @property
    def communication(self) -> str:
        layout = (
            " -> ".join(
                f"stage {i} on {s.device} ({', '.join(layer.name for layer in s.layers)})"
                for i, s in enumerate(self.stages)
            )
            or f"{len(self.devices)} stages on {', '.join(self.devices)}"
        )
        return (
            f"activations of {self.micro_batches} micro-batch(es) flow forward, and their "
            f"gradients back, between consecutive stages: {layout}; each stage's variables "
            "stay on its device"
        )

    def describe(self, variables=()) -> dict:
        """As the base, plus `stages`: each stage's device and layer names, in order."""
        described = super().describe(variables)
        described["micro_batches"] = self.micro_batches
        described["stages"] = [
            {"device": s.device, "layers": [layer.name for layer in s.layers]} for s in self.stages
        ]
        return described


class Stage:
    """Consecutive layers on one device, run as a model from `inputs` to `outputs`.

    Args:
      device: where the stage's variables live and its ops run.
      layers: its layers, in order.
      inputs: the symbolic tensor(s) that enter the stage (the model's inputs for the first).
      outputs: the symbolic tensor(s) it produces (the model's outputs for the last).
    """

    def __init__(self, device: str, layers: list, inputs: Any, outputs: Any):
        self.device = device
        self.layers = layers
        # A functional model over the same layers (it shares their variables).
        self.model = keras.Model(inputs, outputs, name=f"stage_{layers[0].name}")
        # The TF variables behind them, in the model's order (read as they are, where
        # Keras would cast them to a mixed-precision compute dtype).
        self.trainable = [v.value for v in self.model.trainable_variables]
        self.non_trainable = [v.value for v in self.model.non_trainable_variables]


def run_by_stages(stages: list[Stage], inputs: Any, micro_batches: int, training) -> Any:
    """The model's outputs for `inputs`, computed stage by stage over micro-batches.

    Every (micro-batch, stage) pair is one block on the stage's device, its
    backward pass too; the blocks are independent except where one feeds the
    next, so the stages overlap in the step's dataflow graph. A stage reads
    its variables once a step and hands each micro-batch its own copy, so the
    micro-batches' weight gradients are summed on the stage's device (see
    `_copies`). Its state (e.g. moving statistics, RNG counters) starts every
    micro-batch from the step's value and is written once (see `_keep_state`).
    """
    with tf.device(stages[0].device):
        parts = _split(inputs, micro_batches)
    weights, states = [], []
    for stage in stages:
        with tf.device(stage.device):
            weights.append(_copies([v.read_value() for v in stage.trainable], len(parts)))
            states.append([v.read_value() for v in stage.non_trainable])
    outputs, new_states = [], [[] for _ in stages]
    for m, part in enumerate(parts):
        for s, stage in enumerate(stages):
            part, state = _on_device(stage, part, weights[s][m], states[s], training)
            new_states[s].append(state)
        outputs.append(part)
    if training:  # inference leaves the state as it is
        for stage, updates in zip(stages, new_states, strict=True):
            _keep_state(stage, updates)
    with tf.device(stages[-1].device):
        return tf.nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)


def _copies(values: list[tf.Tensor], count: int) -> list[list[tf.Tensor]]:
    """`count` copies of `values`, whose gradients are summed where `values` are.

    Were every micro-batch to read the same tensors, TensorFlow's tape would add
    their gradients in an op with no device, which lands on the first device:
    every stage's gradients would travel there and back each step.
    """
    if count == 1 or not values:
        return [values] * count

    @tf.custom_gradient
    def copy(*tensors):
        def backward(*grads):
            per_value = [grads[i :: len(tensors)] for i in range(len(tensors))]
            with tf.device(tensors[0].device):
                return [tf.add_n([g for g in parts if g is not None]) for parts in per_value]

        return [tf.identity(t) for _ in range(count) for t in tensors], backward

    flat = copy(*values)
    return [flat[m * len(values) : (m + 1) * len(values)] for m in range(count)]


def _on_device(stage: Stage, inputs: Any, weights: list, state: list, training) -> tuple:
    """`stage.model(inputs)` with `weights` and `state`, forward and backward on `stage.device`.

    Returns the stage's outputs and its new state. Gradient ops would otherwise
    be placed by TensorFlow, which puts ops with no device on the first one:
    the whole backward pass would run there. The custom gradient recomputes
    nothing: it replays the block's own tape.
    """
    flat, count = tf.nest.flatten(inputs), len(weights)
    sizes = {}

    @tf.custom_gradient
    def block(*tensors):
        watched = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
        with tf.device(stage.device), tf.GradientTape() as tape:
            tape.watch([tensors[i] for i in watched])
            packed = tf.nest.pack_sequence_as(inputs, list(tensors[count:]))
            outputs, new_state, losses = stage.model.stateless_call(
                list(tensors[:count]), state, packed, training=training, return_losses=True
            )
            # Losses the layers add (activity regularizers) are outputs too, so that
            # their gradients come back through this block.
            outputs = tf.nest.flatten(outputs) + list(losses)
        sizes["outputs"], sizes["losses"] = len(outputs), len(losses)

        def backward(*output_grads):
            grads = [tf.zeros_like(o) if g is None else g for o, g in zip(outputs, output_grads)]
            with tf.device(stage.device):
                found = tape.gradient(
                    outputs, [tensors[i] for i in watched], output_gradients=grads
                )
            input_grads: list = [None] * len(tensors)
            for i, g in zip(watched, found, strict=True):
                input_grads[i] = g
            return input_grads

        # The new state goes out too (its gradient is never asked for).
        return outputs + list(new_state), backward

    results = block(*weights, *flat)
    produced, new_state = results[: sizes["outputs"]], results[sizes["outputs"] :]
    losses = produced[len(produced) - sizes["losses"] :]
    if losses:
        stage.layers[-1].add_loss(tf.add_n(losses))  # so that the model's `losses` hold them
    outputs = produced[: len(produced) - sizes["losses"]]
    return tf.nest.pack_sequence_as(stage.model.output, outputs), new_state


def _keep_state(stage: Stage, updates: list[list]) -> None:
    """Writes a stage's state after its micro-batches: floats averaged, others the last's.

    Averaging is exact for a moving mean (the update is linear in the batch
    mean); counters and RNG states advance once a step, as on one device.
    """
    if not stage.non_trainable:
        return
    with tf.device(stage.device):
        for k, variable in enumerate(stage.non_trainable):
            values = [state[k] for state in updates]
            if variable.dtype.is_floating and len(values) > 1:
                variable.assign(tf.add_n(values) / len(values))
            else:
                variable.assign(values[-1])


def _split(inputs: Any, parts: int) -> list:
    """`inputs` cut along the batch into `parts` consecutive micro-batches (sizes within 1)."""
    first = tf.nest.flatten(inputs)[0]
    rows = first.shape[0]
    if rows is not None:
        parts = max(1, min(parts, rows))
        sizes = [rows // parts + (i < rows % parts) for i in range(parts)]
    else:
        total = tf.shape(first)[0]
        sizes = tf.stack([(total + parts - 1 - i) // parts for i in range(parts)])
    if parts == 1:
        return [inputs]
    pieces = [tf.split(t, sizes, num=parts, axis=0) for t in tf.nest.flatten(inputs)]
    return [tf.nest.pack_sequence_as(inputs, [p[i] for p in pieces]) for i in range(parts)]


def _move(variable: keras.Variable, device: str) -> None:
    """Re-creates the TF variable behind Keras `variable` on `device`, with its value.

    A Keras variable wraps one TF variable, made where it was built. Keras
    itself wraps an existing TF variable through `_initialize` (its
    `keras.Variable(tf_variable)` path); this gives it one on `device`. The
    Keras object, which the model, checkpoints and optimizer hold, stays the same.
    """
    old = variable.value
    if tf.DeviceSpec.from_string(old.device) == tf.DeviceSpec.from_string(device).replace(
        job="localhost", replica=0, task=0
    ):
        return
    with tf.init_scope(), tf.device(device):
        new = tf.Variable(
            old.read_value(),
            trainable=old.trainable,
            name=variable.name,
            aggregation=old.aggregation,
            synchronization=old.synchronization,
        )
    variable._initialize(new)  # noqa: SLF001 (Keras's own way to wrap a TF variable)
    if variable.value is not new:
        raise RuntimeError(
            f"Could not move variable `{variable.path}` to {device}: this Keras version "
            "wraps TF variables differently; `pipeline` needs Keras 3."
        )


# --- cutting a model into stages ----------------------------------------------------------


def _layers_and_cuts(model: keras.Model) -> tuple[list, list]:
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


def _named_cuts(names: list[str], layers: list, cuts: list) -> list[int]:
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


def _balanced_cuts(stages: int, layers: list, cuts: list) -> list[int]:
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


def _symbolic(model: keras.Model, end: str) -> Any:
    """The model's symbolic inputs or outputs (`end`), in the structure it was built with."""
    try:
        return getattr(model, end)  # a functional model's dict, list or tensor
    except AttributeError:  # a Sequential model has them as a list only
        flat = getattr(model, end + "s")
        return flat[0] if len(flat) == 1 else flat


def _names(spec: str) -> list[str]:
    return [n.strip() for n in str(spec).split(",") if n.strip()]


def _stage_count(options: ml_collections.ConfigDict) -> int:
    names = _names(options.get("boundaries", ""))
    return len(names) + 1 if names else int(options.get("stages", 2))
