"""Train steps: XLA compilation (`train.jit_compile`) trains to the same weights."""

import numpy as np
import pytest

from tests.helpers import tiny_config
from trainer import train


def _weights(tmp_path, strategy: str, jit_compile: bool, dropout: float = 0.0) -> list[np.ndarray]:
    config = tiny_config(
        **{"strategy.name": strategy, "train.jit_compile": jit_compile, "model.dropout": dropout}
    )
    job = train.build(config, str(tmp_path / f"{strategy}-{jit_compile}-{dropout}"))
    train.run(job, "train")
    return [w.numpy() for w in job.model.weights]


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_jit_compile_gives_the_same_weights(strategy, tmp_path):
    plain = _weights(tmp_path, strategy, jit_compile=False)
    compiled = _weights(tmp_path, strategy, jit_compile=True)
    assert len(plain) == len(compiled)
    for a, b in zip(plain, compiled):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_jit_compile_with_dropout_is_the_same_under_any_split(tmp_path):
    """Dropout's step counter updates without a cross-replica exchange, which XLA cannot hold.

    XLA draws other random numbers than TF's kernels, so the weights differ from
    those without XLA; under XLA, they do not depend on the replicas.
    """
    one = _weights(tmp_path, "one_device", jit_compile=True, dropout=0.1)
    mirrored = _weights(tmp_path, "mirrored", jit_compile=True, dropout=0.1)
    for a, b in zip(one, mirrored):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
