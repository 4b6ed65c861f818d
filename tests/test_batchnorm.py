"""BatchNorm statistics agree across replicas: built-in models as on one device, a user's in step.

The built-in `resnet` normalizes over the global batch (synchronized batch
statistics) under several replicas, so its weights and moving statistics
match `one_device`'s (`cnn` has no BatchNorm: `test_equivalence` stands for it). A user's own
`BatchNormalization` keeps per-replica batch statistics, but its moving
statistics are averaged over the replicas, so every copy holds the same value.
"""

import numpy as np
import pytest

from tests.helpers import checkpoint_values, launched, tiny_config
from trainer.loop import train

SMALL = {
    "train.global_batch_size": 32,
    "train.steps": 6,
    "train.steps_per_loop": 3,
    "train.checkpoint_every": 6,
    "train.deterministic": True,
    "model.filters": 8,
    "model.blocks": 1,
}


def _config(strategy: str, model: str):
    return tiny_config(**{**SMALL, "strategy.name": strategy, "model.name": model})


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """`one_device`'s checkpointed `resnet` weights after 6 steps."""
    model_dir = tmp_path_factory.mktemp("one")
    train.train_and_evaluate(_config("one_device", "resnet"), str(model_dir), "train")
    return checkpoint_values(model_dir)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(got) > 3
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_builtin_resnet_under_two_mirrored_replicas_matches_one_device(one_device, tmp_path):
    # Two of the logical CPUs: the statistics cross replicas as over four, at half the tracing.
    config = _config("mirrored", "resnet")
    config.strategy.mirrored.devices = "CPU:0,CPU:1"
    job = train.build(config, str(tmp_path))
    assert job.strategy.num_replicas_in_sync == 2
    train.run(job, "train")
    assert sum("moving_variance" in w.path for w in job.model.weights) >= 3
    _assert_same(checkpoint_values(tmp_path), one_device)


def test_builtin_resnet_under_two_workers_matches_one_device(one_device, tmp_path):
    flags = [f"--config.{k}={v}" for k, v in SMALL.items()]
    result = launched(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        "--mode=train",  # the weights are compared, not an eval
        "--model_dir=run",
        "--config.model.name=resnet",
        "--config.eval.every=0",
        "--config.train.export=False",
        "--config.model.hidden_units=(32,)",
        "--config.model.dropout=0",
        *flags,
        cwd=str(tmp_path),
    )
    assert "replicas: 2" in result.stdout
    _assert_same(checkpoint_values(tmp_path / "run"), one_device)


def test_a_users_own_batchnorm_keeps_one_value_on_every_replica(tmp_path):
    config = tiny_config(
        **{
            **SMALL,
            "strategy.name": "mirrored",
            "strategy.mirrored.devices": "CPU:0,CPU:1",  # copies enough to differ
            "model.name": "tests.check_models:plain_batchnorm",
        }
    )
    job = train.build(config, str(tmp_path))
    train.run(job, "train")
    assert job.strategy.num_replicas_in_sync == 2
    stats = [w for w in job.model.weights if "moving_" in w.path]
    assert len(stats) == 2
    for variable in stats:
        copies = [
            c.numpy() for c in job.strategy.tf_strategy.experimental_local_results(variable.value)
        ]
        assert len(copies) == 2, variable.path
        assert not np.allclose(copies[0], 0.0 if "mean" in variable.path else 1.0), "it trained"
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)
