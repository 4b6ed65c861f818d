"""Synthetic, learnable data of any size (`data.name=synthetic`), made from each index."""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_collections
import numpy as np
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data.base import (
    Dataset,
    check_classes,
    check_positive,
    check_shape,
    indexed_dataset,
    register,
)

_SYNTHETIC_SEED = 1234  # fixes the synthetic examples and their teacher
_TEACHER_FEATURES = 64  # synthetic: the teacher sees at most this many pooled inputs


@register("synthetic")
def _synthetic(config: ml_collections.ConfigDict) -> Dataset:
    """Learnable data of any size; each example is made from its index alone.

    Inputs are uniform with mean 0 and variance 1 (as good as normal here), drawn
    by a hash of the index (see `_uniforms`). A fixed random linear teacher reads the sums of up
    to 64 contiguous blocks of the flattened input. The label is the argmax of
    its logits plus noise, or for regression its output plus noise.
    """
    options = config.synthetic
    num_examples = check_positive("data.synthetic.num_examples", options.num_examples)
    shape = check_shape("data.synthetic.input_shape", options.input_shape)
    classes = check_classes("data.synthetic.num_classes", options.num_classes)
    if options.noise < 0:
        raise UserError(
            f"`data.synthetic.noise` ({options.noise}) must be >= 0; "
            "set e.g. `--config.data.synthetic.noise=0.1`."
        )
    size, heads = math.prod(shape), max(classes, 1)  # heads: logits, or one output
    features, blocks = _block_features(size)
    teacher = np.random.RandomState(_SYNTHETIC_SEED).normal(size=(blocks, heads))
    teacher = tf.constant(teacher / np.sqrt(blocks), tf.float32)
    bound = 3**0.5  # uniform on [-bound, bound] has variance 1

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        draws = _uniforms(indices, size + heads, _SYNTHETIC_SEED) * (2 * bound) - bound
        inputs, noise = draws[:, :size], draws[:, size:]
        outputs = tf.matmul(features(inputs), teacher) + options.noise * noise
        labels = tf.argmax(outputs, axis=-1, output_type=tf.int32) if classes else outputs[:, 0]
        return tf.reshape(inputs, [-1, *shape]), labels

    return indexed_dataset(config, num_examples, shape, classes, decode, "`data.synthetic`")


def _uniforms(indices: tf.Tensor, count: int, seed: int) -> tf.Tensor:
    """`count` values uniform in [0, 1) for each of `indices`, made from the index alone.

    A counter-based hash (Wellons' "lowbias32") of (seed, index, position), in a
    few integer ops over the whole batch at once: some 20x faster than a
    stateless random op per example, so the input pipeline is never what a
    training step waits for.
    """
    indices = tf.cast(indices, tf.int64)
    low = tf.cast(tf.bitwise.bitwise_and(indices, 0xFFFFFFFF), tf.uint32)
    high = tf.cast(tf.bitwise.right_shift(indices, 32), tf.uint32)
    keys = _hash32(tf.bitwise.bitwise_xor(_hash32(low + tf.constant(seed, tf.uint32)), high))
    positions = tf.cast(tf.range(count), tf.uint32) * tf.constant(0x9E3779B9, tf.uint32)
    bits = _hash32(keys[:, None] + positions[None, :])
    return tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * (1.0 / (1 << 24))


def _hash32(x: tf.Tensor) -> tf.Tensor:
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, shift))
        x = x * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _block_features(size: int) -> tuple[Callable[[tf.Tensor], tf.Tensor], int]:
    """Sums over contiguous blocks of flat inputs, scaled to unit variance; and their count."""
    width = -(-size // _TEACHER_FEATURES)  # inputs per block, rounded up
    blocks = -(-size // width)
    padding = blocks * width - size  # less than `width`: only the last block is short
    counts = np.full(blocks, width)
    counts[-1] -= padding
    scale = tf.constant(1 / np.sqrt(counts), tf.float32)

    def features(flat: tf.Tensor) -> tf.Tensor:
        if padding:
            flat = tf.pad(flat, [[0, 0], [0, padding]])
        return tf.reduce_sum(tf.reshape(flat, [-1, blocks, width]), axis=2) * scale

    return features, blocks
