"""Losses and metrics per task: classification and regression.

Steps return sums (loss, correct predictions, example counts) so that any
number of replicas, steps and partial batches add up exactly; `metrics`
turns the sums into means.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

AUC_BUCKETS = 200  # resolution of the binary AUC's score histogram


class Classification:
    """Softmax cross-entropy on logits; accuracy, and AUC for two classes."""

    name = "classification"

    def __init__(self, num_classes: int):
        self.num_classes = num_classes

    def per_example_loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.cast(labels, tf.int32), tf.cast(outputs, tf.float32)
        )

    def sums(self, labels: tf.Tensor, outputs: tf.Tensor, per_example_loss: tf.Tensor) -> dict:
        labels = tf.cast(labels, tf.int32)
        predicted = tf.argmax(outputs, axis=-1, output_type=tf.int32)
        correct = tf.cast(tf.equal(predicted, labels), tf.float32)
        sums = {
            "loss": tf.reduce_sum(per_example_loss),
            "correct": tf.reduce_sum(correct),
            "examples": tf.cast(tf.size(labels), tf.float32),
        }
        if self.num_classes == 2:
            sums.update(_score_histograms(labels, tf.nn.softmax(tf.cast(outputs, tf.float32))))
        return sums

    def metrics(self, sums: dict) -> dict[str, float]:
        n = max(sums.get("examples", 0.0), 1.0)
        metrics = {"loss": sums["loss"] / n, "accuracy": sums["correct"] / n}
        if "positives" in sums:
            metrics["auc"] = auc(sums["positives"], sums["negatives"])
        return metrics


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
    return Classification(num_classes) if num_classes > 0 else Regression()


def _score_histograms(labels: tf.Tensor, probabilities: tf.Tensor) -> dict:
    """Counts of positives and negatives per bucket of the positive-class score.

    Histograms add up over replicas and batches, so the AUC of a whole eval
    pass is exact up to the bucket width.
    """
    buckets = tf.cast(probabilities[:, 1] * AUC_BUCKETS, tf.int32)
    buckets = tf.clip_by_value(buckets, 0, AUC_BUCKETS - 1)
    positive = tf.cast(tf.equal(labels, 1), tf.float32)
    return {
        "positives": tf.math.unsorted_segment_sum(positive, buckets, AUC_BUCKETS),
        "negatives": tf.math.unsorted_segment_sum(1.0 - positive, buckets, AUC_BUCKETS),
    }


def auc(positives, negatives) -> float:
    """Area under the ROC curve from score histograms (ties count half)."""
    positives, negatives = np.asarray(positives, float), np.asarray(negatives, float)
    total = positives.sum() * negatives.sum()
    if total == 0:
        return float("nan")
    above = np.cumsum(positives[::-1])[::-1] - positives  # positives scored in higher buckets
    return float(np.sum(negatives * (above + 0.5 * positives)) / total)
