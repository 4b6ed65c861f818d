"""The user's functions are called by the names of their parameters, in any order.

`towerflow.calls.adapt` directly, then a `dataset_fn` with its parameters
reordered and a model builder with its own reordered, trained in-process under
`mirrored`; a signature that fits neither way is one line showing the one
towerflow needs, and an error inside the user's function keeps its traceback.
"""

import keras
import pytest
import tensorflow as tf

from tests.helpers import one_line_error, tiny_config
from towerflow import calls
from trainer import data
from trainer.loop import actions, train

SIGNATURE = calls.Signature("dataset_fn", ("input_context", "split", "global_batch_size"))


def _called(fn):
    return calls.adapt(fn, SIGNATURE, "`data.name` 'x:fn'")("context", "train", 8)


def test_parameters_named_as_documented_are_passed_by_name_in_any_order():
    assert _called(lambda split, input_context, global_batch_size: (split, input_context)) == (
        "train",
        "context",
    )
    assert _called(lambda global_batch_size, split: (global_batch_size, split)) == (8, "train")
    assert _called(lambda **given: given) == {
        "input_context": "context",
        "split": "train",
        "global_batch_size": 8,
    }


def test_other_names_are_passed_in_the_documented_order():
    assert _called(lambda ctx, mode, batch: (ctx, mode, batch)) == ("context", "train", 8)
    assert _called(lambda *args: args) == ("context", "train", 8)


def test_a_signature_that_fits_neither_way_is_one_line_showing_the_one_needed():
    def dataset(context, split):
        raise AssertionError("never called")

    message = one_line_error("takes", calls.adapt, dataset, SIGNATURE, "`data.name` 'x:dataset'")
    assert message == (
        "`data.name` 'x:dataset' takes (context, split), and towerflow calls it as "
        "dataset_fn(input_context, split, global_batch_size); give it those parameters, by "
        "those names in any order or in that order."
    )
    one_line_error(r"takes \(split, batch=2\)", _called, lambda split, batch=2: None)


def test_an_error_inside_the_users_function_keeps_its_traceback():
    def dataset(split, input_context, global_batch_size):
        return {}["no such key"]

    with pytest.raises(KeyError):
        _called(dataset)


# --- the user's functions as towerflow calls them -----------------------------------


def dataset(split, input_context, global_batch_size):
    """A user's pipeline with the documented names in another order (issue 20)."""
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    x = tf.random.stateless_uniform([64, 4], seed=[1, 2])
    y = tf.cast(x[:, 0] > 0.5, tf.int32)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return examples.batch(batch, drop_remainder=split == "train")


def model(config, spec):
    """A user's model builder with its parameters reordered."""
    assert isinstance(spec, data.DataSpec), "the spec came by name"
    return keras.Sequential([keras.Input(spec.input_shape), keras.layers.Dense(spec.num_classes)])


BLOCKS: list[int] = []


def count_blocks(config):
    def act(output):
        BLOCKS.append(output.step)

    return act


def test_a_dataset_fn_and_a_builder_with_reordered_parameters_train_under_mirrored(tmp_path):
    config = tiny_config(
        **{
            "strategy.name": "mirrored",
            "data.name": "tests.test_user_calls:dataset",
            "data.num_classes": 2,
            "model.name": "tests.test_user_calls:model",
            "train.global_batch_size": 16,
            "eval.global_batch_size": 16,
            "train.steps": 10,
            "train.actions": "tests.test_user_calls:count_blocks",
        }
    )
    BLOCKS.clear()
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    assert results["step"] == 10 and results["eval"]["examples"] == 64
    assert BLOCKS == [5, 10]


def test_an_action_that_takes_nothing_is_one_line():
    config = tiny_config()
    message = one_line_error(
        "`train.actions` 'tests.test_user_calls:model' takes",
        actions.user_actions,
        "tests.test_user_calls:model",
        config,
    )
    assert "make_action(config)" in message


class TaskOfTwoParameters:
    """A user's task whose `dataset_fn` lacks `global_batch_size` and names the others otherwise."""

    def __init__(self, config):
        self.config = config

    def build_model(self):
        return model(None, data.DataSpec((4,), 2, None, None))

    def dataset_fn(self, context, mode):
        raise AssertionError("never called")


def test_a_tasks_dataset_fn_that_cannot_be_called_names_the_task(tmp_path):
    config = tiny_config(**{"task.name": "tests.test_user_calls:TaskOfTwoParameters"})
    message = one_line_error("takes", train.train_and_evaluate, config, str(tmp_path / "m"))
    assert message.startswith(
        "`task.name` 'tests.test_user_calls:TaskOfTwoParameters' `dataset_fn` takes (context, mode)"
    )
    assert not (tmp_path / "m").exists()
