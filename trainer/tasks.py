"""Losses and metrics per task: classification and regression.

Steps return sums (loss, correct predictions, example counts) so that any
number of replicas, steps and partial batches add up exactly; `metrics`
turns the sums into means.
"""

from __future__ import annotations

import tensorflow as tf


class Classification:
    """Softmax cross-entropy on logits; accuracy."""

    name = "classification"

    def per_example_loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.cast(labels, tf.int32), tf.cast(outputs, tf.float32)
        )

    def sums(self, labels: tf.Tensor, outputs: tf.Tensor, per_example_loss: tf.Tensor) -> dict:
        predicted = tf.argmax(outputs, axis=-1, output_type=tf.int32)
        correct = tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)
        return {
            "loss": tf.reduce_sum(per_example_loss),
            "correct": tf.reduce_sum(correct),
            "examples": tf.cast(tf.size(labels), tf.float32),
        }

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums.get("examples", 0.0), 1.0)
        return {"loss": sums["loss"] / n, "accuracy": sums["correct"] / n}


class Regression:
    """Mean squared error; mean absolute error."""

    name = "regression"

    def per_example_loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        error = tf.squeeze(tf.cast(outputs, tf.float32), -1) - tf.cast(labels, tf.float32)
        return tf.square(error)

    def sums(self, labels: tf.Tensor, outputs: tf.Tensor, per_example_loss: tf.Tensor) -> dict:
        return {
            "loss": tf.reduce_sum(per_example_loss),
            "abs_error": tf.reduce_sum(tf.sqrt(per_example_loss)),
            "examples": tf.cast(tf.size(labels), tf.float32),
        }

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums.get("examples", 0.0), 1.0)
        return {"loss": sums["loss"] / n, "mae": sums["abs_error"] / n}


def for_spec(num_classes: int) -> Classification | Regression:
    """The task for data with `num_classes` classes (0 = regression)."""
    return Classification() if num_classes > 0 else Regression()
