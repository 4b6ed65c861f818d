"""bfloat16 gradient transfer and packing (`strategy.<name>.gradient_dtype`, `bytes_per_pack`).

The cross-replica sum really runs in bfloat16: one SGD step's update differs
from float32's by bfloat16 rounding (about 2^-8 relative), not by zero and
not by more; the default float32 path gives one_device's update to float32
rounding. Strategies that all-reduce nothing refuse the option in one line.
"""

import json

import numpy as np
import pytest

from tests.helpers import (
    checkpoint_values,
    config_flags,
    launched,
    one_line_error,
    tiny_config,
)
from tests.steps_two_replicas import on_two_cpus
from trainer.loop import train

ONE_SGD_STEP = {
    "train.steps": 1,
    "train.global_batch_size": 32,
    "optimizer.name": "sgd",
    "optimizer.schedule": "constant",
    "optimizer.warmup_steps": 0,
    "optimizer.learning_rate": 0.1,
}


def _config(strategy: str, dtype: str = "float32", **overrides):
    """`strategy` (on 2 replicas where it runs several) with `dtype` gradients, a 32 batch."""
    config = tiny_config(**on_two_cpus(strategy), **{"train.global_batch_size": 32, **overrides})
    config.strategy[strategy].gradient_dtype = dtype
    return config


def _flat(weights) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in weights])


def _update(config, model_dir) -> tuple[np.ndarray, dict]:
    """The change of every trainable weight over the run, and the run's results."""
    job = train.build(config, str(model_dir))
    before = _flat(job.model.trainable_weights)
    results = train.run(job, "train")
    assert all(w.dtype == "float32" for w in job.model.trainable_weights)
    return _flat(job.model.trainable_weights) - before, results


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def one_device_step(tmp_path_factory) -> np.ndarray:
    return _update(_config("one_device", **ONE_SGD_STEP), tmp_path_factory.mktemp("ref"))[0]


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_the_sum_runs_in_bfloat16_and_float32_is_unchanged(strategy, one_device_step, tmp_path):
    """2 replicas of 16 examples; SGD's update is the learning rate times the summed gradient."""
    float32, results = _update(_config(strategy, **ONE_SGD_STEP), tmp_path / "f32")
    assert _relative(float32, one_device_step) < 1e-5
    assert results["placement"]["gradient_transfer"] == {"dtype": "float32", "bytes_per_pack": 0}
    bfloat16, results = _update(_config(strategy, "bfloat16", **ONE_SGD_STEP), tmp_path / "bf16")
    # bfloat16 keeps 8 bits of mantissa: a relative error of about 2^-9 per rounding.
    assert 2**-12 < _relative(bfloat16, one_device_step) < 2**-6
    assert results["placement"]["gradient_transfer"] == {"dtype": "bfloat16", "bytes_per_pack": 0}
    assert results["placement"]["communication"].endswith("; gradients cross in bfloat16")


def test_clipping_sees_the_bfloat16_sum(one_device_step, tmp_path):
    """A binding `clip_global_norm`: the update is clipped to the whole batch's norm."""
    clip = {**ONE_SGD_STEP, "optimizer.clip_global_norm": 0.05}
    bfloat16, _ = _update(_config("mirrored", "bfloat16", **clip), tmp_path)
    norm = ONE_SGD_STEP["optimizer.learning_rate"] * 0.05
    assert np.linalg.norm(bfloat16) == pytest.approx(norm, rel=1e-3)
    clipped = one_device_step * norm / np.linalg.norm(one_device_step)
    assert 2**-12 < _relative(bfloat16, clipped) < 2**-6


def test_bfloat16_under_loss_scaling_trains_as_float32_does(tmp_path):
    """20 SGD steps under mixed_float16: Keras's loss scale, untouched, unscales the bf16 sum."""
    extra = {**ONE_SGD_STEP, "train.steps": 20, "train.precision": "mixed_float16"}
    float32, f32_results = _update(_config("mirrored", **extra), tmp_path / "f32")
    bfloat16, results = _update(_config("mirrored", "bfloat16", **extra), tmp_path / "bf16")
    assert 1e-5 < _relative(bfloat16, float32) < 2e-2
    assert results["train"]["loss"] == pytest.approx(f32_results["train"]["loss"], rel=1e-2)


@pytest.mark.parametrize(
    "strategy,field,value,expected",
    [
        ("one_device", "gradient_dtype", "bfloat16", "not all-reduced"),
        ("parameter_server", "gradient_dtype", "bfloat16", "--strategy=multi_worker"),
        ("mirrored", "gradient_dtype", "float16", "known: float32, bfloat16"),
        ("multi_worker", "bytes_per_pack", "lots", "must be 'auto'"),
    ],
)
def test_what_cannot_work_is_one_line(strategy, field, value, expected, tmp_path):
    config = _config(strategy)
    config.strategy[strategy][field] = value
    model_dir = tmp_path / "run"
    message = one_line_error(expected, train.train_and_evaluate, config, str(model_dir))
    assert f"`strategy.{strategy}.{field}`" in message
    assert not model_dir.exists()


def test_a_tasks_own_train_step_cannot_take_bfloat16_in_one_line(tmp_path):
    config = _config(
        "mirrored", "bfloat16", **{"task.name": "examples.custom_step:ConsistencyTask"}
    )
    message = one_line_error("train_step", train.build, config, str(tmp_path / "run"))
    assert "gradient_dtype` to float32" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a cluster; in-process strategies show the bfloat16 sum
def test_two_workers_all_reduce_bfloat16_in_16_mb_packs(tmp_path):
    """multi_worker, 2 local worker processes, 20 SGD steps: close to float32 on one device."""
    config = _config("one_device", **{**ONE_SGD_STEP, "train.steps": 20})
    train.train_and_evaluate(config, str(tmp_path / "one"), "train")
    fields = tuple(f for f in ONE_SGD_STEP if f != "train.steps") + (
        "train.steps",
        "train.steps_per_loop",
        "train.export",
        "eval.every",
        "model.hidden_units",
        "model.dropout",
    )
    result = launched(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        "--model_dir=mw",
        "--config.strategy.multi_worker.gradient_dtype=bfloat16",
        "--config.strategy.multi_worker.bytes_per_pack=auto",
        *config_flags(config, fields),
        cwd=str(tmp_path),
    )
    assert "gradients cross in bfloat16, 16 MB packs" in result.stdout  # the start-up line
    results = json.loads((tmp_path / "mw" / "results.json").read_text())
    assert results["placement"]["gradient_transfer"] == {
        "dtype": "bfloat16",
        "bytes_per_pack": 16 << 20,
    }
    assert results["step"] == 20
    got, want = checkpoint_values(tmp_path / "mw"), checkpoint_values(tmp_path / "one")
    weights = sorted(k for k in want if k.startswith("variables/"))
    assert weights and got.keys() == want.keys()
    difference = _relative(_flat(got[k] for k in weights), _flat(want[k] for k in weights))
    assert 1e-7 < difference < 2**-8
