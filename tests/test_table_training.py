"""A `DynamicEmbedding` trained outside towerflow's trainer: it learns, or stops at step 1.

Plain Keras (`model.fit`) and a user's own `tf.GradientTape` loop, with
Keras's own optimizer classes (refused in one line at the first update:
they would write rows the table never reads) and with
`trainer.loop.optim`'s (which train the rows looked up).
"""

import json
import pathlib
import re
import shlex
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fresh_process import run_script
from tests.helpers import (
    REPO,
    assert_exit,
    cli_in_process,
    launched,
    run_command,
    tensorboard_scalars,
)
from tests.test_dynamic_embedding import (
    SMALL_CTR,
    _restored_job,
    _rows_by_id,
    state_of,
    trained_job,
)
from tests.test_models import tiny_ctr_config
from towerflow.errors import UserError
from trainer.layers import DynamicEmbedding
from trainer.loop import optim, train

IDS = 200  # distinct ids in the click stream
BATCH = 64


def _clicks(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids drawn at random, clicked where the id's hidden score is positive."""
    ids = np.random.default_rng(seed).integers(0, IDS, examples).astype(np.int64)
    score = np.random.default_rng(1).normal(size=IDS)
    return ids, (score[ids] > 0).astype(np.float32)


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)  # the dense layer's start too: the same run every time
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
@pytest.mark.usefixtures("iterators_end_with_the_test")
def test_model_fit_with_a_keras_optimizer_stops_at_the_first_step_in_one_line(name):
    model = _model()
    model.compile(KERAS_OWN[name](), "binary_crossentropy")
    ids, clicks = _clicks(4 * BATCH, seed=0)
    with pytest.raises(UserError) as error:
        model.fit(ids, clicks, batch_size=BATCH, verbose=0)
    _one_line_naming_the_row_aware_optimizers(error)
    assert int(model.optimizer.iterations) == 0 and not _rows(model).any()


@pytest.mark.usefixtures("iterators_end_with_the_test")
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


# Per-table optimizers: Adagrad for the table, Adam for the dense layers, in the trainer.


def _ctr_config(strategy: str, steps: int, **model):
    config = tiny_ctr_config(
        **{"strategy.name": strategy, "train.steps": steps, "train.deterministic": True}
    )
    config.model.update(
        {"embedding": "dynamic", "table_optimizer": "adagrad", "table_learning_rate": 0.05}
    )
    config.model.update(model)
    return config


def _state(job: train.BuiltJob) -> dict[str, np.ndarray]:
    """Every variable of the model and the optimizers (the table's own too), and the index."""
    state = state_of(job.model, job.optimizer)
    for i, variable in enumerate(optim.own_variables(job.optimizer)):
        state[f"own/{i}"] = variable.numpy()
    for i, variable in enumerate(job.model.trainable_variables):
        for k, (slot, _) in enumerate(optim.slots_of(job.optimizer, variable)):
            state[f"slot/{i}/{k}"] = slot.numpy()
    return state


def test_a_ctr_table_with_its_own_adagrad_trains_keeps_adagrads_slots_and_resumes_exactly(
    tmp_path,
):
    straight = _ctr_config("one_device", 20, capacity=300, ttl_steps=8)
    straight.train.checkpoint_every = 5
    job, results = trained_job(straight, tmp_path / "straight")
    loss = tensorboard_scalars(tmp_path / "straight", "loss")["loss"]
    assert loss[20] < loss[5]
    rows = job.model.get_layer("embedding").rows
    table_optimizer = job.optimizer.trainer_of(rows)
    assert type(job.optimizer) is optim.Adam and type(table_optimizer) is optim.Adagrad
    (accumulator,) = [slot for slot, _ in optim.slots_of(job.optimizer, rows)]
    assert "accumulator" in accumulator.path and accumulator.shape == rows.shape
    assert accumulator.numpy().max() > 0.1  # Adagrad's initial value, plus squared gradients
    assert not any("rows" in v.path for v in job.optimizer.variables), "no Adam moments of rows"
    assert int(table_optimizer.iterations) == int(job.optimizer.iterations) == results["step"]
    # Resumed from incremental checkpoints (the table's Adagrad slots among them).
    resumed = _ctr_config("one_device", 10, capacity=300, ttl_steps=8)
    resumed.train.update({"checkpoint_every": 5, "full_checkpoint_every": 100})
    train.train_and_evaluate(resumed, str(tmp_path / "resumed"), mode="train")
    resumed.train.steps = 20
    train.train_and_evaluate(resumed, str(tmp_path / "resumed"), mode="train")
    states = [_state(job), _state(_restored_job(resumed, tmp_path / "resumed"))]
    assert sorted(states[0]) == sorted(states[1])
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)


