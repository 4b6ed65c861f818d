"""Train steps: XLA compilation (`train.jit_compile`) trains to the same weights."""

import numpy as np
import pytest

from tests.helpers import tiny_config
from trainer import train


def _weights(tmp_path, strategy: str, jit_compile: bool) -> list[np.ndarray]:
    config = tiny_config(**{"strategy.name": strategy, "train.jit_compile": jit_compile})
    job = train.build(config, str(tmp_path / f"{strategy}-{jit_compile}"))
    train.run(job, "train")
    return [w.numpy() for w in job.model.weights]


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_jit_compile_gives_the_same_weights(strategy, tmp_path):
    plain = _weights(tmp_path, strategy, jit_compile=False)
    compiled = _weights(tmp_path, strategy, jit_compile=True)
    assert len(plain) == len(compiled)
    for a, b in zip(plain, compiled):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
