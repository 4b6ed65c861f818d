"""The bundled UCI handwritten digits (`data.name=digits`), read from the package's assets."""

from __future__ import annotations

import importlib.resources

import ml_collections
import numpy as np
import tensorflow as tf

from trainer.data.base import Dataset, indexed_dataset, register

_DIGITS_SPLIT_SEED = 0  # fixes the digits train/eval split, whatever `config.seed` is


@register("digits")
def _digits(config: ml_collections.ConfigDict) -> Dataset:
    """The bundled UCI handwritten digits: 1,797 8x8 images in 0..1, 10 classes."""
    asset = importlib.resources.files("trainer") / "assets" / "digits.npz"
    with asset.open("rb") as f, np.load(f) as arrays:
        images, labels = arrays["images"], arrays["labels"]
    order = np.random.RandomState(_DIGITS_SPLIT_SEED).permutation(len(labels))
    x = tf.constant(images[order, :, :, None] / 16.0, tf.float32)
    y = tf.constant(labels[order], tf.int32)

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.gather(x, indices), tf.gather(y, indices)

    return indexed_dataset(config, len(labels), (8, 8, 1), 10, decode, "the bundled `digits`")
