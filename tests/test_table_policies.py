"""Dynamic tables' policies under the trainer: LFU eviction, fallback rows, their bad config."""

import json
import pathlib
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import cli_in_process
from tests.test_models import tiny_ctr_config
from towerflow.errors import UserError
from trainer.layers import tables
from trainer.loop import train
from trainer.loop.checkpoints import Checkpointer

REPO = pathlib.Path(__file__).resolve().parent.parent


def _raw_ctr_config(strategy: str, steps: int):
    """The tiny ctr job on raw ids, into a table too small for them, with fallback rows."""
    config = tiny_ctr_config(
        **{"strategy.name": strategy, "train.steps": steps, "train.deterministic": True}
    )
    config.data.ctr.update({"id_space": "raw", "drift_every": 50, "zipf_a": 1.1})
    config.model.update(
        {"embedding": "dynamic", "capacity": 60, "eviction": "lfu", "fallback_rows": 16}
    )
    return config


# Two 80-second runs; the default tier has the admission alike under both (test_dynamic_embedding).
@pytest.mark.slow
def test_one_device_and_mirrored_evict_alike_and_train_the_same_fallback_rows(tmp_path):
    """Under `mirrored` every replica admits the gathered batch: one admission a step."""
    found = {}
    for strategy in ("one_device", "mirrored"):
        config = _raw_ctr_config(strategy, 12)
        model_dir = str(tmp_path / strategy)
        train.train_and_evaluate(config, model_dir)
        job = train.build(config, model_dir)
        Checkpointer(model_dir, True, 1, **train.checkpointed(job)).restore()
        layer = job.model.get_layer("embedding")
        keys, values = layer.table.index.export()
        ids = tf.boolean_mask(keys, values >= 0)
        rows = dict(zip(ids.numpy().tolist(), layer(ids).numpy(), strict=True))
        found[strategy] = rows, layer.fallback.numpy(), layer.figures()[0]
    (one, one_fallback, one_figures), (mirrored, fallback, figures) = found.values()
    assert figures["evicted"] > 0 and len(one) == 60, "a full table evicting"
    assert sorted(one) == sorted(mirrored)
    for key, row in one.items():
        np.testing.assert_allclose(mirrored[key], row, rtol=1e-5, atol=1e-6)
    assert np.abs(one_fallback).sum() > 0, "the fallback rows trained"
    np.testing.assert_allclose(fallback, one_fallback, rtol=1e-5, atol=1e-6)
    assert figures["bytes_held"] == one_figures["bytes_held"]
    assert figures["lookups"] == one_figures["lookups"], "each step's lookups counted once"


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--config.model.eviction=mru", "`model.eviction` 'mru' is not an eviction policy"),
        ("--config.model.fallback_rows=-1", "`model.fallback_rows` (-1) must be >= 0"),
        ("--config.model.fallback_hashes=0", "`model.fallback_hashes` (0) must be >= 1"),
        ("--config.model.seen_bits=-1", "`model.seen_bits` (-1) must be >= 0"),
        (
            "--config.model.fallback_combiner=max",
            "`model.fallback_combiner` 'max' is not a way to combine fallback rows",
        ),
    ],
)
def test_bad_table_options_are_one_line_and_exit_2_leaving_model_dir_alone(
    flag, message, tmp_path, capsys
):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    code, _, err = cli_in_process(
        f"--config={REPO / 'configs' / 'ctr.py'}",
        "--config.strategy.name=one_device",
        "--config.model.embedding=dynamic",
        flag,
        f"--model_dir={tmp_path / 'run'}",
        capsys=capsys,
    )
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert message in last and "--config.model." in last
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory):
    """A model_dir trained 2 steps with fallback rows read 2 at a time."""
    model_dir = tmp_path_factory.mktemp("fallback") / "run"
    train.train_and_evaluate(_raw_ctr_config("one_device", 2), str(model_dir), mode="train")
    return model_dir


