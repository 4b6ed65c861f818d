"""The `pipeline` plugin: stages on logical CPUs train exactly as one device does.

Every run here is a real training job in this process, on the 4 logical
CPUs of `tests/conftest.py`: 20 steps, or one where a test asserts only
where the layers and their state went.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import configs.default
import strategies
from strategies.base import variable_devices
from tests import helpers
from trainer.loop import train

DEEP = (32, 32, 32)  # flatten + 4 dense layers: room for 4 stages


def _train(model_dir, strategy: str, mode: str = "train_and_eval", **overrides) -> train.BuiltJob:
    """A 20-step job under `strategy`, run in `model_dir` (`mode` "train": no eval); the job."""
    config = helpers.tiny_config(
        **{"strategy.name": strategy, "model.hidden_units": DEEP, **overrides}
    )
    job = train.build(config, str(model_dir))
    job.results = train.run(job, mode)
    return job


def _assert_same_checkpoints(a, b) -> None:
    """Every variable (model and optimizer slots) of the newest checkpoints is equal."""
    left, right = helpers.checkpoint_values(a), helpers.checkpoint_values(b)
    assert left.keys() == right.keys()
    for key in left:
        np.testing.assert_allclose(left[key], right[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one_device"), "one_device", **{"train.export": True})


# Two of the four splits in the slow tier: (2, 4) and (4, 1) take every path between them.
@pytest.mark.parametrize(
    "stages,micro_batches",
    [
        pytest.param(2, 1, marks=pytest.mark.slow),
        (2, 4),
        (4, 1),
        pytest.param(4, 4, marks=pytest.mark.slow),
    ],
)
def test_same_weights_as_one_device(one_device, tmp_path, stages, micro_batches):
    job = _train(
        tmp_path,
        "pipeline",
        **{"strategy.pipeline.stages": stages, "strategy.pipeline.micro_batches": micro_batches},
    )
    placement = job.results["placement"]
    assert len(placement["stages"]) == stages
    assert placement["micro_batches"] == micro_batches
    assert job.results["step"] == one_device.results["step"] == 20
    _assert_same_checkpoints(one_device.model_dir, tmp_path)
    np.testing.assert_allclose(
        job.results["train"]["loss"], one_device.results["train"]["loss"], rtol=1e-5
    )
    assert job.results["eval"]["accuracy"] == pytest.approx(
        one_device.results["eval"]["accuracy"], abs=1e-6
    )


def test_stage_i_variables_and_their_optimizer_slots_live_on_device_i(tmp_path):
    job = _train(tmp_path, "pipeline", "train", **{"strategy.pipeline.stages": 4, "train.steps": 1})
    described = job.strategy.describe(job.model.variables)
    stages = described["stages"]
    assert [s["device"] for s in stages] == [f"/device:CPU:{i}" for i in range(4)]
    assert described["compute_devices"] == [s["device"] for s in stages]
    layers = [name for s in stages for name in s["layers"]]
    model_layers = [layer.name for layer in job.model.layers[1:]]  # after the InputLayer
    assert layers == model_layers, "every layer in one stage, in order"
    stage_of = {name: i for i, s in enumerate(stages) for name in s["layers"]}
    for layer in job.model.layers[1:]:
        for variable in layer.variables:
            where = described["variables"][variable.path]
            assert where == [f"/job:localhost/replica:0/task:0/device:CPU:{stage_of[layer.name]}"]
    # Adam's slots follow their variables: no stage's state is kept on another device.
    devices_of = {variable_devices(v)[0] for v in job.model.trainable_variables}
    slots = [v for v in job.optimizer.variables if v.shape.rank]  # not the step counters
    assert {variable_devices(v)[0] for v in slots} == devices_of
    assert len(devices_of) == 4
    line = described["communication"]
    assert all(s["device"] in line for s in stages) and stages[-1]["layers"][-1] in line


def test_boundaries_name_the_layers_that_start_stages(tmp_path):
    job = _train(
        tmp_path,
        "pipeline",
        "train",
        **{
            "model.name": "tests.test_pipeline:sequential",
            "strategy.pipeline.boundaries": "hidden_1, logits",
            "train.steps": 1,
        },
    )
    layout = [s["layers"] for s in job.results["placement"]["stages"]]
    assert layout == [["flat", "hidden_0"], ["hidden_1", "hidden_2"], ["logits"]]


def test_resumes_from_its_checkpoint_and_exports_a_one_device_model(one_device, tmp_path):
    pipeline = {"strategy.pipeline.stages": 2, "strategy.pipeline.micro_batches": 4}
    _train(tmp_path, "pipeline", "train", **pipeline, **{"train.steps": 10})
    job = _train(tmp_path, "pipeline", **pipeline, **{"train.export": True})
    assert job.results["step"] == 20
    _assert_same_checkpoints(one_device.model_dir, tmp_path)  # the resumed run ends alike

    loaded = tf.saved_model.load(os.path.join(tmp_path, "export"))
    serve = loaded.signatures["serving_default"]
    assert len(serve.variables) == len(job.model.trainable_variables)
    assert {v.device for v in serve.variables} == {"/job:localhost/replica:0/task:0/device:CPU:0"}
    graph = serve.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    assert not [n.name for n in nodes if "CPU:1" in n.device.upper()], "no stage placement"
    x = np.random.default_rng(0).random((5, 8, 8, 1), dtype=np.float32)
    reference = tf.saved_model.load(os.path.join(one_device.model_dir, "export"))
    np.testing.assert_allclose(
        serve(inputs=x)["logits"],
        reference.signatures["serving_default"](inputs=x)["logits"],
        rtol=1e-5,
        atol=1e-6,
    )


def sequential(spec, config) -> keras.Model:
    """A Sequential model, for the test below: `model.name=tests.test_pipeline:sequential`."""
    layers = [keras.Input(spec.input_shape), keras.layers.Flatten(name="flat")]
    for i, units in enumerate(config.hidden_units):
        layers.append(keras.layers.Dense(units, activation="relu", name=f"hidden_{i}"))
    return keras.Sequential([*layers, keras.layers.Dense(spec.num_classes, name="logits")])


def test_a_sequential_model_trains_as_on_one_device(tmp_path):
    user_model = {"model.name": "tests.test_pipeline:sequential"}
    _train(tmp_path / "one", "one_device", "train", **user_model)
    job = _train(
        tmp_path / "pipe",
        "pipeline",
        "train",
        **user_model,
        **{"strategy.pipeline.stages": 3, "strategy.pipeline.micro_batches": 2},
    )
    assert len(job.results["placement"]["stages"]) == 3
    _assert_same_checkpoints(tmp_path / "one", tmp_path / "pipe")


def stateful(spec, config) -> keras.Model:
    """Layers with state and added losses: batch statistics, dropout, an activity penalty."""
    del config
    from trainer.layers import Dropout

    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(32, activity_regularizer=keras.regularizers.L2(1e-3))(x)
    x = keras.layers.BatchNormalization()(x)
    x = Dropout(0.3, seed=1)(keras.layers.Activation("relu")(x))
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def test_state_and_added_losses_train_as_on_one_device(tmp_path):
    """Without micro-batches, moving statistics, dropout and activity losses are one device's."""
    # Evaluated along the way too: inference between training blocks leaves the state as it is.
    user_model = {"model.name": "tests.test_pipeline:stateful", "eval.every": 10}
    one = _train(tmp_path / "one", "one_device", **user_model)
    job = _train(
        tmp_path / "pipe",
        "pipeline",
        **user_model,
        **{"strategy.pipeline.stages": 3, "strategy.pipeline.micro_batches": 1},
    )
    assert len(job.results["placement"]["stages"]) == 3
    _assert_same_checkpoints(tmp_path / "one", tmp_path / "pipe")
    assert job.results["train"]["loss"] == pytest.approx(one.results["train"]["loss"], rel=1e-5)
    assert job.results["eval"]["loss"] == pytest.approx(one.results["eval"]["loss"], rel=1e-5)


