"""An image model from `keras.applications` on images written to TFRecord, with augmentation.

    towerflow --config=examples/images.py --strategy=mirrored

MobileNetV2 (`weights=None`: trained from scratch, nothing downloaded), with
its BatchNormalization layers and a Dropout head, on the bundled digits
drawn as 32x32 RGB images. The task writes them to TFRecord files once
(`task.data_dir`), then reads them with its own `dataset_fn`: files sharded
per input pipeline, decoded, and in training augmented (random shifts and
brightness, seeded, so a resumed run sees the same batches). 300 steps of
128 take about 80 s on 2 CPU cores and reach 0.7-0.8 eval accuracy (a run
this short varies from run to run; BatchNormalization momentum 0.9, so its
moving statistics settle in time).
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import trainer
from examples import digits
from trainer import Task

SIZE = 32  # MobileNetV2's smallest input
SHARDS = 4  # TFRecord files per split


def get_config():
    """towerflow's default config with this task and its options."""
    c = trainer.default_config()
    c.task.name = "examples.images:DigitImages"
    c.task.data_dir = os.path.join(tempfile.gettempdir(), "towerflow-digit-images")
    c.task.alpha = 0.35  # MobileNetV2's width multiplier
    c.task.dropout = 0.2  # before the classifier
    c.train.steps = 300
    c.train.checkpoint_every = 100
    c.eval.every = 100
    c.optimizer.learning_rate = 3e-3
    return c


class DigitImages(Task):
    """Digits as 32x32 RGB images from TFRecord files, classified by MobileNetV2."""

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metrics = ["accuracy"]

    def build_model(self) -> keras.Model:
        """Not compiled: the task's `loss` and `metrics` above are used."""
        body = keras.applications.MobileNetV2(
            input_shape=(SIZE, SIZE, 3),
            alpha=self.config.task.alpha,
            include_top=False,
            weights=None,
            pooling="avg",
        )
        for layer in body.layers:  # moving statistics that settle within a short run
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.momentum = 0.9
        image = keras.Input((SIZE, SIZE, 3), name="image")
        x = keras.layers.Dropout(self.config.task.dropout)(body(image))
        return keras.Model(image, keras.layers.Dense(10, name="logits")(x), name="mobilenet_v2")

    def dataset_fn(self, input_context, split: str, global_batch_size: int) -> tf.data.Dataset:
        pattern = os.path.join(write_tfrecords(self.config.task.data_dir), f"{split}-*.tfrecord")
        files = tf.data.Dataset.list_files(pattern, shuffle=False)
        files = files.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        records = files.interleave(tf.data.TFRecordDataset)  # in file order
        examples = records.map(_decode, num_parallel_calls=tf.data.AUTOTUNE)
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        if split == "eval":
            return examples.batch(batch).prefetch(tf.data.AUTOTUNE)
        examples = examples.shuffle(2_000, seed=self.config.seed)
        examples = examples.map(_augment(self.config.seed), num_parallel_calls=tf.data.AUTOTUNE)
        return examples.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def write_tfrecords(directory: str) -> str:
    """Writes the digits as 32x32 RGB PNG records into `directory`, once; returns it."""
    if os.path.exists(os.path.join(directory, "done")):
        return directory
    staging = tempfile.mkdtemp(prefix="staging-", dir=os.path.dirname(directory) or ".")
    for split in ("train", "eval"):
        images, labels = digits.load(split)
        big = tf.image.resize(images, (SIZE, SIZE), method="nearest").numpy()
        rgb = (np.repeat(big, 3, axis=-1) * 255).astype("uint8")
        for shard in range(SHARDS):
            path = os.path.join(staging, f"{split}-{shard}.tfrecord")
            with tf.io.TFRecordWriter(path) as writer:
                for image, label in zip(rgb[shard::SHARDS], labels[shard::SHARDS]):
                    writer.write(_example(image, label))
    open(os.path.join(staging, "done"), "w").close()
    try:
        os.rename(staging, directory)  # another process may have written it meanwhile
    except OSError:
        tf.io.gfile.rmtree(staging)
    return directory


def _example(image: np.ndarray, label: int) -> bytes:
    feature = {
        "image": tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[tf.io.encode_png(image).numpy()])
        ),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _decode(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    parsed = tf.io.parse_single_example(
        record,
        {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    image = tf.cast(tf.io.decode_png(parsed["image"], channels=3), tf.float32) / 127.5 - 1.0
    return tf.ensure_shape(image, (SIZE, SIZE, 3)), tf.cast(parsed["label"], tf.int32)


def _augment(seed: int):
    """Random shifts of up to 4 pixels and brightness changes, seeded by example."""

    def augment(image: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        padded = tf.image.pad_to_bounding_box(image + 1.0, 4, 4, SIZE + 8, SIZE + 8) - 1.0
        image = tf.image.random_crop(padded, (SIZE, SIZE, 3), seed=seed)
        image = tf.image.random_brightness(image, 0.2, seed=seed)
        return image, label

    return augment
