"""The user's own input pipeline, `data.name=module.path:function`.

The test writes a small user module into a temporary directory on `sys.path`,
as a user's project would be importable: a `dataset_fn(input_context, split,
global_batch_size)` yielding named features of mixed dtypes and per-example
weights, and a Keras model builder that takes the dict. It trains in-process
under `one_device` and `mirrored`; resuming by skipping gives the batches of
an uninterrupted stream; each mistake is one line, and the user's own
exception keeps its traceback.
"""

import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import checkpoint_values, one_line_error, tiny_config
from tests.steps_two_replicas import on_two_cpus
from trainer import data
from trainer.loop import train

MODULE = "towerflow_user_pipeline"  # unique: the user's module, written by `user_module`

SOURCE = '''
"""A user's project: an input pipeline and a model of named features."""

import keras
import tensorflow as tf

EXAMPLES = 64


def _examples():
    i = tf.range(EXAMPLES, dtype=tf.int64)
    x = tf.cast(i, tf.float32)
    features = {
        "numbers": tf.stack([x / EXAMPLES, tf.sin(x)], axis=1),
        "colour": tf.gather(tf.constant(["red", "green", "blue"]), i % 3),
        "ids": i % 5,
    }
    labels = tf.cast((i % 5 + i % 3) % 2, tf.int32)
    weights = 1.0 + tf.cast(i % 2, tf.float32)
    return features, labels, weights


def pipeline(input_context, split, global_batch_size):
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    examples = tf.data.Dataset.from_tensor_slices(_examples())
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    if split == "train":
        examples = examples.shuffle(EXAMPLES, seed=7)
    return examples.batch(batch, drop_remainder=split == "train")


def model(spec, config):
    numbers = keras.Input((2,), name="numbers")
    colour = keras.Input((), dtype="string", name="colour")
    ids = keras.Input((), dtype="int64", name="ids")
    lookup = keras.layers.StringLookup(vocabulary=["red", "green", "blue"], output_mode="one_hot")
    embedded = keras.layers.Embedding(5, 3)(ids)
    hidden = keras.layers.Concatenate()([numbers, lookup(colour), embedded])
    logits = keras.layers.Dense(spec.num_classes)(keras.layers.Dense(8, "relu")(hidden))
    return keras.Model({"numbers": numbers, "colour": colour, "ids": ids}, logits)


def numbers_only(spec, config):
    """A model of one of the data's three features: the other two are not its inputs."""
    numbers = keras.Input((2,), name="numbers")
    return keras.Model({"numbers": numbers}, keras.layers.Dense(spec.num_classes)(numbers))


def one_tensor(input_context, split, global_batch_size):
    x = tf.random.stateless_uniform([16, 3], seed=[0, 1])
    return tf.data.Dataset.from_tensor_slices((x, tf.range(16) % 2)).batch(4)


def records(input_context, split, global_batch_size):
    x = tf.zeros([8, 3])
    return tf.data.Dataset.from_tensor_slices({"x": x, "label": tf.range(8)}).batch(4)


def a_list(input_context, split, global_batch_size):
    return [1, 2, 3]


def endless_eval(input_context, split, global_batch_size):
    return one_tensor(input_context, split, global_batch_size).repeat()


def empty_eval(input_context, split, global_batch_size):
    return one_tensor(input_context, split, global_batch_size).take(0 if split == "eval" else 4)


def raises(input_context, split, global_batch_size):
    raise ValueError("the user's own bug")
'''


@pytest.fixture(scope="module", autouse=True)
def user_module(tmp_path_factory):
    """The user's module, importable as `MODULE` for this test module's tests."""
    directory = tmp_path_factory.mktemp("user_project")
    (directory / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(directory))
    yield directory / f"{MODULE}.py"
    sys.path.remove(str(directory))
    sys.modules.pop(MODULE, None)


def _config(function: str = "pipeline", **fields):
    config = tiny_config(
        **{
            "data.name": f"{MODULE}:{function}",
            "data.num_classes": 2,
            "model.name": f"{MODULE}:model",
            **fields,
        }
    )
    return config


def _context(pipelines: int = 1, pipeline: int = 0, replicas: int = 1):
    return tf.distribute.InputContext(pipelines, pipeline, replicas)


def _numpy(batch):
    return tf.nest.map_structure(lambda t: t.numpy(), batch)


def _assert_same(a, b) -> None:
    tf.nest.map_structure(np.testing.assert_array_equal, a, b)


# --- training -------------------------------------------------------------------------


def _trained(model_dir, strategy: str = "one_device", steps: int = 20, mode="train_and_eval"):
    """`steps` steps of the user's pipeline and model under `strategy`; the run's results."""
    config = _config(
        **on_two_cpus(strategy),
        **{
            "train.global_batch_size": 8,  # mirrored: 2 replicas of 4
            "eval.global_batch_size": 8,
            "train.steps": steps,
        },
    )
    return train.train_and_evaluate(config, str(model_dir), mode=mode)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """20 steps under one_device, evaluated: a trained run, and the one a resumed run ends as."""
    model_dir = tmp_path_factory.mktemp("straight")
    return model_dir, _trained(model_dir)


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_a_user_pipeline_of_named_features_and_weights_trains(tmp_path, strategy, request):
    if strategy == "one_device":  # the run the resume test compares with
        _, results = request.getfixturevalue("one_device_run")
    else:
        results = _trained(tmp_path, strategy)
    assert results["step"] == 20
    assert results["eval"]["examples"] == 64  # one pass, every example once
    assert np.isfinite(results["eval"]["loss"])
    assert 0.0 <= results["eval"]["accuracy"] <= 1.0


