"""The same model, data, seed and global batch give the same weights under every sync plugin.

With dropout as shipped (0.1): the masks are keyed by step and by each
example's position in the global batch, not by the replica that computes it.
"""

import numpy as np
import pytest

from tests.helpers import tiny_config
from tests.steps_two_replicas import on_two_cpus
from trainer.loop import train


def _config(strategy: str):
    """The default model as shipped (two layers of 256, dropout 0.1), 20 steps."""
    return tiny_config(
        **on_two_cpus(strategy),
        **{
            "train.global_batch_size": 32,
            "model.dropout": 0.1,
            "model.hidden_units": (256, 256),
        },
    )


def _weights_after_20_steps(strategy: str, tmp_path) -> list[np.ndarray]:
    job = train.build(_config(strategy), str(tmp_path / strategy))
    train.run(job, "train")
    assert job.step() == 20
    return [w.numpy() for w in job.model.weights]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _weights_after_20_steps("one_device", tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage", "default"])
def test_same_weights_as_one_device(strategy, reference, tmp_path):
    """mirrored and central_storage run 2 replicas (2 of the 4 logical CPUs), default 1."""
    weights = _weights_after_20_steps(strategy, tmp_path)
    assert len(weights) == len(reference)
    for got, want in zip(weights, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_training_moves_the_weights(reference, tmp_path):
    job = train.build(_config("one_device"), str(tmp_path))
    initial = [w.numpy() for w in job.model.weights]
    assert max(np.abs(a - b).max() for a, b in zip(initial, reference)) > 1e-3
