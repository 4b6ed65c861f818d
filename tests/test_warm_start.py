"""`train.warm_start`: a new run begins from another run's variables, dynamic tables included."""

import json
import shutil

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
from tests.helpers import one_line_error
from tests.test_portable import (
    POOL,
    VOCAB,
    _adam,
    _batches,
    _checkpointer,
    _dynamic_model,
    _sharded_model,
    _train,
)
from trainer.loop import train, warm_start
from trainer.loop.checkpoints import Checkpointer

SMALL = {
    "strategy.name": "one_device",
    "devices.logical_cpus": 4,
    "data.ctr.id_space": "raw",
    "data.ctr.num_examples": 4000,
    "data.ctr.ids_per_field": 300,
    "model.embedding": "dynamic",
    "model.vocab_size": 4000,
    "model.embedding_dim": 8,
    # A table that fills up, an id without a row reading 1 fallback row: the source of the
    # fallback rows' test too, so that the module trains one source.
    "model.capacity": 50,
    "model.fallback_rows": 16,
    "model.fallback_hashes": 1,
    "model.hidden_units": (16,),
    "train.steps": 10,
    "train.steps_per_loop": 5,
    "train.global_batch_size": 64,
    "train.checkpoint_every": 10,
    "train.export": False,
}


def _build(config, model_dir):
    """The job of `config`, its layers named as in a new process (`dense`, `dense_1`, ...).

    Keras numbers auto-named layers per process: a second model built here would
    have `dense_2`, where a new run of the same config has `dense`.
    """
    keras.backend.clear_session()
    return train.build(config, str(model_dir))


def _config(**overrides):
    config = configs.ctr.get_config()
    config.update_from_flattened_dict({**SMALL, **overrides})
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of the click model with a full dynamic table of raw int64 ids: its model_dir."""
    model_dir = tmp_path_factory.mktemp("warm") / "first"
    keras.backend.clear_session()  # its layers named as in a new process, whatever ran before
    train.train_and_evaluate(_config(), str(model_dir), mode="train")
    return model_dir


def _predictions(job, ids):
    return job.model(ids, training=False).numpy()


def _restored(model_dir, config):
    job = _build(config, model_dir)
    Checkpointer(str(model_dir), False, 1, **train.checkpointed(job)).restore()
    return job


def test_a_warm_start_loads_the_tables_ids_and_the_dense_layers(trained, tmp_path):
    config = _config(**{"train.warm_start": str(trained)})
    job = _build(config, tmp_path / "second")
    line = warm_start.apply(job.feature("warm_start").plan)
    assert "the ids of embedding" in line and "none fresh" in line
    ids = next(iter(job.dataset.eval_fn(64)(tf.distribute.InputContext())))[0]
    warmed = _predictions(job, ids)
    np.testing.assert_allclose(warmed, _predictions(_restored(trained, _config()), ids), rtol=1e-6)


def test_warm_start_include_loads_only_the_names_it_matches(trained, tmp_path):
    config = _config(**{"train.warm_start": str(trained), "train.warm_start_include": "^dense"})
    job = _build(config, tmp_path / "second")
    plan = job.feature("warm_start").plan
    assert not plan.tables, "the table is left out: it starts empty"
    assert plan.fresh and all("dense" not in name for name in plan.fresh)


def test_a_run_with_its_own_checkpoint_resumes_and_says_the_warm_start_is_left_aside(
    trained, tmp_path, capsys
):
    model_dir = str(tmp_path / "second")
    shutil.copytree(trained, model_dir)  # a run of the same config: its own checkpoint
    keras.backend.clear_session()
    capsys.readouterr()
    config = _config(**{"train.warm_start": str(trained), "train.steps": 15})
    train.train_and_evaluate(config, model_dir, mode="train")
    out = capsys.readouterr().out
    assert "`train.warm_start` left aside" in out and "warm start from" not in out


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"train.warm_start": "/nonexistent/run"}, "holds no checkpoint"),
        ({"data.ctr.id_dtype": "string"}, "has int64 keys there and string here"),
        ({"model.hidden_units": (8,)}, "is \\(.*\\) there and \\(.*\\) here"),
        ({"train.warm_start_include": "("}, "is not a regular expression"),
    ],
)
def test_a_warm_start_that_cannot_load_is_one_line_and_leaves_model_dir_alone(
    trained, tmp_path, overrides, match
):
    config = _config(**{"train.warm_start": str(trained), **overrides})
    model_dir = tmp_path / "second"
    keras.backend.clear_session()
    one_line_error(match, train.train_and_evaluate, config, str(model_dir))
    assert not model_dir.exists()


def test_fallback_rows_warm_start_only_read_as_many_at_a_time_as_they_trained(trained, tmp_path):
    config = _config(**{"model.fallback_hashes": 2, "train.warm_start": str(trained)})
    keras.backend.clear_session()
    match = "read its fallback rows 1 per id there and 2 here"
    one_line_error(match, train.train_and_evaluate, config, str(tmp_path / "second"))
    assert not (tmp_path / "second").exists()
    config.model.fallback_hashes, config.model.table_seed = 1, 4
    keras.backend.clear_session()
    match = "hashed ids into its fallback rows with seed 0 there and 4 here"
    one_line_error(match, train.train_and_evaluate, config, str(tmp_path / "second"))
    config.model.table_seed = 0
    job = _build(config, tmp_path / "third")
    line = warm_start.apply(warm_start.plan(config, job.model, list(job.model.variables)))
    assert "the ids of embedding" in line


def _held(model) -> dict[int, np.ndarray]:
    """The table's rows by id."""
    content = model.get_layer("embedding").export_logical(lambda v: [])
    return dict(zip(content["keys"].tolist(), content["rows"], strict=True))


