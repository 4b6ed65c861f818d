"""`train.precision`: mixed policies compute in 16 bits and keep float32 variables."""

import math

import keras
import pytest

from tests.helpers import tiny_config
from tests.steps_two_replicas import on_two_cpus
from towerflow.errors import UserError
from trainer.loop import train

FAST = {"optimizer.warmup_steps": 0, "optimizer.learning_rate": 1e-2, "train.steps": 40}


def _dense_layers(model: keras.Model) -> list:
    return [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_mixed_bfloat16_trains_with_float32_variables(strategy, tmp_path):
    config = tiny_config(**FAST, **on_two_cpus(strategy), **{"train.precision": "mixed_bfloat16"})
    job = train.build(config, str(tmp_path))
    assert [layer.compute_dtype for layer in _dense_layers(job.model)] == ["bfloat16"] * 2
    assert {v.dtype for v in job.model.trainable_variables} == {"float32"}
    assert keras.mixed_precision.global_policy().name == "float32", "the policy is restored"
    results = train.run(job, "train")
    assert results["step"] == 40
    assert results["train"]["loss"] < 1.5, "the loss falls from ln(10) = 2.3"


def test_mixed_float16_scales_the_loss(tmp_path):
    config = tiny_config(**FAST, **on_two_cpus("mirrored"), **{"train.precision": "mixed_float16"})
    job = train.build(config, str(tmp_path))
    assert isinstance(job.optimizer, keras.optimizers.LossScaleOptimizer)
    assert _dense_layers(job.model)[0].compute_dtype == "float16"
    results = train.run(job, "train")
    assert results["step"] == 40 and math.isfinite(results["train"]["loss"])
    assert results["train"]["loss"] < 1.5


def test_unknown_precision_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"Unknown `train.precision` 'float8'; known: float32"):
        train.build(tiny_config(**{"train.precision": "float8"}), str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()
