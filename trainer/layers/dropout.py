"""`Dropout` whose masks depend on the step and each example's place in the global batch."""

from __future__ import annotations

import random

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="towerflow")
class Dropout(keras.layers.Layer):
    """`keras.layers.Dropout` whose mask does not depend on how the global batch is split.

    Keras's `Dropout` keeps its random state in a variable that every replica
    advances alike, so under `mirrored` all replicas draw the same mask (and
    under `central_storage` the variable cannot be updated from a replica at
    all). Here each training call draws the mask of the whole global batch
    from a stateless RNG keyed by `(seed, step)`, and a replica keeps the rows
    at its offset in the global batch (`replica_id * per_replica_batch`), so
    example `i` of step `s` gets the same mask under one device or any number
    of replicas. `step` counts this layer's training calls in a variable that
    checkpoints with the model, so a resumed run goes on with the masks it
    would have drawn.

    Drawing the global batch's mask costs each replica the random numbers of
    the whole batch; dropout sits on small activations here, where that is cheap.

    Args:
      rate: the fraction of inputs set to 0, in [0, 1).
      seed: keys the masks; None draws one from Python's `random` (which
        `keras.utils.set_random_seed` seeds).
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= rate < 1:
            raise ValueError(f"`Dropout` `rate` ({rate}) must be in [0, 1).")
        self.rate = float(rate)
        self.seed = random.randrange(2**31) if seed is None else int(seed)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.step = self.add_weight(
            (),
            "zeros",
            dtype="int64",
            trainable=False,
            # Each replica advances its own copy by one a step, so the copies stay
            # equal with no cross-replica exchange inside the step (which an
            # XLA-compiled forward pass could not hold). Where the replicas share
            # one copy (`central_storage`), the plugin keeps the first one's update.
            aggregation="none",
            name="step",
        )

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        replica = tf.distribute.get_replica_context()
        replicas = replica.num_replicas_in_sync if replica else 1
        replica_id = replica.replica_id_in_sync_group if replica else 0
        rows = tf.shape(inputs)[0]
        first = tf.cast(replica_id, tf.int32) * rows
        seed = tf.stack([tf.constant(self.seed, tf.int64), self.step.value])
        shape = tf.concat([[rows * replicas], tf.shape(inputs)[1:]], axis=0)
        # A fixed algorithm, as "auto_select" may pick another on another device.
        # XLA (`train.jit_compile`) draws other numbers than TF's own kernel does,
        # though as independent of the replicas.
        uniform = tf.random.stateless_uniform(shape, seed, alg="philox")
        keep = uniform[first : first + rows] >= self.rate
        # On the TensorFlow variable: Keras's `assign_add` reads, adds and assigns, and
        # between asynchronous workers of a parameter-server cluster steps were lost.
        # In a stateless call (the stages of `pipeline`) the value is a tensor that
        # Keras's own `assign_add` records as the new state.
        value = self.step.value
        if isinstance(value, tf.Variable):
            value.assign_add(1)
        else:
            self.step.assign_add(1)
        scale = tf.cast(1.0 / (1.0 - self.rate), inputs.dtype)
        return tf.where(keep, inputs * scale, tf.zeros_like(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
