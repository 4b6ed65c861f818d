"""A model the user compiled: Keras's own loss and metrics, exact under every strategy."""

import json

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import strategies
from tests import helpers
from tests.steps_two_replicas import TWO_CPUS, on_two_cpus
from trainer import data
from trainer.loop import actions, compiled, train


def compiled_mlp(spec, config) -> keras.Model:
    """A small compiled classifier with an L2 regulariser (so `model.losses` counts too)."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(x)
    outputs = keras.layers.Dense(spec.num_classes)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _config(strategy: str, **overrides):
    return helpers.tiny_config(
        **{
            **on_two_cpus(strategy),  # 2 replicas: a split batch, reduced as 4 would be
            "model.name": "tests.test_compiled:compiled_mlp",
            "optimizer.schedule": "constant",
            "optimizer.warmup_steps": 0,
            "optimizer.learning_rate": 0.01,
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[dict, dict, list[float]]]:
    """20 steps of the compiled model under each single-process strategy, one step a block.

    By strategy: the checkpoint's values, the results and each step's loss (as
    `model.fit` logs it).
    """
    runs = {}
    for name in ("one_device", "mirrored", "central_storage"):
        model_dir, losses = tmp_path_factory.mktemp(name), []
        record = actions.Action(lambda output, losses=losses: losses.append(output.metrics["loss"]))
        config = _config(name, **{"train.steps_per_loop": 1})
        results = train.train_and_evaluate(config, str(model_dir), extra_actions=[record])
        runs[name] = (helpers.checkpoint_values(model_dir), results, losses)
    return runs


def test_same_loss_trajectory_as_model_fit(trained):
    losses = trained["one_device"][2]
    steps = len(losses)
    config = _config("one_device")

    # The same model, data order and optimizer through Keras's own loop.
    dataset = data.get(config.data)
    stream = dataset.train_fn(config.train.global_batch_size, config.seed)
    batches = list(stream(tf.distribute.InputContext()).take(steps))
    keras.utils.set_random_seed(config.seed)
    model = compiled_mlp(dataset.spec, config.model)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    fit_losses = [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in batches]
    assert steps == config.train.steps
    np.testing.assert_allclose(losses, fit_losses, rtol=2e-4)
    assert fit_losses[-1] < 0.7 * fit_losses[0]  # it learns: a trajectory worth comparing


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_same_weights_and_metrics_under_every_strategy(trained, strategy):
    reference, reference_results, _ = trained["one_device"]
    values, results, _ = trained[strategy]
    assert reference.keys() == values.keys()
    for key in reference:
        np.testing.assert_allclose(values[key], reference[key], rtol=1e-5, atol=1e-6)
    for name in ("loss", "accuracy"):
        assert results["eval"][name] == pytest.approx(reference_results["eval"][name], rel=1e-5)
    assert results["eval"]["examples"] == 360


def multi_output(spec=None, config=None) -> keras.Model:
    """Two heads on dict inputs, compiled with per-output losses, weights and metrics."""
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")(
        keras.layers.Concatenate()([a, b])
    )
    model = keras.Model(
        {"a": a, "b": b},
        {
            "cls": keras.layers.Dense(2, name="cls")(hidden),
            "reg": keras.layers.Dense(1, name="reg")(hidden),
        },
    )
    model.compile(
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={
            "cls": [
                "accuracy",
                keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent"),
            ],
            "reg": ["mae"],
        },
    )
    return model


def test_multi_output_sums_over_replicas_equal_keras_evaluate():
    rng = np.random.RandomState(0)
    x = {"a": rng.rand(21, 4).astype("float32"), "b": rng.rand(21, 3).astype("float32")}
    y = {"cls": (x["a"].sum(1) > 2).astype("int32"), "reg": x["b"].sum(1).astype("float32")}
    strategy = strategies.get("mirrored", ml_collections.ConfigDict({"devices": TWO_CPUS}))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = multi_output()
        task = compiled.CompiledObjective(
            model, {k: v[:2] for k, v in x.items()}, {k: v[:2] for k, v in y.items()}
        )

    def eval_step(batch):
        features, labels = batch
        weights = tf.ones([tf.shape(labels["cls"])[0]])
        outputs = model(features, training=False)
        return task.eval_sums(features, labels, outputs, weights, tf.size(weights))

    # 21 examples in batches of 8 per replica: the last step's one short, the other empty.
    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(16)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    ours = task.metrics(strategy.evaluate(eval_step, dataset_fn))
    reference = multi_output()  # the same weights, evaluated by Keras on one device
    reference.set_weights(model.get_weights())
    theirs = reference.evaluate(x, y, batch_size=21, verbose=0, return_dict=True)
    assert set(theirs) <= set(ours)
    # Keras's per-output loss trackers ("cls_loss") weigh each batch once when the
    # batch size is not static, so only equal batches make them exact: not compared.
    for name, value in theirs.items():
        if name.endswith("_loss"):
            continue
        assert ours[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.slow  # a cluster; the examples' census one runs in the default tier
def test_the_compiled_example_on_a_parameter_server_cluster(tmp_path):
    """The README's example model under `parameter_server`: 2 workers and 1 ps, as processes."""
    helpers.launched(
        "--workers=2",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        "--config.model.name=examples.compiled_model:build",
        "--config.train.steps=200",
        f"--model_dir={tmp_path / 'run'}",
        cwd=helpers.REPO,
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] >= 200
    assert results["eval"]["examples"] == 360
    assert (
        results["eval"]["accuracy"] > 0.9 and results["eval"]["top3"] > results["eval"]["accuracy"]
    )


def sequential(spec, config, with_input: bool = False) -> keras.Model:
    """A compiled `keras.Sequential`: with no `keras.Input`, it has no variables until called."""
    first = [keras.Input(spec.input_shape)] if with_input else []
    model = keras.Sequential(
        [*first, keras.layers.Flatten(), keras.layers.Dense(spec.num_classes, name="logits")]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


def sequential_with_input(spec, config) -> keras.Model:
    return sequential(spec, config, with_input=True)


@pytest.mark.parametrize("builder", ["sequential", "sequential_with_input"])
def test_a_compiled_sequential_model_trains_and_serves_under_mirrored(builder, tmp_path):
    config = _config(
        "mirrored", **{"model.name": f"tests.test_compiled:{builder}", "train.export": True}
    )
    config.optimizer.learning_rate = 0.1
    results = train.train_and_evaluate(config, str(tmp_path), "train")
    assert results["step"] == 20 and results["train"]["accuracy"] > 0.3
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    out = serve(inputs=tf.zeros((3, *data.get(config.data).spec.input_shape)))
    assert {int(v.shape[0]) for v in out.values()} == {3}
