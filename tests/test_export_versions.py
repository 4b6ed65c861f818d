"""Exports while training: versions in `model_dir/export`, the newest kept, none half-written."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.fresh_process import run_script
from tests.helpers import (
    IN_PROCESS_CLUSTER,
    assert_exit,
    one_line_error,
    tiny_config,
)
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


# Exports of a model with a dynamic table, under a bare `tf.distribute`
# ParameterServerStrategy over in-process servers on 127.0.0.1 ("ps": the table's parts
# and the dense layers on 2 ps members) or in one process ("local"); the memory they
# added after the first quarter, and the model's predictions for two examples.
_EXPORTS = (
    IN_PROCESS_CLUSTER
    + """
import json, sys
import keras
from trainer.layers import DynamicEmbedding
from trainer.loop import export

base, where, exports = sys.argv[1], sys.argv[2], int(sys.argv[3])
strategy = bare_parameter_server() if where == "ps" else tf.distribute.get_strategy()
with strategy.scope():
    inputs = keras.Input((2,), dtype="int64")
    vectors = DynamicEmbedding(4, combiner="sum", capacity=20)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(vectors)))
ids = tf.constant([[1, 2], [3, 4]], tf.int64)
model(ids, training=True)  # admits the ids
before = rss_mb()
for version in range(1, exports + 1):
    export.export_version(base, version, 2, lambda path: export.export(model, path, None, 0))
    if version == exports // 4:
        before = rss_mb()
print(json.dumps(model(ids, training=False).numpy().ravel().tolist()))
print(rss_mb() - before)
"""
)


def _exported(tmp_path, where: str, exports: int) -> float:
    """The memory `exports` versions added after the first quarter; the newest two serve."""
    base = tmp_path / "export"
    result = run_script(_EXPORTS, str(base), where, str(exports), cwd=tmp_path)
    assert_exit(result)
    predictions, growth = result.stdout.strip().splitlines()[-2:]
    assert export_lib.versions(str(base)) == [exports - 1, exports]
    serve = tf.saved_model.load(str(base / str(exports))).signatures["serving_default"]
    (name,) = serve.structured_input_signature[1]
    served = serve(**{name: tf.constant([[1, 2], [3, 4]], tf.int64)})["predictions"]
    np.testing.assert_allclose(served.numpy(), json.loads(predictions), rtol=1e-6)
    return float(growth)


# Local: the third export drops the first (keep 2). On ps members (about 3 CPU-s an export
# here), the second writes the variables through the same traced write again.
@pytest.mark.parametrize(("where", "exports"), [("local", 3), ("ps", 2)])
def test_a_dynamic_table_exported_again_and_again_serves_the_model(tmp_path, where, exports):
    _exported(tmp_path, where, exports)


@pytest.mark.slow  # 40 exports: 30-90 s
@pytest.mark.parametrize("where", ["local", "ps"])
def test_repeated_exports_of_a_dynamic_table_keep_memory_flat(tmp_path, where):
    """30 exports add little memory, in one process and with the variables on ps members.

    Each export traces its serving function anew; a dynamic table's lookup
    once kept each of those graphs for good (a `tf.custom_gradient` traced in
    a function is registered for the whole process): 100-200 MB over these
    30 exports. And with the variables on ps members, TensorFlow writes them
    through a new function each export, which each member keeps; there the
    export writes them through one traced write (`trainer.loop.writes`).
    """
    growth = _exported(tmp_path, where, exports=40)
    assert growth < 50, f"30 exports grew memory by {growth:.0f} MB"
