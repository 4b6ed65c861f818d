"""Every label shape Keras's losses take trains under the built-in objectives, on any strategy.

A user's pipeline yields labels as Keras tutorials write them: class ids
`(batch,)` or `(batch, 1)`, one-hot rows `(batch, num_classes)`, values
`(batch,)` or `(batch, 1)`. Each trains and evaluates under the default
strategy and under `mirrored` over two of the test's logical CPUs (two
replicas split each batch and add up their metrics as four would, at half
the tracing), with the same results as the flat shape; any other shape is
one line at start-up, nothing written (and where a step is traced, for a
task that calls the objective itself).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import tiny_config
from towerflow.errors import UserError
from trainer.loop import objectives, train

_X = tf.random.stateless_uniform([64, 3], seed=[3, 4])
_TWO = tf.cast(_X[:, 0] + _X[:, 1] > 1.0, tf.int64)
_THREE = tf.minimum(tf.cast(_X[:, 0] * 3, tf.int64), 2)
_VALUES = _X[:, 0] + 2.0 * _X[:, 1]

LABELS = {  # name: (labels, data.num_classes, model)
    "binary_ids": (tf.cast(_TWO, tf.float32), 2, "sigmoid"),
    "binary_column": (tf.cast(_TWO, tf.float32)[:, None], 2, "sigmoid"),
    "class_ids": (_THREE, 3, "softmax"),
    "class_column": (_THREE[:, None], 3, "softmax"),
    "one_hot": (tf.one_hot(_THREE, 3), 3, "softmax"),
    "values": (_VALUES, 0, "linear"),
    "value_column": (_VALUES[:, None], 0, "linear"),
}
_SAME_AS = {  # each shape's results are those of the flat one
    "binary_column": "binary_ids",
    "class_column": "class_ids",
    "one_hot": "class_ids",
    "value_column": "values",
}


def _dataset_fn(labels):
    def dataset_fn(input_context, split, global_batch_size):
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        examples = tf.data.Dataset.from_tensor_slices((_X, labels))
        examples = examples.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
        return examples.batch(batch, drop_remainder=split == "train")

    return dataset_fn


for _name, (_labels, _, _) in LABELS.items():
    globals()[_name] = _dataset_fn(_labels)
two_columns = _dataset_fn(tf.stack([_THREE, _THREE], axis=1))  # neither ids nor one-hot


def model(spec, config):
    """One sigmoid unit (two classes), a softmax over the classes, or one value: not compiled."""
    units, activation = {2: (1, "sigmoid"), 0: (1, None)}.get(
        spec.num_classes, (spec.num_classes, "softmax")
    )
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="relu", kernel_initializer="glorot_uniform")(inputs)
    return keras.Model(inputs, keras.layers.Dense(units, activation=activation)(hidden))


def _train(name: str, strategy: str, model_dir, num_classes: int | None = None) -> dict:
    """Two blocks of 2 steps (the metrics of a block, then the next one's), then eval."""
    config = tiny_config(
        **{
            "strategy.name": strategy,
            "strategy.mirrored.devices": "CPU:0,CPU:1",
            "data.name": f"tests.test_label_shapes:{name}",
            "data.num_classes": LABELS[name][1] if num_classes is None else num_classes,
            "model.name": "tests.test_label_shapes:model",
            "train.global_batch_size": 16,
            "eval.global_batch_size": 16,
            "train.steps": 4,
            "train.steps_per_loop": 2,
            "train.checkpoint_every": 0,
        }
    )
    return train.train_and_evaluate(config, str(model_dir))


@pytest.fixture(scope="module")
def flat_results() -> dict:
    """The results of the flat shapes, by (name, strategy), trained once for the module."""
    return {}


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
@pytest.mark.parametrize("name", list(LABELS))
def test_a_label_shape_keras_takes_trains_and_evaluates_as_the_flat_one(
    name, strategy, flat_results, tmp_path
):
    results = _train(name, strategy, tmp_path / "run")
    assert results["step"] == 4 and results["eval"]["examples"] == 64
    assert results["placement"]["replicas_in_sync"] == (2 if strategy == "mirrored" else 1)
    flat = _SAME_AS.get(name)
    if flat is None:
        flat_results[name, strategy] = results["eval"]
        return
    if (flat, strategy) not in flat_results:
        flat_results[flat, strategy] = _train(flat, strategy, tmp_path / "flat")["eval"]
    expected = flat_results[flat, strategy]
    assert results["eval"].keys() == expected.keys()
    for metric, value in expected.items():
        assert results["eval"][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), metric


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_a_label_shape_no_loss_takes_is_one_line_at_start_up_and_model_dir_untouched(
    strategy, tmp_path
):
    with pytest.raises(UserError, match=r"labels are shaped \(batch, 2\); classification") as e:
        _train("two_columns", strategy, tmp_path / "run", num_classes=3)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("objective", "labels", "outputs", "message"),
    [
        (
            objectives.Classification(3, "probabilities"),
            tf.zeros([4, 2], tf.int64),
            tf.fill([4, 3], 1 / 3),
            r"labels are shaped \(batch, 2\); classification \(3 classes\) takes class ids",
        ),
        (
            objectives.Classification(2, "sigmoid"),
            tf.zeros([4, 1, 1]),
            tf.fill([4, 1], 0.5),
            r"labels are shaped \(batch, 1, 1\)",
        ),
        (
            objectives.Regression(),
            tf.zeros([4, 2]),
            tf.zeros([4, 1]),
            r"labels are shaped \(batch, 2\); regression takes values",
        ),
        (
            objectives.Regression(),
            tf.zeros([4]),
            tf.zeros([4, 3]),
            r"outputs are shaped \(batch, 3\); regression takes one output",
        ),
    ],
    ids=["classes", "nested", "values", "outputs"],
)
def test_a_label_shape_no_loss_takes_is_one_line_while_the_step_is_traced(
    objective, labels, outputs, message
):
    @tf.function
    def step(labels, outputs):
        return objective.eval_sums(None, labels, outputs, tf.ones([4]), 4)

    with pytest.raises(UserError, match=message) as refused:
        step(labels, outputs)
    assert "\n" not in str(refused.value)


def test_one_hot_and_soft_labels_take_the_cross_entropy_of_their_rows():
    logits = tf.constant([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    soft = tf.constant([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    expected = tf.nn.softmax_cross_entropy_with_logits(soft, logits).numpy()
    for kind, outputs in (("logits", logits), ("probabilities", tf.nn.softmax(logits))):
        loss = objectives.Classification(3, kind).per_example_loss(soft, outputs).numpy()
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
