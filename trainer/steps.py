"""Per-replica train and eval steps.

Each step runs in replica context on one replica's share of the global batch,
`(features, labels)` or `(features, labels, sample_weights)`, and returns
weighted sums (see `trainer.tasks`). The loss is scaled by the global batch
size, so summing gradients over replicas gives the global-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf


def make_train_step(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    task,
    global_batch_size: int,
    clip_global_norm: float = 0.0,
    jit_compile: bool = False,
    custom_step: Callable | None = None,
) -> Callable:
    """One optimizer step on one replica's batch `(x, y)`; returns the task's sums.

    `task` gives this replica's share of the loss and the step's sums
    (`train_sums`). A user's task may bring its own step instead,
    `custom_step(model, optimizer, features, labels, weights, replica_loss)`,
    where `replica_loss(outputs)` is the task's `(loss share, sums)`; it applies
    its own gradients and returns the sums.

    With `jit_compile`, XLA compiles the forward and backward pass; the update
    stays outside, where the strategy aggregates gradients across replicas
    (which one XLA computation on one device cannot do). XLA also needs the
    variables on the device that computes, which rules out `central_storage`.
    """

    def gradients(x, y, weights) -> tuple:
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss, sums = task.train_sums(model, x, y, outputs, weights, global_batch_size)
            scaled = optimizer.scale_loss(loss)  # the loss itself, unless float16 loss scaling
        return tape.gradient(scaled, model.trainable_variables), sums

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True)

    def step(batch) -> dict:
        # Train batches are always full (endless streams, remainders dropped), so
        # unlike eval there is no empty batch to pad, and padding would skew the
        # batch statistics of layers such as BatchNormalization.
        x, y, weights = unpack(batch)
        weights = _weights(weights, y)
        if custom_step is not None:
            return custom_step(model, optimizer, x, y, weights, replica_loss(x, y, weights))
        grads, sums = gradients(x, y, weights)
        if clip_global_norm:
            # Loss-scaled gradients are clipped at the scaled norm.
            norm = clip_global_norm * optimizer.scale_loss(tf.constant(1.0))
            grads = _clip_summed(grads, norm, tf.distribute.get_replica_context())
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return sums

    def replica_loss(x, y, weights) -> Callable:
        return lambda outputs: task.train_sums(model, x, y, outputs, weights, global_batch_size)

    return step


def _clip_summed(grads: list, clip_norm: float, replica) -> list:
    """Clips the gradient summed over replicas, returned as equal per-replica parts.

    The optimizer sums what every replica passes it; passing total/replicas from
    each replica makes that sum the clipped total.
    """
    total = replica.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    clipped, _ = tf.clip_by_global_norm(total, clip_norm)
    return [g / replica.num_replicas_in_sync for g in clipped]


def make_eval_step(model: keras.Model, task) -> Callable:
    """Forward pass on one replica's batch; returns the task's sums.

    The last batch of an eval pass is short, and a replica may get no examples
    at all. Some kernels return wrong shapes for an empty batch (TF's oneDNN
    `Conv2D` on CPU), so an empty batch gets one padding row of weight 0: the
    model always sees at least one example, and the sums count only real ones.
    """

    def step(batch) -> dict:
        x, y, weights = unpack(batch)
        examples = _rows(y)
        real = tf.maximum(examples, 1)
        x, y, weights = tf.nest.map_structure(
            lambda t: _pad_to(t, real), (x, y, _weights(weights, y))
        )
        weights *= tf.cast(tf.range(real) < examples, weights.dtype)  # the padding weighs 0
        outputs = model(x, training=False)
        return task.eval_sums(x, y, outputs, weights, examples)

    return step


def unpack(batch) -> tuple:
    """`(features, labels, weights)` from a 2- or 3-tuple; weights None if absent."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            "A dataset must yield `(features, labels)` or `(features, labels, sample_weights)`; "
            f"got {type(batch).__name__} of {len(tf.nest.flatten(batch))} tensors."
        )
    return (*batch, None) if len(batch) == 2 else tuple(batch)


def _rows(labels) -> tf.Tensor:
    """The number of examples in a batch (rows of its first label tensor)."""
    return tf.shape(tf.nest.flatten(labels)[0], out_type=tf.int32)[0]


def _weights(weights, labels) -> tf.Tensor:
    """Per-example weights as float32: the dataset's, or 1 for every example."""
    if weights is None:
        return tf.ones([_rows(labels)], tf.float32)
    return tf.reshape(tf.cast(weights, tf.float32), [-1])


def _pad_to(tensor, rows: tf.Tensor) -> tf.Tensor:
    """`tensor` with zero rows appended up to `rows` (its static inner shape kept)."""
    tensor = tf.convert_to_tensor(tensor)
    missing = tf.maximum(rows - tf.shape(tensor, out_type=tf.int32)[0], 0)
    paddings = [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1)
    return tf.pad(tensor, paddings, constant_values=tf.zeros([], tensor.dtype))
