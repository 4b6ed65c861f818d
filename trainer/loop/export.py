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

Exports while training (`export.every_steps`, `export.every_secs`) go to
`export/<version>/`, TF Serving's layout: the version is the step, each is
written under a hidden name and renamed into place when complete, and only
the newest `export.keep` are kept (`export_version`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import keras
import tensorflow as tf

from strategies import tf_patches
from towerflow import storage
from trainer import layers
from trainer.layers import dynamic_serving
from trainer.loop import compiled, models, objectives, writes


def export(
    model: keras.Model,
    path: str,
    input_shape: tuple[int, ...] | None,
    num_classes: int,
    raw_outputs: bool = False,
    class_names: tuple[str, ...] = (),
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
      class_names: the label's class names, in class order (a string label's
        vocabulary): a classifier also returns `class_names`, the name of each
        example's class.

    The export is written beside `path` first and moved into place, so a crash
    never leaves a half-written export (on an object store, where a move is a
    copy of each file, a crash in the move may).
    """
    module = tf.Module()
    module.model = model
    kind = models.output_kind(model) if num_classes > 0 else "values"

    # TF ops, and Python's `if` on what is known while tracing: nothing for AutoGraph.
    @tf.function(autograph=False)
    def serve(**features):
        if compiled.takes_named_inputs(model):
            inputs = features
        elif len(features) == 1:
            inputs = features["inputs"]
        else:  # a multi-input model takes its inputs in order
            inputs = [features[name] for name in _names(model.inputs)]
        outputs = model(inputs, training=False)
        if raw_outputs:
            return _named_outputs(model, outputs)
        return _task_outputs(tf.cast(outputs, tf.float32), num_classes, kind, class_names)

    specs = _input_specs(model, input_shape)

    @tf.function(autograph=False)
    def serve_flat(**flat):  # a signature takes tensors: ragged and sparse in parts
        return serve(**_joined(specs, flat))

    # Dynamic tables serve from their index frozen now (`dynamic_serving.frozen`), which
    # the SavedModel holds: a lookup about twice as fast as the live index's.
    with dynamic_serving.frozen(layers.dynamic_tables(model)) as frozen_indexes:
        module.frozen_indexes = frozen_indexes
        signature = serve_flat.get_concrete_function(**_flat_specs(specs))
    module.serve = serve
    # Beside `path`, but not named `path` + something: on `ram://` a name is also a
    # prefix match, and `export.tmp` would then count as inside `export`.
    staging = os.path.join(os.path.dirname(path), f".staging-{os.path.basename(path)}")
    if tf.io.gfile.exists(staging):  # left by an export that crashed
        tf.io.gfile.rmtree(staging)
    _save(module, staging, {"serving_default": signature})
    storage.replace_dir(staging, path)
    return path


# The model last exported whose variables live on other members, and its variables'
# write (`_save`): a process exports one model again and again; another one replaces it.
_last_write: tuple[keras.Model, writes.TracedWrite] | None = None


def _save(module: tf.Module, path: str, signatures: dict) -> None:
    """`tf.saved_model.save(module, path, signatures)`, of `module.model`'s variables.

    TensorFlow writes a SavedModel's variables as a checkpoint, eagerly: where
    they live on other members (parameter servers), through a new function
    each export, which every ps member keeps (about 0.4 MB an export of the
    ctr job). There they go through the model's one traced write
    (`trainer.loop.writes`), under the names TensorFlow gives them (a
    checkpoint whose `model` is the model, as `module`'s is), and the
    SavedModel is written without them.
    """
    global _last_write
    model = module.model
    if writes.all_here(model.variables):
        tf.saved_model.save(module, path, signatures=signatures)
        return
    if _last_write is None or _last_write[0] is not model:
        _last_write = (model, writes.TracedWrite(tf.train.Checkpoint(model=model)))
    _last_write[1](os.path.join(path, "variables", "variables"))
    tf_patches.saved_model_without_variables(module, path, signatures)


def _task_outputs(
    outputs: tf.Tensor, num_classes: int, kind: str, class_names: tuple[str, ...]
) -> dict[str, tf.Tensor]:
    """The built-in task's outputs by name: a classifier's logits, probabilities and
    classes (and `class_names`), or a regression's `predictions`."""
    if num_classes <= 0:
        return {"predictions": tf.squeeze(outputs, -1)}
    probabilities = objectives.Classification(num_classes, kind).probabilities(outputs)
    classes = tf.argmax(probabilities, axis=-1)
    named = {"class_names": tf.gather(tf.constant(class_names), classes)} if class_names else {}
    return {
        "logits": outputs if kind == "logits" else tf.math.log(probabilities),
        "probabilities": probabilities,
        "classes": classes,
        **named,
    }


def versions(base: str) -> list[int]:
    """The versions under `base` (its subdirectories named by an integer), oldest first."""
    if not tf.io.gfile.isdir(base):
        return []
    names = (name.rstrip("/") for name in tf.io.gfile.listdir(base))
    return sorted(int(name) for name in names if name.isdigit())


def export_version(base: str, version: int, keep: int, write: Callable[[str], object]) -> bool:
    """Writes version `version` under `base` with `write(path)`; keeps the newest `keep`.

    A version not above the newest one is skipped (versions only increase, so a
    server that follows the newest never goes back): returns whether it wrote.
    `write` is `export` with the model's arguments bound; it writes under a
    hidden name and renames, so a server polling `base` never sees half a model.
    `keep` 0 keeps every version.
    """
    written = versions(base)
    if written and version <= written[-1]:
        return False
    tf.io.gfile.makedirs(base)
    write(os.path.join(base, str(version)))
    if keep:
        for old in versions(base)[:-keep]:
            tf.io.gfile.rmtree(os.path.join(base, str(old)))
    return True


def _input_specs(model: keras.Model, input_shape: tuple[int, ...] | None) -> dict:
    """The serving signature's inputs by name: the model's own, else float32 `inputs`."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return {"inputs": tf.TensorSpec((None, *input_shape), tf.float32, name="inputs")}
    if compiled.takes_named_inputs(model):
        named = model.input.items()
    elif len(inputs) == 1:
        named = [("inputs", inputs[0])]
    else:
        named = zip(_names(inputs), inputs)
    return {name: _spec(name, tensor) for name, tensor in named}


def _spec(name: str, tensor) -> tf.TypeSpec:
    """A batch of one input, as the model takes it: dense, ragged or sparse."""
    shape = (None, *tensor.shape[1:])
    if getattr(tensor, "ragged", False):
        ragged_rank = max(i for i, size in enumerate(shape) if size is None and i > 0)
        return tf.RaggedTensorSpec(shape, tensor.dtype, ragged_rank=ragged_rank)
    if getattr(tensor, "sparse", False):
        return tf.SparseTensorSpec(shape, tensor.dtype)
    return tf.TensorSpec(shape, tensor.dtype, name=name)


def _flat_specs(specs: dict[str, tf.TypeSpec]) -> dict[str, tf.TensorSpec]:
    """The signature's tensors: each dense input, and the parts of each ragged or sparse one.

    A ragged input `tags` is `tags` (its values, flat) and `tags_row_lengths` (values
    per example; `tags_row_lengths_2`, ... for deeper raggedness); a sparse one `ids`
    is `ids_indices`, `ids_values` and `ids_dense_shape`.
    """
    flat = {}
    for name, spec in specs.items():
        if isinstance(spec, tf.RaggedTensorSpec):
            inner = spec.shape[spec.ragged_rank + 1 :]
            flat[name] = tf.TensorSpec((None, *inner), spec.dtype, name=name)
            for part in _row_lengths(name, spec):
                flat[part] = tf.TensorSpec((None,), tf.int64, name=part)
        elif isinstance(spec, tf.SparseTensorSpec):
            rank = spec.shape.rank
            parts = {"indices": ((None, rank), tf.int64), "values": ((None,), spec.dtype)}
            parts["dense_shape"] = ((rank,), tf.int64)
            for part, (shape, dtype) in parts.items():
                flat[f"{name}_{part}"] = tf.TensorSpec(shape, dtype, name=f"{name}_{part}")
        else:
            flat[name] = spec
    return flat


def _joined(specs: dict[str, tf.TypeSpec], flat: dict) -> dict:
    """The model's inputs from the signature's tensors (see `_flat_specs`)."""
    joined = {}
    for name, spec in specs.items():
        if isinstance(spec, tf.RaggedTensorSpec):
            lengths = [flat[part] for part in _row_lengths(name, spec)]
            joined[name] = tf.RaggedTensor.from_nested_row_lengths(flat[name], lengths)
        elif isinstance(spec, tf.SparseTensorSpec):
            parts = [flat[f"{name}_{part}"] for part in ("indices", "values", "dense_shape")]
            joined[name] = tf.SparseTensor(*parts)
        else:
            joined[name] = flat[name]
    return joined


def _row_lengths(name: str, spec: tf.RaggedTensorSpec) -> list[str]:
    return [f"{name}_row_lengths" + (f"_{i + 1}" if i else "") for i in range(spec.ragged_rank)]


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
