"""The bundled digits as a user's own input pipeline would read them (shared by the examples)."""

import importlib.resources
from collections.abc import Callable

import numpy as np
import tensorflow as tf

TRAIN_EXAMPLES = 1437  # the rest (360) are the eval split


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The images (8x8x1, in [0, 1]) and labels of one split, in a fixed order."""
    asset = importlib.resources.files("trainer") / "assets" / "digits.npz"
    with asset.open("rb") as f, np.load(f) as arrays:
        images = (arrays["images"][..., None] / 16.0).astype("float32")
        labels = arrays["labels"].astype("int32")
    order = np.random.RandomState(0).permutation(len(labels))
    part = order[:TRAIN_EXAMPLES] if split == "train" else order[TRAIN_EXAMPLES:]
    return images[part], labels[part]


def dataset(
    input_context: tf.distribute.InputContext,
    split: str,
    global_batch_size: int,
    seed: int,
    targets: Callable[[np.ndarray, np.ndarray], object] = lambda images, labels: labels,
) -> tf.data.Dataset:
    """`(images, targets(images, labels))` batches of one split, sharded per input pipeline.

    The train split is shuffled with `seed` (so a resumed run sees the same
    batches) and drops its last short batch; the eval split keeps every example.
    """
    images, labels = load(split)
    examples = tf.data.Dataset.from_tensor_slices((images, targets(images, labels)))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    if split == "train":
        examples = examples.shuffle(len(labels), seed=seed)
    return examples.batch(batch, drop_remainder=split == "train")
