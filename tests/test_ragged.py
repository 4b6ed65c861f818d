"""Multi-valued features (ragged tensors) through training, evaluation, export and serving.

A list of tags per example, from a user's `dataset_fn` under `mirrored`
(in-process) and from a TFRecord `var` feature under `one_device` and a
`parameter_server` cluster; the eval split (50 examples) ends in a short
batch, and under `mirrored` some replicas get no example of it. The
TFRecord feature is a ragged tensor once parsed, and takes the user
pipeline's path from there: the replicas' split is checked once, with the
user's. The export serves the tags as their values and row lengths. The
tags decide the label, so a model that reads them reaches accuracy 0.9 or
more (1.0 in-process here).
"""

import keras
import numpy as np
import tensorflow as tf

from tests.helpers import tiny_config, train_on_cluster
from trainer.loop import export, steps, train

TRAIN_EXAMPLES, EVAL_EXAMPLES, TAGS = 192, 50, 20
LABEL_TAG = TAGS - 1  # the first tag of every odd example, never any other


def _examples(n: int, offset: int) -> tuple[dict, tf.Tensor]:
    """`n` examples: 1-4 tags each (the first tells the class) and a float `x`."""
    i = tf.range(offset, offset + n, dtype=tf.int64)
    labels = i % 2
    lengths = i % 4
    others = tf.RaggedTensor.from_row_lengths(tf.range(tf.reduce_sum(lengths)) % LABEL_TAG, lengths)
    first = tf.where(labels == 1, tf.constant(LABEL_TAG, tf.int64), 0)[:, None]
    tags = tf.concat([first, others], axis=1)
    return {"tags": tags, "x": tf.cast(i % 3, tf.float32)}, labels


def dataset(input_context, split, global_batch_size):
    """A user's pipeline yielding a ragged `tags` feature."""
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    n, offset = (TRAIN_EXAMPLES, 0) if split == "train" else (EVAL_EXAMPLES, 1000)
    examples = tf.data.Dataset.from_tensor_slices(_examples(n, offset))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    if split == "train":
        examples = examples.shuffle(n, seed=1)
    return examples.batch(batch, drop_remainder=split == "train")


class MeanEmbedding(keras.layers.Layer):
    """The mean of the tags' embeddings."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(TAGS, 4), initializer="random_normal")

    def call(self, ids):
        return tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1)


def model(spec, config):
    """A user's model of a ragged `tags` input and a scalar `x`."""
    tags = keras.Input(shape=(None,), dtype="int64", ragged=True, name="tags")
    x = keras.Input(shape=(), name="x")
    hidden = keras.layers.Concatenate()([MeanEmbedding()(tags), keras.layers.Reshape((1,))(x)])
    return keras.Model({"tags": tags, "x": x}, keras.layers.Dense(spec.num_classes)(hidden))


FLAGS = {
    "data.num_classes": 2,
    "model.name": "tests.test_ragged:model",
    "train.global_batch_size": 16,
    "eval.global_batch_size": 16,
    "train.steps": 40,
    "train.steps_per_loop": 20,
    "train.export": True,
    "optimizer.learning_rate": 0.05,
}


def _served(export_dir) -> np.ndarray:
    """The classes the export gives two examples: tags [19, 3] (class 1) and [0] (class 0)."""
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    outputs = serve(
        tags=tf.constant([LABEL_TAG, 3, 0], tf.int64),
        tags_row_lengths=tf.constant([2, 1], tf.int64),
        x=tf.constant([1.0, 2.0]),
    )
    return outputs["classes"].numpy()


def _check(results: dict, model_dir, accuracy: float = 0.9) -> None:
    assert results["step"] == 40
    assert results["eval"]["examples"] == EVAL_EXAMPLES
    assert np.isfinite(results["eval"]["loss"]), "a padded row made the loss NaN"
    assert results["eval"]["accuracy"] >= accuracy, results["eval"]  # the tags tell the class
    np.testing.assert_array_equal(_served(model_dir / "export"), [1, 0])


def test_a_ragged_feature_of_a_users_pipeline_trains_evaluates_and_serves_under_mirrored(
    tmp_path,
):
    # 2 replicas (of 8 examples each): the eval's last batch of 2 leaves the second with none.
    mirrored = {"strategy.name": "mirrored", "strategy.mirrored.devices": "CPU:0,CPU:1"}
    config = tiny_config(**FLAGS, **mirrored, **{"data.name": "tests.test_ragged:dataset"})
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    _check(results, tmp_path / "model")


