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
def test_two_steps_added_read_back_as_the_steps_sums_added(sums):
    start = sums.zeros() if isinstance(sums, BufferedSums) else sums.pack(_sums())
    total = sums.add(start, _sums(2.0))
    got = sums.unpack(total)
    want = _sums(2.0 if isinstance(sums, BufferedSums) else 3.0)
    assert tf.nest.map_structure(lambda v: v.shape, got) == tf.nest.map_structure(
        lambda v: v.shape, want
    )
    tf.nest.map_structure(lambda g, w: np.testing.assert_array_equal(g, w), got, want)


def test_a_buffer_is_its_capacity_long_zeros_after_the_sums():
    packed = BufferedSums(16).pack(_sums())
    assert packed.shape == [16]
    np.testing.assert_array_equal(packed[8:], np.zeros(8))


@pytest.mark.parametrize(
    "sums",
    [
        {"count": tf.constant(3, tf.int64)},
        {"loss": tf.constant(1.0, tf.float64)},
        {"histogram": tf.zeros([17])},  # over the capacity
    ],
)
def test_sums_that_do_not_fit_are_refused(sums):
    with pytest.raises(Unbuffered):
        BufferedSums(16).pack(sums)
