"""Train steps: XLA compilation (`train.jit_compile`) trains to the same weights."""

import numpy as np
import pytest
import tensorflow as tf

from strategies.base import SplitTrainStep, TrainStepProtocol
from tests.helpers import tiny_config
from tests.steps_two_replicas import on_two_cpus
from trainer.loop import steps, train


def _weights(
    tmp_path, strategy: str, jit_compile: bool, dropout: float = 0.0, replicas: int = 4
) -> list[np.ndarray]:
    """The weights after `tiny_config`'s 20 steps; `replicas`: 2 or 4, where it has several."""
    on = on_two_cpus(strategy) if replicas == 2 else {"strategy.name": strategy}
    config = tiny_config(**on, **{"train.jit_compile": jit_compile, "model.dropout": dropout})
    job = train.build(config, str(tmp_path / f"{strategy}-{jit_compile}-{dropout}"))
    train.run(job, "train")
    return [w.numpy() for w in job.model.weights]


@pytest.fixture(scope="module")
def without_xla(tmp_path_factory) -> list[np.ndarray]:
    """The weights trained without XLA under `one_device` (the same under `mirrored`)."""
    return _weights(tmp_path_factory.mktemp("plain"), "one_device", jit_compile=False)


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_jit_compile_gives_the_same_weights(strategy, without_xla, tmp_path):
    compiled = _weights(tmp_path, strategy, jit_compile=True, replicas=2)
    assert len(without_xla) == len(compiled)
    for a, b in zip(without_xla, compiled):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # XLA-compiles three times
def test_jit_compile_with_dropout_is_the_same_under_any_split(tmp_path):
    """Dropout's step counter updates without a cross-replica exchange, which XLA cannot hold.

    XLA draws other random numbers than TF's kernels, so the weights differ from
    those without XLA; under XLA, they do not depend on the replicas.
    """
    one = _weights(tmp_path, "one_device", jit_compile=True, dropout=0.1)
    mirrored = _weights(tmp_path, "mirrored", jit_compile=True, dropout=0.1)
    for a, b in zip(one, mirrored):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _train_step(tmp_path, name: str):
    config = tiny_config(**on_two_cpus("mirrored"), **{"optimizer.clip_global_norm": 1.0})
    job = train.build(config, str(tmp_path / name))
    gb = config.train.global_batch_size
    step = steps.TrainStep(job.model, job.optimizer, job.objective, gb, clip_global_norm=1.0)
    iterator = iter(job.strategy.distribute_dataset(job.dataset.train_fn(gb, config.seed, 0)))
    return job, step, iterator


def test_the_train_steps_halves_make_the_whole_step(tmp_path):
    whole_job, whole, iterator = _train_step(tmp_path, "whole")
    whole_sums = whole_job.strategy.run_steps(whole, iterator, 3)
    halves_job, step, iterator = _train_step(tmp_path, "halves")

    def by_halves(batch):
        grads, sums = step.gradients(batch)
        step.apply(grads)
        return sums

    halves_sums = halves_job.strategy.run_steps(by_halves, iterator, 3)
    assert isinstance(step, SplitTrainStep) and int(step.iterations.numpy()) == 3
    assert [v.name for v in step.variables] == [
        v.name for v in halves_job.model.trainable_variables
    ]
    assert halves_sums == pytest.approx(whole_sums)
    for a, b in zip(whole_job.model.weights, halves_job.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> train.BuiltJob:
    """A job of 2 replicas, built once for the tests of a task's own train step."""
    return train.build(tiny_config(**on_two_cpus("mirrored")), str(tmp_path_factory.mktemp("own")))


def test_a_tasks_own_train_step_is_a_step_without_halves(job):
    def own(model, optimizer, x, y, weights, replica_loss):
        raise AssertionError("not run")

    step = steps.CustomTrainStep(own, job.model, job.optimizer, job.objective, 64)
    assert isinstance(step, TrainStepProtocol) and not isinstance(step, SplitTrainStep)
    assert step.iterations is job.optimizer.iterations
    assert not hasattr(step, "gradients") and not hasattr(step, "apply")


def test_a_tasks_own_train_step_is_converted_by_autograph(job):
    config = job.config  # built by towerflow, which leaves towerflow's own code as it is
    gb = config.train.global_batch_size

    def own(model, optimizer, x, y, weights, replica_loss):
        loss, sums = replica_loss(model(x, training=True))
        if loss > 0:  # on a tensor: AutoGraph makes it a `tf.cond`
            sums["positive"] = tf.ones([])
        else:
            sums["positive"] = tf.zeros([])
        return sums

    step = steps.CustomTrainStep(own, job.model, job.optimizer, job.objective, gb)
    iterator = iter(job.strategy.distribute_dataset(job.dataset.train_fn(gb, config.seed, 0)))
    sums = job.strategy.run_steps(step, iterator, 2)
    assert sums["positive"] == 2 * job.strategy.num_replicas_in_sync  # 1 a step on each replica
