"""SavedModel export with a serving signature from the model's real inputs.

The `serving_default` signature takes the model's own inputs by name (one
tensor, or every input of a dict- or multi-input model, strings included),
each batched. What it returns depends on how the model is trained:

- a built-in classification task: `logits`, `probabilities` and `classes`.
  A classifier's probabilities come from what the model outputs (see
  `models.output_kind`): a softmax of its logits, or its own probabilities,
  never a softmax of probabilities;
- a built-in regression task: `predictions`;
- a model the user compiled (any outputs): the model's outputs by name.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from trainer import models, storage, tasks


def export(
    model: keras.Model,
    path: str,
    input_shape: tuple[int, ...] | None,
    num_classes: int,
    raw_outputs: bool = False,
) -> str:
    """Writes `model` as a SavedModel at `path`, replacing an earlier export.

    Args:
      model: the trained model.
      path: the export directory.
      input_shape: one example's shape, used only for a model that does not
        say what its inputs are (a subclassed model); they are float32 and
        named `inputs`.
      num_classes: the built-in task's classes (0: regression).
      raw_outputs: return the model's own outputs by name (a compiled model),
        not the built-in task's.

    The export is written beside `path` first and moved into place, so a crash
    never leaves a half-written export (on an object store, where a move is a
    copy of each file, a crash in the move may).
    """
    module = tf.Module()
    module.model = model
    kind = models.output_kind(model) if num_classes > 0 else "values"

    @tf.function
    def serve(**features):
        if _takes_dict(model):
            inputs = features
        elif len(features) == 1:
            inputs = features["inputs"]
        else:  # a multi-input model takes its inputs in order
            inputs = [features[name] for name in _names(model.inputs)]
        outputs = model(inputs, training=False)
        if raw_outputs:
            return _named_outputs(model, outputs)
        outputs = tf.cast(outputs, tf.float32)
        if num_classes > 0:
            probabilities = tasks.Classification(num_classes, kind).probabilities(outputs)
            return {
                "logits": outputs if kind == "logits" else tf.math.log(probabilities),
                "probabilities": probabilities,
                "classes": tf.argmax(probabilities, axis=-1),
            }
        return {"predictions": tf.squeeze(outputs, -1)}

    signature = serve.get_concrete_function(**_input_specs(model, input_shape))
    module.serve = serve
    # Beside `path`, but not named `path` + something: on `ram://` a name is also a
    # prefix match, and `export.tmp` would then count as inside `export`.
    staging = os.path.join(os.path.dirname(path), f".staging-{os.path.basename(path)}")
    if tf.io.gfile.exists(staging):  # left by an export that crashed
        tf.io.gfile.rmtree(staging)
    tf.saved_model.save(module, staging, signatures={"serving_default": signature})
    storage.replace_dir(staging, path)
    return path


def _input_specs(model: keras.Model, input_shape: tuple[int, ...] | None) -> dict:
    """The serving signature's inputs by name: the model's own, else float32 `inputs`."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return {"inputs": tf.TensorSpec((None, *input_shape), tf.float32, name="inputs")}
    if _takes_dict(model):
        named = model.input.items()
    elif len(inputs) == 1:
        named = [("inputs", inputs[0])]
    else:
        named = zip(_names(inputs), inputs)
    return {
        name: tf.TensorSpec((None, *tensor.shape[1:]), tensor.dtype, name=name)
        for name, tensor in named
    }


def _takes_dict(model: keras.Model) -> bool:
    return bool(getattr(model, "inputs", None)) and isinstance(model.input, dict)


def _names(tensors) -> list[str]:
    return [t.name for t in tensors]


def _named_outputs(model: keras.Model, outputs) -> dict:
    """A model's outputs as a dict of tensors by output name."""
    if isinstance(outputs, dict):
        return dict(outputs)
    flat = tf.nest.flatten(outputs)
    if len(flat) == 1:
        return {"outputs": flat[0]}
    return dict(zip(model.output_names, flat))