def test_evaluates_between_blocks_with_dropout(tmp_path):
    """Inference leaves the stages' state alone (writing it broke the eval loop's iterator)."""
    job = _train(tmp_path, "pipeline", **{"model.dropout": 0.1, "eval.every": 10})
    assert job.results["eval"]["examples"] == 360  # the digits' eval split, whole


def branchy(spec, config) -> keras.Model:
    """A residual connection from `flat` past `a`, `b`, `c`: stages start at `a` or `logits`."""
    del config
    inputs = keras.Input(spec.input_shape)
    flat = keras.layers.Flatten(name="flat")(inputs)
    x = flat
    for name in "abc":
        x = keras.layers.Dense(flat.shape[-1], name=name)(x)
    total = keras.layers.Add(name="add")([flat, x])
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, name="logits")(total))


@pytest.mark.parametrize(
    "options,match",
    [
        ({"strategy.pipeline.boundaries": "b"}, "start at layer `b`: the outputs of `flat`, `a` "),
        ({"strategy.pipeline.boundaries": "a,nope"}, "names layer 'nope', which the model"),
        ({"strategy.pipeline.boundaries": "logits,a"}, "must come after the previous one"),
        ({"strategy.pipeline.stages": 4}, r"cut in only 2 place\(s\); e.g. a stage cannot start"),
    ],
)
def test_a_model_it_cannot_split_is_one_line_and_nothing_is_written(tmp_path, options, match):
    config = helpers.tiny_config(
        **{"strategy.name": "pipeline", "model.name": "tests.test_pipeline:branchy", **options}
    )
    model_dir = tmp_path / "run"
    helpers.one_line_error(match, train.train_and_evaluate, config, str(model_dir))
    assert not model_dir.exists()