def _write_tfrecord(path, n: int, offset: int) -> None:
    features, labels = _examples(n, offset)
    # As Python values at once: an eager tensor a row is slow.
    rows = zip(features["tags"].to_list(), features["x"].numpy(), labels.numpy())
    with tf.io.TFRecordWriter(str(path)) as writer:
        for tags, x, label in rows:
            feature = {
                "tags": tf.train.Feature(int64_list=tf.train.Int64List(value=tags)),
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[x])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


def _tfrecord_fields(tmp_path) -> dict:
    """TFRecord files of a `var` (ragged) `tags` feature, and the data fields that read them."""
    _write_tfrecord(tmp_path / "train.tfrecord", TRAIN_EXAMPLES, 0)
    _write_tfrecord(tmp_path / "eval.tfrecord", EVAL_EXAMPLES, 1000)
    return {
        "data.name": "tfrecord",
        "data.features": "tags:int64:var,x:float32",
        "data.train_files": str(tmp_path / "train.tfrecord"),
        "data.eval_files": str(tmp_path / "eval.tfrecord"),
    }


def test_a_tfrecord_var_feature_trains_evaluates_and_serves(tmp_path):
    config = tiny_config(**FLAGS, **_tfrecord_fields(tmp_path), **{"strategy.name": "one_device"})
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    _check(results, tmp_path / "model")


def test_a_ragged_feature_trains_evaluates_and_serves_on_a_parameter_server_cluster(tmp_path):
    """Read from TFRecord `var` features; a user's ragged pipeline takes the same path after.

    Both sources train, evaluate and serve in-process above, with the same checks.
    One worker: a worker's steps and the chief's evaluation are the cluster's path; a
    second worker would add only time.
    """
    flags = {**FLAGS, **_tfrecord_fields(tmp_path), "devices.logical_cpus": 0}
    results = train_on_cluster(tmp_path, "--strategy=parameter_server", *_flags(flags), workers=1)
    # 40 asynchronous steps: 0.86-1.0 seen quietly, 0.7 once under load (chance 0.5).
    _check(results, tmp_path / "model", accuracy=0.65)


def _flags(fields: dict) -> list[str]:
    return [f"--config.{field}={value}" for field, value in fields.items()]


# --- padding a short eval batch ------------------------------------------------------


def test_an_empty_eval_batch_of_ragged_and_sparse_features_is_padded_with_a_zero_row():
    class Sizes(keras.Model):
        def call(self, inputs):
            tags, sparse = inputs["tags"], inputs["sparse"]
            rows = tf.cast(tags.nrows(), tf.float32) + tf.cast(sparse.dense_shape[0], tf.float32)
            return tf.stack([tf.reduce_mean(tags, axis=1), tf.fill([tags.nrows()], rows)], 1)

    class Seen:
        def eval_sums(self, features, labels, outputs, weights, examples):
            return {"outputs": outputs, "weights": weights, "examples": examples}

    empty = {
        "tags": tf.RaggedTensor.from_row_lengths(tf.zeros([0]), tf.zeros([0], tf.int64)),
        "sparse": tf.SparseTensor(tf.zeros([0, 2], tf.int64), tf.zeros([0]), [0, 3]),
    }
    seen = steps.make_eval_step(Sizes(), Seen())((empty, tf.zeros([0], tf.int32)))
    np.testing.assert_array_equal(seen["outputs"], [[0.0, 2.0]])  # one padding row each
    np.testing.assert_array_equal(seen["weights"], [0.0])
    assert int(seen["examples"]) == 0


def test_the_export_serves_a_sparse_input_as_its_parts(tmp_path):
    ids = keras.Input(shape=(5,), sparse=True, name="ids")
    total = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)(ids)  # a row's sum
    model = keras.Model({"ids": ids}, total)
    export.export(model, str(tmp_path / "export"), None, 0)
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    outputs = serve(
        ids_indices=tf.constant([[0, 1], [0, 4], [1, 2]], tf.int64),
        ids_values=tf.constant([1.0, 2.0, 5.0]),
        ids_dense_shape=tf.constant([2, 5], tf.int64),
    )
    np.testing.assert_allclose(outputs["predictions"], [3.0, 5.0])
