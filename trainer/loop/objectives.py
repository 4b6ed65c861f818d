"""The built-in objectives (losses and metrics): classification and regression.

An objective is the loss and metrics of a task (`task.name=classification`
or `regression`; a user's compiled model brings its own,
`trainer.loop.compiled.CompiledObjective`). The user's whole task, when a model
builder is not enough, is a `Task` (model, data and maybe loss and step).

Steps return sums (loss, correct predictions, example counts) so that any
number of replicas, steps and partial batches add up exactly; `metrics`
turns the sums into means. Every sum is weighted per example: by the
dataset's sample weights where it yields `(features, labels, weights)`, and
with weight 0 for the padding row a step adds to an empty batch, so padding
counts for nothing. `examples` counts the real examples, `weight` their
total weight; the means divide by `weight`.

A classification model outputs logits, or probabilities when its last layer
ends in softmax (or in a sigmoid over one unit, for two classes), as Keras
Applications models do; `models.output_kind` tells which, and the task takes
the cross-entropy of what it gets.

Labels come in the shapes Keras's own losses take: class ids shaped
`(batch,)` or `(batch, 1)`, or one-hot (or soft) rows `(batch, num_classes)`
for classification; `(batch,)` or `(batch, 1)` for regression's one output.
Any other shape is refused in one line at start-up (`check_labels` on the
dataset's spec), or where the step is traced.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from strategies import tf_patches
from towerflow.errors import UserError

AUC_BUCKETS = 200  # resolution of the binary AUC's score histogram
OUTPUT_KINDS = ("logits", "probabilities", "sigmoid")  # see `models.output_kind`
_EPSILON = 1e-7  # probabilities are clipped to [eps, 1] before the log, as Keras does


def rows(labels) -> tf.Tensor:
    """The number of examples in a batch (rows of its first label tensor)."""
    return tf.shape(tf.nest.flatten(labels)[0], out_type=tf.int32)[0]


def unit_weights(labels) -> tf.Tensor:
    """A weight of 1 for every example of a batch, float32."""
    return tf.ones([rows(labels)], tf.float32)


class _Objective:
    """What every objective shares: weighted sums of the loss, the weight and the examples."""

    def train_sums(self, model, features, labels, outputs, weights, global_batch_size: int):
        """This replica's share of the global batch's loss, and the step's sums.

        The weighted loss is divided by the global batch size, so the replicas'
        shares add up to the global batch's mean; regularisers (`model.losses`)
        are the same on every replica, so each adds its equal part.
        """
        per_example = tf.cast(self.per_example_loss(labels, outputs), tf.float32)
        sums = self.sums(labels, outputs, per_example, weights)
        loss = sums["loss"] / global_batch_size
        if model.losses:
            replicas = tf.distribute.get_replica_context().num_replicas_in_sync
            loss += tf.cast(tf.add_n(model.losses), tf.float32) / replicas
        return loss, sums

    def eval_sums(self, features, labels, outputs, weights, examples) -> dict:
        """One eval batch's sums; padding rows have weight 0, `examples` counts the real ones."""
        return self.sums(labels, outputs, self.per_example_loss(labels, outputs), weights, examples)

    def sums(
        self,
        labels: tf.Tensor,
        outputs: tf.Tensor,
        per_example_loss: tf.Tensor,
        weights: tf.Tensor | None = None,
        examples: tf.Tensor | None = None,
    ) -> dict:
        """Weighted sums of one batch; `weights` default to 1, `examples` to the batch size.

        Without `weights` (a training batch of a dataset that yields none) every
        example weighs 1 and no weight is multiplied in: on a small model each
        op of the step counts.
        """
        per_example_loss = tf.cast(per_example_loss, tf.float32)
        rows = tf.cast(tf.size(per_example_loss), tf.float32)
        if weights is None:
            loss, weight = tf.reduce_sum(per_example_loss), rows
        else:
            weights = tf.cast(weights, tf.float32)
            loss, weight = tf.reduce_sum(weights * per_example_loss), tf.reduce_sum(weights)
        return {
            "loss": loss,
            "weight": weight,
            "examples": rows if examples is None else tf.cast(examples, tf.float32),
            **self._metric_sums(labels, outputs, per_example_loss, weights),
        }

    def _metric_sums(self, labels, outputs, per_example_loss, weights) -> dict:
        """The task's own weighted sums, besides loss, weight and examples (`weights`: or None)."""
        raise NotImplementedError