def test_the_branchy_model_splits_where_one_tensor_crosses(tmp_path):
    job = _train(
        tmp_path,
        "pipeline",
        "train",
        **{"model.name": "tests.test_pipeline:branchy", "strategy.pipeline.stages": 3},
        **{"train.steps": 1},  # trained: the split model runs
    )
    layout = [s["layers"] for s in job.results["placement"]["stages"]]
    assert layout == [["flat"], ["a", "b", "c", "add"], ["logits"]]


def test_more_stages_than_devices_is_one_line(tmp_path):
    config = helpers.tiny_config(**{"strategy.name": "pipeline", "strategy.pipeline.stages": 5})
    message = helpers.one_line_error("5 stages", train.train_and_evaluate, config, str(tmp_path))
    assert "`devices.logical_cpus`" in message


def test_the_strategy_contract_holds_without_a_model():
    """As the contract tests in test_strategies.py check for the other local plugins."""
    strategy = strategies.get("pipeline", configs.default.get_config().strategy.pipeline)
    with strategy.scope():
        made = tf.Variable(tf.ones([3]))  # on the host until `place_model` moves it
    assert variable_devices(made) == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    assert strategy.num_replicas_in_sync == 1 and strategy.membership.is_chief

    def step(batch):
        return {"examples": tf.cast(tf.size(batch), tf.float32), "total": tf.reduce_sum(batch)}

    def batches(ctx, size=37, repeat=False):
        data = tf.data.Dataset.range(size).map(lambda i: tf.cast(i, tf.float32))
        return (data.repeat() if repeat else data).batch(ctx.get_per_replica_batch_size(8))

    iterator = iter(strategy.distribute_dataset(lambda ctx: batches(ctx, 1000, True)))
    assert strategy.run_steps(step, iterator, 5) == {"examples": 40, "total": sum(range(40))}
    assert strategy.evaluate(step, batches) == {"examples": 37, "total": sum(range(37))}


def test_listed_by_list_strategies(capsys):
    # In-process; tests/test_readme.py runs `python -m trainer --list_strategies` as written.
    code, out, _ = helpers.cli_in_process("--list_strategies", capsys=capsys)
    assert code == 0
    listed = {line.split()[0]: line for line in out.splitlines()}
    assert "Model parallelism" in listed["pipeline"]
