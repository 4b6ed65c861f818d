"""Per-replica train and eval steps.

Each step runs in replica context on one replica's share of the global batch
and returns sums (see `trainer.tasks`). The loss is scaled by the global batch
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
) -> Callable:
    """One optimizer step on one replica's batch `(x, y)`; returns the task's sums.

    With `jit_compile`, XLA compiles the forward and backward pass; the update
    stays outside, where the strategy aggregates gradients across replicas
    (which one XLA computation on one device cannot do). XLA also needs the
    variables on the device that computes, which rules out `central_storage`.
    """

    def gradients(x, y) -> tuple:
        replica = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            per_example = task.per_example_loss(y, outputs)
            loss = tf.reduce_sum(per_example) / global_batch_size
            if model.losses:  # regularisers: the same on every replica, so split evenly
                loss += tf.add_n(model.losses) / replica.num_replicas_in_sync
            scaled = optimizer.scale_loss(loss)  # the loss itself, unless float16 loss scaling
        return tape.gradient(scaled, model.trainable_variables), outputs, per_example

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True)

    def step(batch) -> dict:
        x, y = batch
        grads, outputs, per_example = gradients(x, y)
        if clip_global_norm:
            # Loss-scaled gradients are clipped at the scaled norm.
            norm = clip_global_norm * optimizer.scale_loss(tf.constant(1.0))
            grads = _clip_summed(grads, norm, tf.distribute.get_replica_context())
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return task.sums(y, outputs, per_example)

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
    """Forward pass on one replica's batch `(x, y)`; returns the task's sums."""

    def step(batch) -> dict:
        x, y = batch
        outputs = model(x, training=False)
        return task.sums(y, outputs, task.per_example_loss(y, outputs))

    return step