@pytest.mark.parametrize(
    "older, now, refused_naming",
    [(False, 2, None), (False, 1, 2), (True, 2, 1), (True, 1, None)],
)
def test_a_resumed_run_reads_as_many_fallback_rows_per_id_as_it_trained(
    fallback_run, older, now, refused_naming, tmp_path
):
    """A `variables.json` without `fallback_hashes` (written before it existed) read one row."""
    model_dir = tmp_path / "run"
    shutil.copytree(fallback_run, model_dir)
    if older:
        names = json.loads((model_dir / "variables.json").read_text())
        for part in names["tables"]:
            del part["fallback_hashes"]
        (model_dir / "variables.json").write_text(json.dumps(names))
    config = _raw_ctr_config("one_device", 4)
    config.model.fallback_hashes = now
    if refused_naming is None:
        train.build(config, str(model_dir))
        return
    with pytest.raises(UserError) as error:
        train.build(config, str(model_dir))
    assert f"read its fallback rows {refused_naming} per id there and {now} here" in str(
        error.value
    )
    assert f"`--config.model.fallback_hashes={refused_naming}`" in str(error.value)


def test_a_resumed_run_combines_its_fallback_rows_as_it_trained(fallback_run, tmp_path):
    """A `variables.json` without `fallback_combiner` (written before it existed) summed them."""
    model_dir = tmp_path / "run"
    shutil.copytree(fallback_run, model_dir)
    names = json.loads((model_dir / "variables.json").read_text())
    for part in names["tables"]:
        assert part.pop("fallback_combiner") == "mean"
    (model_dir / "variables.json").write_text(json.dumps(names))
    config = _raw_ctr_config("one_device", 4)
    with pytest.raises(UserError) as error:
        train.build(config, str(model_dir))
    assert "read the sum of its fallback rows there and the mean here" in str(error.value)
    assert "`--config.model.fallback_combiner=sum`" in str(error.value)
    config.model.fallback_combiner = "sum"
    train.build(config, str(model_dir))


@pytest.mark.parametrize("older", [False, True])
def test_a_resumed_run_keeps_the_seed_its_fallback_rows_trained_with(fallback_run, older, tmp_path):
    """A `variables.json` without `fallback_seed` (written before it existed) read unsalted rows."""
    model_dir = tmp_path / "run"
    shutil.copytree(fallback_run, model_dir)
    config = _raw_ctr_config("one_device", 4)
    if older:
        names = json.loads((model_dir / "variables.json").read_text())
        for part in names["tables"]:
            del part["fallback_seed"]
        (model_dir / "variables.json").write_text(json.dumps(names))
    train.build(config, str(model_dir))  # the seed it trained with: 0
    config.model.table_seed = 5
    with pytest.raises(UserError) as error:
        train.build(config, str(model_dir))
    assert "with seed 0 there and 5 here" in str(error.value)
    assert "`--config.model.table_seed=0`" in str(error.value)


def test_a_resumed_or_warm_started_hashed_table_keeps_the_salt_of_its_hashing(tmp_path):
    config = _raw_ctr_config("one_device", 2)
    config.model.embedding, config.model.table_seed = "hashed", 3
    model_dir = tmp_path / "run"
    keras.backend.clear_session()  # its layers named as in a new process (`dense`, ...)
    train.train_and_evaluate(config, str(model_dir), mode="train")
    names = json.loads((model_dir / "variables.json").read_text())
    assert names["hashing"] == {"hashing": [3, 3]}
    config.train.steps = 4
    train.build(config, str(model_dir))
    config.model.table_seed = 0
    with pytest.raises(UserError) as error:
        train.build(config, str(model_dir))
    assert "hashed ids with salt [3, 3] there and None here" in str(error.value)
    # A warm start that loads the table it hashes into checks the salt too.
    config.train.warm_start = str(model_dir)
    keras.backend.clear_session()
    with pytest.raises(UserError) as error:
        train.build(config, str(tmp_path / "warm"))
    assert f"`train.warm_start` '{model_dir}': layer `hashing`" in str(error.value)
    assert "salt [3, 3] there and None here" in str(error.value)
    config.train.warm_start_include = "dense"  # the table starts fresh: its salt is free
    keras.backend.clear_session()
    plan = train.build(config, str(tmp_path / "warm")).feature("warm_start").plan
    assert plan.variables and plan.fresh == ["embedding/embeddings_0"], plan.line()


def test_the_bytes_of_a_held_id_do_not_grow_with_its_count():
    table = tables.DynamicTable(4, eviction="lfu")
    table.admit(tf.constant([1] * 1000, tf.int64))
    figures = table.figures()
    assert figures["index_bytes"] == tables.ENTRY_BYTES + tables.INFO_ENTRY_BYTES
    assert table.contents()["counts"].tolist() == [1000 * tables.COUNT_ONE]
