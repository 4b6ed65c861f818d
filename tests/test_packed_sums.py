"""A loop's totals: a step's sums carried round its `while` in one vector, and read back."""

import numpy as np
import pytest
import tensorflow as tf

from strategies.packed_sums import BufferedSums, PackedSums, Unbuffered


def _sums(scale: float = 1.0) -> dict:
    return {
        "loss": tf.constant(2.5 * scale),
        "histogram": {"positive": tf.range(3, dtype=tf.float32) * scale},
        "grid": tf.ones([2, 2]) * scale,
    }


@pytest.mark.parametrize("sums", [BufferedSums(16), PackedSums()])
def test_steps_added_read_back_as_the_steps_sums_added(sums):
    if isinstance(sums, BufferedSums):
        total = sums.add(sums.add(sums.zeros(), _sums()), _sums(2.0))
        assert total.shape == [8], "as long as a step's sums from the first step on"
        total = sums.trim(total)
    else:
        total = sums.add(sums.pack(_sums()), _sums(2.0))
    got = sums.unpack(total)
    want = _sums(3.0)
    assert tf.nest.map_structure(lambda v: v.shape, got) == tf.nest.map_structure(
        lambda v: v.shape, want
    )
    tf.nest.map_structure(lambda g, w: np.testing.assert_array_equal(g, w), got, want)


def test_the_totals_start_as_capacity_zeros_of_no_fixed_length():
    zeros = tf.function(BufferedSums(16).zeros).get_concrete_function().structured_outputs
    assert zeros.shape.as_list() == [None], "any step's sums add to them"
    np.testing.assert_array_equal(BufferedSums(16).zeros(), np.zeros(16))


@pytest.mark.parametrize(
    "sums",
    [
        {"count": tf.constant(3, tf.int64)},
        {"loss": tf.constant(1.0, tf.float64)},
        {"histogram": tf.zeros([17])},  # over the capacity
    ],
)
def test_sums_that_do_not_fit_are_refused(sums):
    buffered = BufferedSums(16)
    with pytest.raises(Unbuffered):
        buffered.add(buffered.zeros(), sums)


def test_runs_that_each_make_and_trace_their_own_loops_are_not_warned_of_retracing(caplog):
    """Each run in a process (`trainer.train_and_evaluate` called again) makes its own loops;
    TensorFlow's "triggered tf.function retracing" warning would blame the user for it."""
    import strategies  # noqa: PLC0415

    strategy = strategies.get("one_device")
    dataset = tf.data.Dataset.range(64).map(lambda x: tf.cast(x, tf.float32)).batch(4)
    iterator = iter(strategy.distribute_dataset(lambda ctx: dataset))
    with caplog.at_level("WARNING"):
        for _ in range(7):  # a new step each time, as each run's
            sums = strategy.run_steps(lambda batch: {"total": tf.reduce_sum(batch)}, iterator, 1)
    assert sums["total"] == sum(range(24, 28))
    assert not [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]