def _warm_started(model_dir, source, batches, target) -> str:
    """Trains `source` on `batches`, saves it in `model_dir`, warm-starts `target`: the line."""
    optimizer = _adam(source)
    _train(source, optimizer, batches)
    _checkpointer(model_dir, source, optimizer).save(len(batches))
    warm_start.record(source, list(source.variables), str(model_dir))
    config = ml_collections.ConfigDict({"train": {"warm_start": str(model_dir)}})
    return warm_start.apply(warm_start.plan(config, target, list(target.variables)))


@pytest.mark.parametrize(("there", "here"), [(2, 1), (1, 2)])
def test_a_table_in_other_parts_warm_starts_with_the_same_ids_and_vectors(tmp_path, there, here):
    source, target = _dynamic_model(there), _dynamic_model(here)
    line = _warm_started(tmp_path, source, _batches(6, seed=1), target)
    assert f"embedding from {there} parts into {here}" in line and "none fresh" in line
    want = _held(source)
    assert len(want) > 8
    got = _held(target)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_array_equal(got[key], row)
    every_id = tf.constant(POOL.reshape(8, 3))  # the dense layer loaded by name too
    np.testing.assert_allclose(target(every_id).numpy(), source(every_id).numpy(), rtol=1e-6)


def test_sharded_layers_in_other_shards_warm_start_whole(tmp_path):
    source, target = _sharded_model(2), _sharded_model(3)
    ids = tf.constant(np.arange(3 * VOCAB).reshape(VOCAB, 3) % VOCAB, tf.float32)
    line = _warm_started(tmp_path, source, [ids] * 3, target)
    assert "table from 2 parts into 3" in line and "wide from 2 parts into 3" in line
    np.testing.assert_allclose(target(ids).numpy(), source(ids).numpy(), rtol=1e-6)


def test_a_warm_start_shorter_than_its_source_trains_its_own_steps_from_step_0(trained, tmp_path):
    model_dir = tmp_path / "today"
    keras.backend.clear_session()
    config = _config(**{"train.warm_start": str(trained), "train.steps": 5})
    results = train.train_and_evaluate(config, str(model_dir), mode="train")
    # The source trained 10 steps: the step and the optimizer start fresh, and 5 train here.
    assert results["step"] == 5
    recorded = json.loads((model_dir / "results.json").read_text())
    assert recorded["step"] == 5 and recorded["train"]["loss"] > 0
    assert tf.train.latest_checkpoint(str(model_dir / "checkpoints")).endswith("ckpt-5")
