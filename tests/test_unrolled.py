"""A long run's small step runs several steps to each iteration of its loop's `while`."""

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import strategies
from strategies import unrolled
from tests.helpers import tiny_config
from trainer.loop import checks, train

BATCH = 8
# `mirrored` over two of the logical CPUs: each replica traces its steps as one of four does.
TWO_CPUS = "CPU:0,CPU:1"


def _mirrored() -> strategies.Strategy:
    return strategies.get("mirrored", ml_collections.ConfigDict({"devices": TWO_CPUS}))


class _Step:
    """Counts its traces (one per replica each time a loop's graph holds a step)."""

    def __init__(self, unroll: unrolled.Unroll | None, dtype: tf.DType = tf.float32):
        if unroll is not None:
            self.unroll = unroll
        self.traces = 0
        self.dtype = dtype

    def __call__(self, batch):
        self.traces += 1
        return {"examples": tf.cast(tf.size(batch), self.dtype), "steps": tf.constant(1.0)}


def _dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    return tf.data.Dataset.range(10_000).batch(ctx.get_per_replica_batch_size(BATCH))


@pytest.mark.parametrize(
    ("unroll", "max_ops", "steps_traced"),
    [
        # the first step (traced alone, its ops counted), the remainder's, an iteration's 4
        (unrolled.Unroll(4, if_small=True), unrolled.MAX_OPS, 1 + 1 + 4),
        (unrolled.Unroll(4, if_small=True), 0, 1 + 1),  # more ops than MAX_OPS: one
        (unrolled.Unroll(4), 0, 1 + 4),  # asked for whatever the step's size: from zero
        (unrolled.Unroll(), unrolled.MAX_OPS, 1),  # the step traced once
        (None, unrolled.MAX_OPS, 1),  # a step that does not ask: one an iteration
    ],
)
def test_a_step_is_unrolled_as_it_asks(monkeypatch, unroll, max_ops, steps_traced):
    monkeypatch.setattr(unrolled, "MAX_OPS", max_ops)
    strategy = _mirrored()
    step = _Step(unroll)
    out = strategy.run_steps(step, iter(strategy.distribute_dataset(_dataset_fn)), 7)
    assert out == {"examples": 7 * BATCH, "steps": 7 * strategy.num_replicas_in_sync}
    assert step.traces == steps_traced * strategy.num_replicas_in_sync


@pytest.mark.parametrize("dtype", [tf.int64, tf.float64])
def test_sums_that_are_not_float32_are_carried_as_they_are(dtype):
    """The loop's one vector of float32 sums (`BufferedSums`) gives way, traced once more."""
    strategy = _mirrored()
    step = _Step(None, dtype)
    dataset = strategy.distribute_dataset(_dataset_fn)
    out = strategy.run_steps(step, iter(dataset), 7)
    assert out == {"examples": 7 * BATCH, "steps": 7 * strategy.num_replicas_in_sync}
    # The buffered loop's trace stopped at the first replica's sums; then the first
    # step's and the loop's on every replica.
    replicas = strategy.num_replicas_in_sync
    assert step.traces == 1 + 2 * replicas
    assert strategy.run_steps(step, iter(dataset), 2)["examples"] == 2 * BATCH
    assert step.traces == 1 + 2 * replicas  # the loop it fell back to is kept


def test_a_run_of_long_run_steps_or_more_asks_for_more_steps_an_iteration(tmp_path):
    auto = unrolled.Unroll(unrolled.STEPS, if_small=True)
    assert unrolled.for_run(0, unrolled.LONG_RUN, True) == auto
    assert unrolled.for_run(0, checks.UNTIL_STOPPED, True) == auto
    assert unrolled.for_run(0, unrolled.LONG_RUN - 1, True) == unrolled.Unroll()
    assert unrolled.for_run(0, unrolled.LONG_RUN, False) == unrolled.Unroll()  # a cluster
    assert unrolled.for_run(2, 10, False) == unrolled.Unroll(2)  # as configured, any step
    for fields, asked in [
        ({"train.steps": 1000}, unrolled.Unroll()),
        ({"train.steps": unrolled.LONG_RUN}, auto),
        ({"train.steps": 1000, "train.steps_per_iteration": 3}, unrolled.Unroll(3)),
    ]:
        job = train.build(tiny_config(**fields), str(tmp_path / f"run{len(fields)}{asked.steps}"))
        assert train._train_step(job).unroll == asked


def _trained(strategy_name: str, steps: int, n: int, tmp_path) -> tuple:
    fields = {
        "strategy.name": strategy_name,
        "strategy.mirrored.devices": TWO_CPUS,
        "train.steps_per_iteration": steps,
    }
    job = train.build(tiny_config(**fields), str(tmp_path / f"{strategy_name}-{steps}-{n}"))
    step = train._train_step(job)
    iterator = iter(job.strategy.distribute_dataset(train._train_stream(job, 0)))
    sums = [job.strategy.run_steps(step, iterator, n) for _ in range(2)]
    return sums, [v.numpy() for v in job.model.variables]


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored"])
def test_an_unrolled_loop_trains_the_same_model(tmp_path, strategy_name):
    """The same steps in the same order: the same sums and the same weights."""
    n = 6  # a step before the loop, one in the remainder, one iteration of 4
    sums, weights = _trained(strategy_name, 1, n, tmp_path)
    sums4, weights4 = _trained(strategy_name, 4, n, tmp_path)
    for a, b in zip(sums, sums4):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(weights, weights4):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
