"""What the loop reads after each block, in one call: the step, the learning rate, the input wait.

The controller reads the step after each block (and again after the actions,
which may roll it back); the `rates` action shows the learning rate, and the
input-wait action the seconds the block's steps waited. Each read is a call
into TensorFlow, and between blocks such a call costs far more than its work
(code that has not run for a while is slow to resume: a millisecond or more a
call on the development machine, see docs/performance.md). So one traced
function reads all three, and the actions take the values of the read that
followed the block.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.data.wait import InputWait


class Readings:
    """The step, the learning rate and the input wait's total, read together.

    `step()` reads all three now and returns the step; `learning_rate` and
    `input_wait_total` keep the other two from that read (in float64, which
    holds steps up to 2**53 exactly).
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, input_wait: InputWait | None):
        seconds = None if input_wait is None else input_wait.variable

        def read() -> tf.Tensor:
            values = [optimizer.iterations, optimizer.learning_rate]
            if seconds is not None:
                values.append(seconds)
            return tf.stack([tf.cast(v, tf.float64) for v in values])

        self._read = tf.function(read)
        self.learning_rate = float("nan")  # until the first read
        self.input_wait_total = 0.0

    def step(self) -> int:
        """The step now; also reads the learning rate and the input wait's total."""
        values = self._read().numpy()
        self.learning_rate = float(values[1])
        if len(values) > 2:
            self.input_wait_total = float(values[2])
        return int(values[0])