class Classification(_Objective):
    """Cross-entropy on logits or probabilities; accuracy, and AUC for two classes.

    Args:
      num_classes: classes of the label.
      outputs: "logits", "probabilities" (a softmax over the classes) or
        "sigmoid" (one probability of class 1, for two classes).
      class_names: the classes' names, where the labels have names: the
        metrics then add each class's accuracy (its recall), `accuracy/<name>`.
    """

    name = "classification"

    def __init__(
        self, num_classes: int, outputs: str = "logits", class_names: tuple[str, ...] = ()
    ):
        if outputs not in OUTPUT_KINDS:
            raise ValueError(f"`outputs` {outputs!r} must be one of {', '.join(OUTPUT_KINDS)}.")
        self.num_classes = num_classes
        self.outputs = outputs
        self.class_names = tuple(class_names)

    def probabilities(self, outputs: tf.Tensor) -> tf.Tensor:
        """The model's outputs as class probabilities, [batch, num_classes]."""
        outputs = tf.cast(outputs, tf.float32)
        if self.outputs == "logits":
            return tf.nn.softmax(outputs)
        if self.outputs == "sigmoid":
            return tf.concat([1.0 - outputs, outputs], axis=-1)
        return outputs

    def per_example_loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        """Cross-entropy of each example, unweighted."""
        labels = tf.convert_to_tensor(labels)
        if self._form(labels.shape) == "rows":
            if self.outputs == "logits":
                return tf.nn.softmax_cross_entropy_with_logits(
                    tf.cast(labels, tf.float32), tf.cast(outputs, tf.float32)
                )
            chosen = tf.clip_by_value(self.probabilities(outputs), _EPSILON, 1.0)
            return -tf.reduce_sum(tf.cast(labels, tf.float32) * tf.math.log(chosen), axis=-1)
        labels = self.class_ids(labels)
        if self.outputs == "logits":
            return tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels, tf.cast(outputs, tf.float32)
            )
        chosen = tf.gather(self.probabilities(outputs), labels, axis=-1, batch_dims=1)
        return -tf.math.log(tf.clip_by_value(chosen, _EPSILON, 1.0))

    def check_labels(self, labels) -> None:
        """Refuses labels (a tensor, or its `tf.TensorSpec` at start-up) of a shape not taken.

        Raises:
          UserError: labels of another shape than `_CLASS_SHAPES`; one line.
        """
        if isinstance(labels, tf.TensorSpec | tf.Tensor):
            self._form(labels.shape)

    def class_ids(self, labels: tf.Tensor) -> tf.Tensor:
        """`labels` (ids `(batch,)` or `(batch, 1)`, or one-hot rows) as class ids, `(batch,)`.

        Raises:
          UserError: labels of another shape (one line, through a traced step too).
        """
        labels = tf.convert_to_tensor(labels)
        form = self._form(labels.shape)
        if form == "rows":
            return tf.argmax(labels, axis=-1, output_type=tf.int32)
        return tf.cast(_flat(labels, form), tf.int32)

    def _form(self, shape: tf.TensorShape) -> str:
        form = _form(shape, self.num_classes)
        if not form:
            task = f"classification ({self.num_classes} classes)"
            raise _refused(_labels_refused(shape, task, _CLASS_SHAPES))
        return form

    def _metric_sums(self, labels, outputs, per_example_loss, weights) -> dict:
        labels = self.class_ids(labels)
        # Softmax keeps the order of the logits: the prediction needs no probabilities.
        scores = outputs if self.outputs == "logits" else self.probabilities(outputs)
        predicted = tf.argmax(scores, axis=-1, output_type=tf.int32)
        correct = tf.cast(tf.equal(predicted, labels), tf.float32)
        sums = {"correct": tf.reduce_sum(correct if weights is None else weights * correct)}
        if weights is None and (self.class_names or self.num_classes == 2):
            weights = tf.ones_like(correct)
        if self.class_names:  # per class: the weight of its examples, and of those right
            classes = len(self.class_names)
            sums["class_weight"] = tf.math.unsorted_segment_sum(weights, labels, classes)
            sums["class_correct"] = tf.math.unsorted_segment_sum(weights * correct, labels, classes)
        if self.num_classes == 2:
            sums.update(_score_histograms(labels, self.probabilities(outputs), weights))
        return sums

    def metrics(self, sums: dict) -> dict[str, float]:
        """Means over the weighted examples (and AUC from the score histograms)."""
        n = _total_weight(sums)
        metrics = {"loss": sums["loss"] / n, "accuracy": sums["correct"] / n}
        if "positives" in sums:
            metrics["auc"] = auc(sums["positives"], sums["negatives"])
        for i, name in enumerate(self.class_names):  # classes with examples in these sums
            if sums["class_weight"][i] > 0:
                right = sums["class_correct"][i] / sums["class_weight"][i]
                metrics[f"accuracy/{name}"] = float(right)
        return metrics


