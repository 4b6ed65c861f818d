"""How the `pipeline` plugin runs a model cut into stages: each on its device, by micro-batch.

A `Stage` is consecutive layers on one device; `run_by_stages` runs a batch
through the stages as GPipe does (the module docstring of
`strategies.pipeline`), and `move` puts a Keras variable on its stage's device.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from strategies import tf_patches

# What TensorFlow fills into a device name without a process: `/job:localhost/replica:0/task:0`.
_LOCAL_PROCESS = {"job": "localhost", "replica": 0, "task": 0}


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


def move(variable: keras.Variable, device: str) -> None:
    """Re-creates the TF variable behind Keras `variable` on `device`, with its value.

    A Keras variable wraps one TF variable, made where it was built; this
    gives it one on `device` (`tf_patches.move_variable`). The Keras object,
    which the model, checkpoints and optimizer hold, stays the same.
    """
    old = variable.value
    if tf.DeviceSpec.from_string(old.device) == tf.DeviceSpec.from_string(device).replace(
        **_LOCAL_PROCESS
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
    tf_patches.move_variable(variable, new)
