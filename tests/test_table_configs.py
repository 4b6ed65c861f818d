"""Keras-RS's vocabulary over dynamic tables: `TableConfig`, `FeatureConfig` and
`DynamicEmbeddings`."""

import contextlib
import inspect
import io
import pathlib
import re
import textwrap
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import REPO, tiny_config
from towerflow.errors import UserError
from trainer.layers import DynamicEmbeddings, FeatureConfig, TableConfig, tables
from trainer.loop import train
from trainer.loop.tasks import Task

USERS = TableConfig("users", embedding_dim=4, seed=7)
OTHER_USERS = TableConfig("users", vocabulary_size=9, embedding_dim=4)  # the same name
ITEMS = TableConfig("items", vocabulary_size=64, embedding_dim=3, key_dtype="string", mask_id="")


def _embeddings() -> DynamicEmbeddings:
    return DynamicEmbeddings(
        {
            "buyer": FeatureConfig("buyer", USERS),  # one id an example
            "sellers": FeatureConfig("sellers", USERS, combiner="sum"),  # a list, summed
            "basket": FeatureConfig("basket", ITEMS, output_shape=(None, 3)),  # the table's mean
        }
    )


IDS = {
    "buyer": tf.constant([2**40, 5], tf.int64),
    "sellers": tf.constant([[5, 6], [2**40, 2**40]], tf.int64),
    "basket": tf.ragged.constant([["pen", "ink"], ["pen"]]),
}


def test_two_features_sharing_a_table_read_the_same_row_for_the_same_id():
    layer = _embeddings()
    out = layer(IDS, training=True)  # admits every id; rows are read from the next step
    assert {key: tuple(v.shape) for key, v in out.items()} == {
        "buyer": (2, 4),
        "sellers": (2, 4),
        "basket": (2, 3),
    }
    assert int(layer.tables["users"].table.size()) == 3, "5 and 2**40 admitted once for both"
    out = {key: v.numpy() for key, v in layer(IDS).items()}
    row = tables.initial_rows(7, tf.constant([2**40, 5, 6], tf.int64), 4).numpy()
    np.testing.assert_array_equal(out["buyer"], row[:2])
    np.testing.assert_allclose(out["sellers"], [row[1] + row[2], 2 * row[0]], rtol=1e-6)
    pen, ink = tables.initial_rows(0, tf.constant(["pen", "ink"]), 3).numpy()
    np.testing.assert_allclose(out["basket"], [(pen + ink) / 2, pen], rtol=1e-6)


