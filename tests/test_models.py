"""Every built-in model trains and evaluates; partial eval batches count exactly; probabilities."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
from tests.helpers import tiny_config
from towerflow.errors import UserError
from trainer.loop import models, steps, train


def _image_config(**overrides):
    """The digits (8x8x1 images, 360 held out), small convolutional models."""
    return tiny_config(
        **{
            "model.filters": 4,
            "model.blocks": 1,
            "model.dropout": 0.1,
            **overrides,
        }
    )


def tiny_ctr_config(**overrides):
    """configs/ctr.py's data and model, made small; `overrides` as for `tiny_config`."""
    config = tiny_config(**overrides)
    ctr = configs.ctr.get_config()
    config.data, config.model = ctr.data, ctr.model
    config.data.ctr.num_examples = 2000
    config.data.ctr.ids_per_field = 100
    config.data.ctr.vocab_size = 1000  # the model's table follows it
    config.model.hidden_units = (16,)
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(name)`: the built-in model `name` after 10 steps and an eval under `default`.

    Trained once for the module: the job, its results, and its eval at a global
    batch of 256 (`_eval`), the reference of the multi-replica evals below.
    """
    runs = {}

    def trained(name: str) -> tuple[train.BuiltJob, dict, dict]:
        if name not in runs:
            overrides = {"strategy.name": "default", "train.steps": 10, "model.name": name}
            if name == "ctr":
                config = tiny_ctr_config(**overrides, **{"model.dropout": 0.1})
            else:
                config = _image_config(**overrides)
            job = train.build(config, str(tmp_path_factory.mktemp(name)))
            results = train.run(job, "train_and_eval")
            runs[name] = job, results, _eval(job)
        return runs[name]

    return trained


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "ctr"])
def test_every_builtin_model_trains_and_evaluates(name, trained):
    job, results, _ = trained(name)
    assert results["step"] == 10
    assert np.isfinite(results["train"]["loss"]) and np.isfinite(results["eval"]["loss"])
    assert results["eval"]["examples"] == job.dataset.spec.eval_size


def _eval(job) -> dict:
    """One eval pass of `job`'s model at a global batch of 256 (the last one partial)."""
    sums = job.strategy.evaluate(
        steps.make_eval_step(job.model, job.objective), job.dataset.eval_fn(256)
    )
    return {**job.objective.metrics(sums), "examples": sums["examples"]}


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_partial_last_eval_batch_counts_exactly(name, strategy, trained, tmp_path):
    """360 examples at 256 over 4 replicas: the last step gives two replicas nothing."""
    reference_job, _, reference = trained(name)
    config = _image_config(**{"strategy.name": strategy, "model.name": name})
    job = train.build(config, str(tmp_path))
    assert job.strategy.num_replicas_in_sync == 4
    job.model.set_weights([w.numpy() for w in reference_job.model.weights])
    got = _eval(job)
    assert got["examples"] == job.dataset.spec.eval_size == 360
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_sample_weights_weigh_the_sums(tmp_path):
    """A dataset may yield `(features, labels, weights)`: weight 0 is no example's loss."""
    job = train.build(_image_config(**{"strategy.name": "mirrored"}), str(tmp_path))
    eval_step = steps.make_eval_step(job.model, job.objective)

    def dataset_fn(weights):
        def fn(context):
            dataset = job.dataset.eval_fn(256)(context)
            return dataset.map(lambda x, y: (x, y, weights(y)))

        return fn

    whole = job.strategy.evaluate(eval_step, dataset_fn(lambda y: tf.ones_like(y, tf.float32)))
    evens = job.strategy.evaluate(eval_step, dataset_fn(lambda y: tf.cast(y % 2 == 0, tf.float32)))
    assert whole["examples"] == evens["examples"] == 360
    assert 0 < evens["weight"] < whole["weight"] == 360
    assert evens["loss"] < whole["loss"]


def softmax_mlp(spec, config) -> keras.Model:
    """A user's builder whose model outputs probabilities, as Keras Applications do."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, activation="softmax")(x))


def test_a_model_that_outputs_probabilities_learns_and_exports_them(tmp_path):
    config = tiny_config(
        **{
            "strategy.name": "mirrored",
            "strategy.mirrored.devices": "CPU:0,CPU:1",  # replicas, at half the tracing of 4
            "model.name": "tests.test_models:softmax_mlp",
            "train.steps": 100,
            "train.steps_per_loop": 100,
            "train.export": True,
            "optimizer.learning_rate": 1e-2,
        }
    )
    job = train.build(config, str(tmp_path))
    assert models.output_kind(job.model) == "probabilities"
    results = train.run(job, "train_and_eval")
    # Treated as logits, probabilities cannot take the loss below log(9 + e) - 1 = 1.46.
    assert results["eval"]["loss"] < 0.5 and results["eval"]["accuracy"] > 0.85
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    x = np.random.RandomState(0).uniform(0, 1, (5, 8, 8, 1)).astype(np.float32)
    probabilities = serve(inputs=tf.constant(x))["probabilities"].numpy()
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(probabilities, job.model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_keras_dropout_in_a_users_model_trains_under_central_storage(tmp_path):
    config = tiny_config(
        **{"strategy.name": "central_storage", "model.name": "tests.test_models:keras_dropout"}
    )
    results = train.train_and_evaluate(config, str(tmp_path), "train")  # what trains
    assert results["step"] == config.train.steps and np.isfinite(results["train"]["loss"])


def keras_dropout(spec, config) -> keras.Model:
    """A user's builder with Keras's own `Dropout` (a seed-generator variable)."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(inputs))
    x = keras.layers.Dropout(0.2)(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def sigmoid_mlp(spec, config) -> keras.Model:
    """A user's builder ending in a sigmoid over every class: not a classifier's output."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, activation="sigmoid")(x))


def test_a_sigmoid_over_many_classes_is_refused_in_one_line(tmp_path):
    config = tiny_config(**{"model.name": "tests.test_models:sigmoid_mlp"})
    with pytest.raises(UserError) as info:
        train.build(config, str(tmp_path / "run"))
    message = str(info.value)
    assert "sigmoid over 10 outputs" in message and "10 classes" in message
    assert "\n" not in message and not (tmp_path / "run").exists()


def mobilenet(spec, config) -> keras.Model:
    """A Keras Applications model as a user's builder: ends in softmax, Rescaling inside."""
    return keras.applications.MobileNetV3Small(
        input_shape=spec.input_shape, weights=None, classes=spec.num_classes, minimalistic=True
    )


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=pytest.mark.slow) for s in ("mirrored", "central_storage")]
)
def test_a_keras_applications_model_evaluates_a_partial_last_batch(strategy, tmp_path):
    def job(name: str):
        config = tiny_config(
            **{
                "strategy.name": name,
                "model.name": "tests.test_models:mobilenet",
                "data.name": "synthetic",
                "data.synthetic.num_examples": 1800,  # 360 held out: 256 + 104
                "data.synthetic.input_shape": (32, 32, 3),
            }
        )
        return train.build(config, str(tmp_path / name))

    reference, distributed = job("one_device"), job(strategy)
    assert models.output_kind(distributed.model) == "probabilities"
    distributed.model.set_weights(reference.model.get_weights())
    got, want = _eval(distributed), _eval(reference)
    assert got["examples"] == want["examples"] == 360
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
