"""Asynchronous checkpoints: written in the background, restored to the same values."""

import numpy as np

from tests.helpers import tiny_config
from trainer import train
from trainer.checkpoints import Checkpointer


def _values(job) -> list[np.ndarray]:
    return [v.numpy() for v in job.model.variables + job.optimizer.variables]


def test_async_training_checkpoint_restores_the_same_values(tmp_path):
    config = tiny_config(**{"train.async_checkpoint": True})
    job = train.build(config, str(tmp_path))
    train.run(job, "train")  # saves at steps 0, 10 and 20 in the background
    fresh = train.build(config, str(tmp_path))
    checkpointer = Checkpointer(str(tmp_path), True, 3, **train._checkpointed(fresh))
    assert checkpointer.restore().endswith("ckpt-20")
    for got, want in zip(_values(fresh), _values(job), strict=True):
        np.testing.assert_array_equal(got, want)


def test_repeated_async_saves_each_hold_their_values(tmp_path):
    job = train.build(tiny_config(), str(tmp_path))
    checkpointer = Checkpointer(str(tmp_path), True, 5, async_save=True, **train._checkpointed(job))
    kernel = job.model.trainable_variables[0]
    saved = {}
    for step in (1, 2, 3):
        kernel.assign(np.full(kernel.shape, float(step), np.float32))
        saved[step] = checkpointer.save(step)
    assert checkpointer.latest == saved[3]
    checkpointer.restore(saved[2])
    np.testing.assert_array_equal(kernel.numpy(), np.full(kernel.shape, 2.0, np.float32))
    checkpointer.close()