def test_get_config_rebuilds_the_features_on_one_shared_table():
    config = keras.saving.serialize_keras_object(_embeddings())
    layer = keras.saving.deserialize_keras_object(config)
    features = layer.feature_configs
    assert features["buyer"].table is features["sellers"].table == USERS
    assert features["sellers"].combiner == "sum" and sorted(layer.tables) == ["items", "users"]
    assert layer.get_config()["feature_configs"] == _embeddings().get_config()["feature_configs"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TableConfig("t", embedding_dim=0), r"'t' `embedding_dim` \(0\) must be >= 1"),
        (
            lambda: TableConfig("t", 10, 4, optimizer=keras.optimizers.Adam()),
            "'t' `optimizer` must be an optimizer's name .* not a Adam",
        ),
        (lambda: TableConfig("t", 10, 4, optimizer="adagard"), "'t' `optimizer` 'adagard' must"),
        (lambda: TableConfig("t", 10, 4, learning_rate=0.0), r"`learning_rate` \(0.0\) must be"),
        (lambda: TableConfig("t", 10, 4, placement="sparsecore"), "`placement` 'sparsecore'"),
        (lambda: TableConfig("t", 0, 4), r"'t' `capacity` \(0\) must be >= 1"),
        (lambda: FeatureConfig("f", USERS, combiner="max"), "'f' `combiner` 'max' must be"),
        (lambda: FeatureConfig("f", USERS, output_shape=(8, 5)), r"must end with .* \(4\)"),
        (
            lambda: DynamicEmbeddings(
                {"a": FeatureConfig("a", USERS), "b": FeatureConfig("b", OTHER_USERS)}
            ),
            "two different `TableConfig`s are named 'users'",
        ),
        (lambda: _embeddings()({"buyer": IDS["buyer"]}), r"the keys \['basket', 'buyer'"),
        (
            lambda: _embeddings()({**IDS, "buyer": tf.constant(["x"])}),
            "feature 'buyer' \\(table 'users'\\) has `key_dtype` int64 but got string ids",
        ),
    ],
)
def test_bad_table_and_feature_configs_are_one_line_errors(make, match):
    with pytest.raises(UserError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


class SharedTableTask(Task):
    """A dict model: a clicked item and the user's recent items share one string table."""

    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    metrics = ["accuracy"]

    def build_model(self) -> keras.Model:
        items = TableConfig("items", 1000, 8, key_dtype="string", mask_id="")
        users = TableConfig("users", 500, 8, combiner="sum")
        inputs = {
            "user": keras.Input((), dtype="int64", name="user"),
            "item": keras.Input((), dtype="string", name="item"),
            "recent": keras.Input((3,), dtype="string", name="recent"),
        }
        features = {key: FeatureConfig(key, users if key == "user" else items) for key in inputs}
        vectors = DynamicEmbeddings(features)(inputs)
        joined = keras.layers.Concatenate()([vectors[key] for key in inputs])
        return keras.Model(inputs, keras.layers.Dense(1)(joined))

    def dataset_fn(self, input_context, split, global_batch_size):
        rng = np.random.RandomState(0 if split == "train" else 1)
        item = rng.randint(0, 50, 512)
        recent = np.where(rng.rand(512, 3) < 0.3, "", (item[:, None] + [1, 2, 3]).astype(str))
        features = {
            "user": 2**50 + rng.randint(0, 200, 512).astype("int64"),
            "item": item.astype(str),
            "recent": recent,
        }
        examples = tf.data.Dataset.from_tensor_slices((features, (item % 2)[:, None]))
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        return examples.repeat().batch(batch) if split == "train" else examples.batch(batch)


def test_a_dict_model_of_shared_tables_trains_under_one_device(tmp_path):
    config = tiny_config(
        **{
            "task.name": "tests.test_table_configs:SharedTableTask",
            "strategy.name": "one_device",
            "train.steps": 6,
            "train.steps_per_loop": 3,
            "train.global_batch_size": 64,
        }
    )
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        results = train.train_and_evaluate(config, str(tmp_path), mode="train")
    assert results["step"] == 6 and np.isfinite(results["train"]["loss"])
    held = {name: table["ids_held"] for name, table in results["tables"].items()}
    # 64-example steps: over 6 steps most of the 200 users and 53 item names come by.
    assert 100 < held["users"] <= 200 and 40 < held["items"] <= 53, held
    assert "step: 6/6 | " in printed.getvalue()
    assert f"ids: {held['users'] + held['items']}" in printed.getvalue()


def test_two_tables_train_in_one_step_without_waiting_on_each_other():
    layer = _embeddings()
    step = tf.function(lambda ids: layer(ids, training=True))
    # With one lock shared by both tables this step never ended: run it where a
    # hang is a failure, not a stuck suite.
    done = threading.Event()
    threading.Thread(target=lambda: (step(IDS), step(IDS), done.set()), daemon=True).start()
    assert done.wait(timeout=60), "the step did not end: the tables wait on each other"
    assert [int(table.table.size()) for table in layer.tables.values()] == [3, 2]


def test_the_readme_and_docstring_examples_run():
    page = pathlib.Path(REPO, "docs", "recommendation.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    (example,) = [block for block in blocks if "DynamicEmbeddings(" in block]
    names = {}
    exec(example, names)
    assert {key: tuple(v.shape) for key, v in names["vectors"].items()} == {
        "buyer": (2, 16),
        "seller": (2, 16),
        "basket": (2, 16),
    }
    doc = inspect.cleandoc(DynamicEmbeddings.__doc__)
    (example,) = re.findall(r"\n\n((?:    .*\n)+)\n", doc)
    names = {"tf": tf, "TableConfig": TableConfig, "FeatureConfig": FeatureConfig}
    exec(textwrap.dedent(example), {**names, "DynamicEmbeddings": DynamicEmbeddings}, names)
    assert [tuple(v.shape) for v in names["vectors"].values()] == [(2, 16), (2, 16)]


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_keras_inputs_get_the_shape_of_the_lookups(shape):
    table = TableConfig("users", embedding_dim=4)
    layer = DynamicEmbeddings({"buyer": FeatureConfig("buyer", table)})
    symbolic = layer({"buyer": keras.Input(shape, dtype="int64", name="buyer")})["buyer"]
    looked_up = layer({"buyer": tf.zeros((5, *shape), tf.int64)})["buyer"]
    assert symbolic.shape == (None, *shape[:-1], 4) and looked_up.shape == (5, *shape[:-1], 4)