@pytest.mark.slow  # the default optimizer's equivalence is in the default tier already
def test_one_device_and_mirrored_train_a_table_with_its_own_optimizer_alike(tmp_path):
    rows = []
    for strategy in ("one_device", "mirrored"):
        config = _ctr_config(strategy, 10)
        train.train_and_evaluate(config, str(tmp_path / strategy))
        rows.append(_rows_by_id(_restored_job(config, tmp_path / strategy).model))
    assert len(rows[0]) > 100 and sorted(rows[0]) == sorted(rows[1])
    for key, row in rows[0].items():
        np.testing.assert_allclose(rows[1][key], row, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"table_optimizer": "adagard"}, "`model.table_optimizer` 'adagard' must be one of"),
        ({"table_learning_rate": -1.0}, r"`model.table_learning_rate` \(-1.0\) must be positive"),
        ({"embedding": "hashed"}, "train a dynamic table; set `--config.model.embedding=dynamic`"),
    ],
)
@pytest.mark.usefixtures("iterators_end_with_the_test")
def test_a_bad_table_optimizer_in_the_config_is_one_line_and_exit_2(tmp_path, overrides, match):
    config = _ctr_config("one_device", 2, **overrides)
    with pytest.raises(UserError, match=match) as error:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()


# docs/tables-keras.md: its example and its command run as written.

PAGE = pathlib.Path(REPO) / "docs" / "tables-keras.md"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)


def test_the_pages_plain_keras_example_runs_as_written_and_learns(tmp_path):
    (example,) = _blocks("python")
    result = run_script(example, cwd=tmp_path)  # as `python example.py`, in a process of its own
    assert_exit(result)
    printed = re.search(r"held-out AUC (0\.\d+), ids held (\d+)", result.stdout)
    assert printed and float(printed[1]) > 0.8 and printed[2] == "2000", result.stdout


def _commands() -> list[list[str]]:
    return [shlex.split(block.replace("\\\n", " ")) for block in _blocks("sh")]


def test_the_pages_per_table_optimizer_command_runs_as_written(tmp_path, capsys):
    (command,) = [c for c in _commands() if "--config=configs/ctr.py" in c]
    assert command[:3] == ["python", "-m", "trainer"]
    (tmp_path / "configs").symlink_to(pathlib.Path(REPO) / "configs")  # as from a clone
    # In this process (the command's parsing and main): its exits are tests/test_cli.py's.
    code, _, err = cli_in_process(*command[3:], capsys=capsys, cwd=tmp_path)
    assert code == 0, err[-3000:]
    results = json.loads((tmp_path / "runs" / "ctr_adagrad" / "results.json").read_text())
    assert results["step"] == 200 and results["eval"]["auc"] > 0.7, results["eval"]


@pytest.mark.slow  # four processes that each start TensorFlow: a measurement, as the bench's
def test_the_pages_padding_measurement_runs_and_prints_each_case(tmp_path):
    """The page's command, one round of 20 steps (its 3 rounds of 200 take minutes)."""
    (command,) = [c for c in _commands() if "examples.ragged_padding" in c]
    assert command[3:] == ["--rounds=3", "--steps=200"]
    result = run_command([sys.executable, *command[1:3], "--rounds=1", "--steps=20"], cwd=REPO)
    assert_exit(result)
    for case in ("one_device:ragged", "one_device:padded", "mirrored:ragged", "mirrored:padded"):
        assert re.search(rf"^{case}: CPU \d+\.\d+ ms/step", result.stdout, re.MULTILINE), case


@pytest.mark.slow  # a local cluster of 2 workers and 2 ps members
def test_under_parameter_server_a_table_trains_with_its_own_optimizer_beside_its_rows(tmp_path):
    flags = {**SMALL_CTR, "train.deterministic": False, "train.steps": 40}
    flags.update({"model.table_optimizer": "adagrad", "model.table_learning_rate": 0.5})
    launched(
        "--workers=2",
        "--ps=2",
        "--",
        "--strategy=parameter_server",
        "--config=configs/ctr.py",
        *[f"--config.{field}={value}" for field, value in flags.items()],
        "--model_dir=run",
        cwd=str(tmp_path),
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] == 40 and results["tables"]["embedding"]["ids_held"] > 100
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints"))
    own = [name for name in reader.get_variable_to_shape_map() if "table_embedding" in name]
    assert len(own) == 3, own  # Adagrad's step and an accumulator for each part's rows
    assert reader.get_tensor(next(n for n in own if "_iterations" in n)) == 40
