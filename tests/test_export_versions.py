"""Exports while training: versions in `model_dir/export`, the newest kept, none half-written."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import one_line_error, tiny_config
from trainer.loop import export as export_lib
from trainer.loop import train
from trainer.loop.checkpoints import Checkpointer


def _versioned_run(tmp_path, **overrides):
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "train.steps": 30,
            "export.every_steps": 10,
            "export.keep": 2,
            "train.export": True,
            **overrides,
        }
    )
    model_dir = tmp_path / "run"
    train.train_and_evaluate(config, str(model_dir), mode="train")
    return model_dir


def test_exports_every_n_steps_are_versions_and_only_the_newest_are_kept(tmp_path):
    model_dir = _versioned_run(tmp_path)
    base = model_dir / "export"
    # Steps 10, 20, 30 were exported (30 also the end); keep=2 leaves the newest two.
    assert export_lib.versions(str(base)) == [20, 30]
    assert sorted(os.listdir(base)) == ["20", "30"], "no staging directory is left behind"
    serve = tf.saved_model.load(str(base / "30")).signatures["serving_default"]
    assert serve(inputs=tf.zeros([2, 8, 8, 1]))["probabilities"].shape == (2, 10)


def test_the_newest_version_serves_the_final_checkpoints_weights(tmp_path):
    model_dir = _versioned_run(tmp_path, **{"train.export": False})
    config = tiny_config(**{"strategy.name": "one_device", "train.steps": 30})
    job = train.build(config, str(model_dir))
    Checkpointer(str(model_dir), False, 1, **train.checkpointed(job)).restore()
    x = tf.constant(np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32))
    served = tf.saved_model.load(str(model_dir / "export" / "30")).signatures["serving_default"]
    np.testing.assert_allclose(served(inputs=x)["logits"], job.model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # about 75 s of a clock; export.every_steps stays in the default tier
def test_exports_every_few_seconds_follow_the_clock_after_each_block(tmp_path):
    # A clock this short is due after every block of 5 steps.
    overrides = {"export.every_steps": 0, "export.every_secs": 1e-6, "export.keep": 0}
    model_dir = _versioned_run(tmp_path, **overrides)
    assert export_lib.versions(str(model_dir / "export")) == [5, 10, 15, 20, 25, 30]


def test_a_version_not_above_the_newest_is_not_written(tmp_path):
    written = []
    base = str(tmp_path / "export")
    os.makedirs(os.path.join(base, "20"))
    assert not export_lib.export_version(base, 20, 0, written.append)
    assert not export_lib.export_version(base, 15, 0, written.append)
    assert written == [], "versions only increase: a server never goes back"


@pytest.mark.parametrize("field", ["export.every_steps", "export.every_secs", "export.keep"])
def test_a_negative_export_interval_is_one_line_and_leaves_model_dir_alone(tmp_path, field):
    config = tiny_config(**{field: -1})
    model_dir = tmp_path / "run"
    message = one_line_error(f"`{field}` \\(-1", train.train_and_evaluate, config, str(model_dir))
    assert "must be >= 0" in message
    assert not model_dir.exists()
