"""The export's serving signature takes the model's real inputs: one tensor, a dict, strings."""

import keras
import numpy as np
import tensorflow as tf

from tests.test_compiled import multi_output
from trainer.loop.export import export


def test_a_dict_input_multi_output_model_serves_its_own_outputs(tmp_path):
    keras.utils.set_random_seed(0)
    model = multi_output()
    path = export(model, str(tmp_path / "export"), None, 0, raw_outputs=True)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    assert set(serve.structured_input_signature[1]) == {"a", "b"}
    x = {"a": np.random.rand(3, 4).astype("float32"), "b": np.random.rand(3, 3).astype("float32")}
    served, direct = serve(**x), model(x)
    assert set(served) == {"cls", "reg"}
    for name in served:
        np.testing.assert_allclose(served[name], direct[name], rtol=1e-6)


def test_string_features_reach_the_exported_model(tmp_path):
    age = keras.Input((1,), name="age")
    city = keras.Input((1,), name="city", dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["paris", "oslo"])(city)
    embedded = keras.layers.Flatten()(keras.layers.Embedding(3, 2)(ids))
    logits = keras.layers.Dense(2)(keras.layers.Concatenate()([age, embedded]))
    model = keras.Model({"age": age, "city": city}, logits)
    path = export(model, str(tmp_path / "export"), None, num_classes=2)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    out = serve(age=tf.constant([[30.0], [40.0]]), city=tf.constant([["oslo"], ["rome"]]))
    np.testing.assert_allclose(out["probabilities"].numpy().sum(-1), [1.0, 1.0], rtol=1e-6)
    direct = model({"age": np.array([[30.0], [40.0]]), "city": np.array([["oslo"], ["rome"]])})
    np.testing.assert_allclose(out["logits"], direct, rtol=1e-6)


def test_a_single_input_model_still_serves_inputs(tmp_path):
    inputs = keras.Input((8, 8, 1))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs)))
    path = export(model, str(tmp_path / "export"), (8, 8, 1), num_classes=10)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    assert set(serve.structured_input_signature[1]) == {"inputs"}
    assert serve(inputs=tf.zeros([2, 8, 8, 1]))["classes"].shape == (2,)