class Regression(_Objective):
    """Mean squared error; mean absolute error."""

    name = "regression"
    outputs = "values"

    def per_example_loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        """Squared error of each example, unweighted."""
        outputs = tf.convert_to_tensor(outputs)
        form = _form(outputs.shape, 0)
        if not form:
            raise _refused(
                f"The model's outputs are shaped {_shape(outputs.shape)}; regression takes one "
                "output per example: end the model in `Dense(1)`, or compile it with a loss "
                "that takes them."
            )
        labels = tf.convert_to_tensor(labels)
        self.check_labels(labels)
        error = tf.cast(_flat(outputs, form), tf.float32) - tf.cast(
            _flat(labels, _form(labels.shape, 0)), tf.float32
        )
        return tf.square(error)

    def check_labels(self, labels) -> None:
        """Refuses labels (a tensor, or its `tf.TensorSpec` at start-up) of a shape not taken.

        Raises:
          UserError: labels of another shape than `_VALUE_SHAPES`; one line.
        """
        if isinstance(labels, tf.TensorSpec | tf.Tensor) and not _form(labels.shape, 0):
            raise _refused(_labels_refused(labels.shape, "regression", _VALUE_SHAPES))

    def _metric_sums(self, labels, outputs, per_example_loss, weights) -> dict:
        errors = tf.sqrt(per_example_loss)
        return {"abs_error": tf.reduce_sum(errors if weights is None else weights * errors)}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Means over the weighted examples."""
        n = _total_weight(sums)
        return {"loss": sums["loss"] / n, "mae": sums["abs_error"] / n}


def for_spec(
    num_classes: int, outputs: str = "logits", class_names: tuple[str, ...] = ()
) -> Classification | Regression:
    """The task for data with `num_classes` classes (0 = regression).

    `outputs` is what a classification model outputs (see `OUTPUT_KINDS`);
    `class_names` name the classes, where the labels have names.
    """
    if num_classes > 0:
        return Classification(num_classes, outputs, class_names)
    return Regression()


_CLASS_SHAPES = "class ids shaped `(batch,)` or `(batch, 1)`, or one-hot `(batch, num_classes)`"
_VALUE_SHAPES = "values shaped `(batch,)` or `(batch, 1)`"


def _form(shape: tf.TensorShape, num_classes: int) -> str:
    """How a batch of `shape` holds one label (or output) per example, "" if it does not.

    "flat" `(batch,)`, "column" `(batch, 1)`, "rows" `(batch, num_classes)` (class
    weights, one-hot or soft; classification only), or "unknown" (a rank or
    width not known while tracing: read as one value per example, as before).
    A `(batch, 1)` label taken as it is would broadcast against `(batch,)`
    predictions into a `(batch, batch)` loss.
    """
    if shape.rank is None or (shape.rank == 2 and shape[-1] is None):
        return "unknown"
    if shape.rank == 1:
        return "flat"
    if shape.rank == 2 and shape[-1] == 1:
        return "column"
    if shape.rank == 2 and num_classes > 1 and shape[-1] == num_classes:
        return "rows"
    return ""


def _flat(values: tf.Tensor, form: str) -> tf.Tensor:
    """`values` of `form` "flat", "column" or "unknown" as `(batch,)`."""
    if form == "column":
        return tf.squeeze(values, -1)
    return values if form == "flat" else tf.reshape(values, [-1])


def _labels_refused(shape: tf.TensorShape, task: str, shapes: str) -> str:
    return (
        f"The dataset's labels are shaped {_shape(shape)}; {task} takes {shapes}: reshape "
        "them in the dataset (e.g. `labels[:, 0]`), or compile the model with a loss that "
        "takes them."
    )


def _shape(shape: tf.TensorShape) -> str:
    dims = ["batch" if i == 0 else str(d) for i, d in enumerate(shape.as_list())]
    return f"({', '.join(dims)})"


def _refused(message: str) -> UserError:
    """A one-line `UserError`, raised as it is through AutoGraph while the step is traced."""
    return tf_patches.raised_through_autograph(UserError(message))


def _total_weight(sums: dict) -> float:
    """What means divide by: the total weight (sums from before weights: the examples)."""
    total = sums.get("weight", sums.get("examples", 0.0))
    return total if total > 0 else 1.0


def _score_histograms(labels: tf.Tensor, probabilities: tf.Tensor, weights: tf.Tensor) -> dict:
    """Weighted counts of positives and negatives per bucket of the positive-class score.

    Histograms add up over replicas and batches, so the AUC of a whole eval
    pass is exact up to the bucket width.
    """
    buckets = tf.cast(probabilities[:, 1] * AUC_BUCKETS, tf.int32)
    buckets = tf.clip_by_value(buckets, 0, AUC_BUCKETS - 1)
    positive = weights * tf.cast(tf.equal(labels, 1), tf.float32)
    negative = weights - positive
    return {
        "positives": tf.math.unsorted_segment_sum(positive, buckets, AUC_BUCKETS),
        "negatives": tf.math.unsorted_segment_sum(negative, buckets, AUC_BUCKETS),
    }


def auc(positives, negatives) -> float:
    """Area under the ROC curve from score histograms (ties count half)."""
    positives, negatives = np.asarray(positives, float), np.asarray(negatives, float)
    total = positives.sum() * negatives.sum()
    if total == 0:
        return float("nan")
    above = np.cumsum(positives[::-1])[::-1] - positives  # positives scored in higher buckets
    return float(np.sum(negatives * (above + 0.5 * positives)) / total)
