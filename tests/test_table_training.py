"""A `DynamicEmbedding` trained outside towerflow's trainer: it learns, or stops at step 1.

Plain Keras (`model.fit`) and a user's own `tf.GradientTape` loop, with
Keras's own optimizer classes (refused in one line at the first update:
they would write rows the table never reads) and with
`trainer.loop.optim`'s (which train the rows looked up).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from towerflow.errors import UserError
from trainer.layers import DynamicEmbedding
from trainer.loop import optim

IDS = 200  # distinct ids in the click stream
BATCH = 64


def _clicks(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids drawn at random, clicked where the id's hidden score is positive."""
    ids = np.random.default_rng(seed).integers(0, IDS, examples).astype(np.int64)
    score = np.random.default_rng(1).normal(size=IDS)
    return ids, (score[ids] > 0).astype(np.float32)


def _model() -> keras.Model:
    ids = keras.Input((), dtype="int64")
    vectors = DynamicEmbedding(4, capacity=1000, name="items")(ids)
    return keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(vectors))


def _rows(model: keras.Model) -> np.ndarray:
    return model.get_layer("items").rows.numpy()


def _tape_loop(model: keras.Model, optimizer, steps: int) -> list[float]:
    """A user's own loop: a `tf.function` step of `tf.GradientTape`, `apply_gradients`."""
    ids, clicks = _clicks(steps * BATCH, seed=0)
    batches = tf.data.Dataset.from_tensor_slices((ids, clicks)).batch(BATCH)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.binary_crossentropy(y[:, None], model(x, training=True))
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return [float(step(x, y)) for x, y in batches]


def _one_line_naming_the_row_aware_optimizers(error: pytest.ExceptionInfo) -> None:
    message = str(error.value)
    assert "\n" not in message and "'items'" in message
    assert "`trainer.loop.optim.Adam`" in message


KERAS_OWN = {"adam": lambda: keras.optimizers.Adam(0.05), "sgd": lambda: keras.optimizers.SGD(1.0)}


@pytest.mark.parametrize("name", sorted(KERAS_OWN))
def test_model_fit_with_a_keras_optimizer_stops_at_the_first_step_in_one_line(name):
    model = _model()
    model.compile(KERAS_OWN[name](), "binary_crossentropy")
    ids, clicks = _clicks(4 * BATCH, seed=0)
    with pytest.raises(UserError) as error:
        model.fit(ids, clicks, batch_size=BATCH, verbose=0)
    _one_line_naming_the_row_aware_optimizers(error)
    assert int(model.optimizer.iterations) == 0 and not _rows(model).any()


def test_a_gradient_tape_loop_with_a_keras_optimizer_stops_at_the_first_step_in_one_line():
    model = _model()
    optimizer = keras.optimizers.Adam(0.05)
    with pytest.raises(UserError) as error:
        _tape_loop(model, optimizer, steps=3)
    _one_line_naming_the_row_aware_optimizers(error)
    assert int(optimizer.iterations) == 0


def _auc(model: keras.Model) -> float:
    ids, clicks = _clicks(2048, seed=7)  # the next day's clicks
    metric = keras.metrics.AUC()
    metric.update_state(clicks, model.predict(ids, batch_size=512, verbose=0)[:, 0])
    return float(metric.result())


ROW_AWARE = {"adam": lambda: optim.Adam(0.05), "sgd": lambda: optim.SGD(1.0)}


@pytest.mark.parametrize("name", sorted(ROW_AWARE))
def test_model_fit_with_a_row_aware_optimizer_writes_the_rows_and_the_auc_rises(name):
    model = _model()
    model.compile(ROW_AWARE[name](), "binary_crossentropy")
    before = _auc(model)
    ids, clicks = _clicks(2048, seed=0)
    history = model.fit(ids, clicks, batch_size=BATCH, epochs=2, verbose=0).history["loss"]
    assert history[1] < history[0]
    held = int(model.get_layer("items").describe()["ids_held"])
    written = np.count_nonzero(np.abs(_rows(model)).sum(axis=1))
    assert held == IDS and written == IDS  # every id's row was trained
    assert _auc(model) > max(before, 0.5) + 0.3


def test_a_gradient_tape_loop_with_a_row_aware_optimizer_trains_the_rows():
    model = _model()
    losses = _tape_loop(model, optim.Adagrad(0.5), steps=40)
    assert np.mean(losses[-10:]) < 0.85 * np.mean(losses[:10])
    assert np.count_nonzero(np.abs(_rows(model)).sum(axis=1)) == IDS
    assert _auc(model) > 0.85
