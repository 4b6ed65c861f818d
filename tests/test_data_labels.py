"""Labels as users have them: the class count from what the user gave.

A model compiled with its own loss (one sigmoid unit, `binary_crossentropy`)
fed by the user's own `dataset_fn` trains without `data.num_classes`; an
uncompiled one names `data.num_classes` in its error.
"""

import keras
import numpy as np
import tensorflow as tf

from tests.helpers import one_line_error, tiny_config
from trainer import data, models, train


def binary(input_context, split, global_batch_size):
    """A user's pipeline of two classes, as float labels for `binary_crossentropy`."""
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    x = tf.random.stateless_uniform([64, 3], seed=[3, 4])
    y = tf.cast(x[:, 0] + x[:, 1] > 1.0, tf.float32)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return examples.batch(batch, drop_remainder=split == "train")


def sigmoid_model(spec, config, compile=True):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))
    if compile:
        model.compile(loss="binary_crossentropy", metrics=["binary_accuracy"])
    return model


def uncompiled_sigmoid_model(spec, config):
    return sigmoid_model(spec, config, compile=False)


def test_a_compiled_one_unit_sigmoid_model_trains_without_data_num_classes(tmp_path):
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "data.name": "tests.test_data_labels:binary",
            "model.name": "tests.test_data_labels:sigmoid_model",
            "train.global_batch_size": 16,
            "eval.global_batch_size": 16,
            "train.steps": 10,
            "train.export": True,
        }
    )
    assert config.data.num_classes == 10  # the digits default, which says nothing here
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    assert results["step"] == 10 and results["eval"]["examples"] == 64
    assert 0.0 <= results["eval"]["binary_accuracy"] <= 1.0
    serve = tf.saved_model.load(str(tmp_path / "model" / "export")).signatures["serving_default"]
    probability = serve(inputs=tf.constant([[0.9, 0.9, 0.0]]))["outputs"].numpy()
    assert probability.shape == (1, 1) and 0.0 < float(probability[0, 0]) < 1.0


def test_an_uncompiled_sigmoid_model_names_data_num_classes():
    config = tiny_config(**{"model.name": "tests.test_data_labels:uncompiled_sigmoid_model"})
    spec = data.DataSpec((3,), 10, None, None)
    message = one_line_error("`data.num_classes`", models.build, config.model, spec)
    assert "`--config.data.num_classes=2`" in message
    model = models.build(config.model, data.DataSpec((3,), 2, None, None))
    assert np.prod(model.outputs[0].shape[1:]) == 1