@pytest.mark.slow  # about 80 s; user pipelines train and export in the default tier
def test_features_the_model_does_not_take_are_left_out_and_the_export_asks_for_its_own(tmp_path):
    config = _config(
        **{"model.name": f"{MODULE}:numbers_only", "strategy.name": "mirrored"},
        **{"train.global_batch_size": 8, "eval.global_batch_size": 8, "train.export": True},
    )
    results = train.train_and_evaluate(config, str(tmp_path))
    assert results["step"] == 20 and results["eval"]["examples"] == 64
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    assert set(serve.structured_input_signature[1]) == {"numbers"}
    assert serve(numbers=tf.zeros((3, 2)))["classes"].shape == (3,)


def test_spec_and_batches_of_a_user_pipeline():
    dataset = data.get(_config().data)
    assert dataset.spec == data.DataSpec(None, 2, None, None)  # named features: no one shape
    features, labels, weights = _numpy(next(iter(dataset.train_fn(8, seed=0)(_context(1, 0, 2)))))
    assert set(features) == {"numbers", "colour", "ids"}
    assert features["numbers"].shape == (4, 2) and features["numbers"].dtype == np.float32
    assert features["colour"].dtype == object and features["ids"].dtype == np.int64
    assert labels.shape == weights.shape == (4,)
    one = data.get(_config("one_tensor").data)
    assert one.spec.input_shape == (3,)


# --- resume by skipping ---------------------------------------------------------------


@pytest.mark.parametrize("pipelines, replicas", [(1, 1), (1, 2), (2, 2)])
def test_resume_skips_to_the_batches_of_an_uninterrupted_stream(pipelines, replicas):
    dataset = data.get(_config().data)
    step = 9  # 64 examples: past the first epoch (8 per step), so the epoch boundary counts
    for pipeline in range(pipelines):
        context = _context(pipelines, pipeline, replicas)
        fed = replicas // pipelines  # batches each step takes from this pipeline
        fresh = list(dataset.train_fn(8, seed=0)(context).take((step + 2) * fed))
        resumed = list(dataset.train_fn(8, seed=0, start_step=step)(context).take(2 * fed))
        _assert_same(_numpy(resumed), _numpy(fresh[step * fed :]))
        first = [_numpy(batches[0])[0]["numbers"] for batches in (fresh, resumed)]
        assert not np.array_equal(*first)  # it did skip: examples differ (unique numbers)


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(one_device_run, tmp_path):
    straight_dir, _ = one_device_run
    _trained(tmp_path, steps=10, mode="train")
    _trained(tmp_path, mode="train")  # restores step 10 and skips the 10 batches it took
    straight, resumed = checkpoint_values(straight_dir), checkpoint_values(tmp_path)
    assert straight.keys() == resumed.keys()
    for name in straight:
        np.testing.assert_allclose(
            resumed[name], straight[name], rtol=1e-6, atol=1e-7, err_msg=name
        )


# --- errors ---------------------------------------------------------------------------


def _one_line(match: str, config) -> str:
    """The one-line error the start-up (`get`, then `check`) gives for `config`."""
    return one_line_error(match, lambda: data.check(data.get(config.data)))


def test_a_path_that_does_not_import_is_one_line():
    config = _config()
    config.data.name = "no_such_package.pipelines:pipeline"
    message = _one_line("no module 'no_such_package'", config)
    assert "`data.name` 'no_such_package.pipelines:pipeline'" in message


def test_no_such_function_is_one_line():
    message = _one_line(f"module '{MODULE}' has no 'missing'", _config("missing"))
    assert "`data.name`" in message and "input_context, split, global_batch_size" in message


def test_the_wrong_structure_is_one_line_naming_what_it_yielded():
    message = _one_line("yielded", _config("records"))
    assert "yielded {x: float32[?, 3], label: int32[?]} for the 'train' split" in message
    assert "`(features, labels)` or `(features, labels, sample_weights)`" in message
    message = _one_line("returned list for the 'train' split", _config("a_list"))
    assert "not a tf.data.Dataset" in message


def test_an_endless_or_empty_eval_split_is_one_line():
    _one_line("endless 'eval' split", _config("endless_eval"))
    _one_line("yielded no batches for the 'eval' split", _config("empty_eval"))


def test_the_users_own_exception_keeps_its_traceback(user_module):
    with pytest.raises(ValueError, match="the user's own bug") as caught:
        data.get(_config("raises").data)
    assert caught.traceback[-1].path == user_module  # raised where their code raised it
