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
) -> Callable:
    """One optimizer step on one replica's batch `(x, y)`; returns the task's sums."""

    def step(batch) -> dict:
        x, y = batch
        replica = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            per_example = task.per_example_loss(y, outputs)
            loss = tf.reduce_sum(per_example) / global_batch_size
            if model.losses:  # regularisers: the same on every replica, so split evenly
                loss += tf.add_n(model.losses) / replica.num_replicas_in_sync
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if clip_global_norm:
            grads = _clip_summed(grads, clip_global_norm, replica)
        optimizer.apply_gradients(zip(grads, variables))
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
