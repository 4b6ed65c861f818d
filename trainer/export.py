"""SavedModel export with a serving signature that takes a batch of inputs.

A classifier's probabilities come from what the model outputs (see
`models.output_kind`): a softmax of its logits, or its own probabilities,
never a softmax of probabilities.
"""

from __future__ import annotations

import os
import shutil

import keras
import tensorflow as tf

from trainer import models, tasks


def export(model: keras.Model, path: str, input_shape: tuple[int, ...], num_classes: int) -> str:
    """Writes `model` as a SavedModel at `path`, replacing an earlier export.

    The `serving_default` signature takes `inputs` (float32, [batch, *input_shape])
    and returns `logits`, `probabilities` and `classes` for classification, or
    `predictions` for regression. For a model that outputs probabilities,
    `probabilities` are its outputs and `logits` their logarithms. The export
    is written beside `path` first and moved into place, so a crash never
    leaves a half-written export.
    """
    module = tf.Module()
    module.model = model
    kind = models.output_kind(model) if num_classes > 0 else "values"

    @tf.function(input_signature=[tf.TensorSpec((None, *input_shape), tf.float32, name="inputs")])
    def serve(inputs):
        outputs = tf.cast(model(inputs, training=False), tf.float32)
        if num_classes > 0:
            probabilities = tasks.Classification(num_classes, kind).probabilities(outputs)
            return {
                "logits": outputs if kind == "logits" else tf.math.log(probabilities),
                "probabilities": probabilities,
                "classes": tf.argmax(probabilities, axis=-1),
            }
        return {"predictions": tf.squeeze(outputs, -1)}

    module.serve = serve
    staging = path + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    tf.saved_model.save(module, staging, signatures={"serving_default": serve})
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)
    return path
