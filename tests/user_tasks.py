"""Users' own tasks for the tests: a good one, and ones with the mistakes users make."""

import keras
import numpy as np
import tensorflow as tf

from trainer.loop.tasks import Task

_RNG = np.random.RandomState(0)
FEATURES = {
    "pixels": _RNG.rand(256, 16).astype("float32"),
    "group": _RNG.randint(0, 4, 256).astype("int64"),
}
LABELS = ((FEATURES["pixels"][:, :8].sum(1) > 4) + 2 * (FEATURES["group"] > 1)).astype("int32")


class DictTask(Task):
    """Dict features (floats and ids), a model compiled by the task's `loss` and `metrics`."""

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metrics = ["accuracy"]

    def build_model(self) -> keras.Model:
        pixels = keras.Input((16,), name="pixels")
        group = keras.Input((), name="group", dtype="int64")
        embedded = keras.layers.Embedding(4, 3)(group)
        hidden = keras.layers.Dense(16, activation="relu")(
            keras.layers.Concatenate()([pixels, embedded])
        )
        return keras.Model({"pixels": pixels, "group": group}, keras.layers.Dense(4)(hidden))

    def dataset_fn(self, input_context, split, global_batch_size):
        part = slice(0, 192) if split == "train" else slice(192, 256)
        features = {name: values[part] for name, values in FEATURES.items()}
        examples = tf.data.Dataset.from_tensor_slices((features, LABELS[part]))
        examples = examples.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        if split == "train":
            examples = examples.shuffle(192, seed=0)
        return examples.batch(batch, drop_remainder=split == "train")


class WrongKeys(DictTask):
    """The model reads `image`; the data has `pixels` and `group`."""

    def build_model(self) -> keras.Model:
        image = keras.Input((16,), name="image")
        group = keras.Input((), name="group", dtype="int64")
        return keras.Model({"image": image, "group": group}, keras.layers.Dense(4)(image))


def _scalar_loss(labels, outputs):
    """Reduces the batch itself: not one loss per example."""
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, outputs, True))


class ScalarLoss(DictTask):
    loss = staticmethod(_scalar_loss)


class NoDataset:
    """Has a model but no input pipeline."""

    def __init__(self, config):
        pass

    def build_model(self):
        return DictTask(None).build_model()


class Uncompiled(DictTask):
    loss = None


def broken_dataset_fn(config):
    """A task whose input pipeline has a bug of the user's own."""
    task = DictTask(config)

    def dataset_fn(input_context, split, global_batch_size):
        raise TypeError("bug in the user's pipeline")

    task.dataset_fn = dataset_fn
    return task
