"""What the loop reads after each block, in one call: the step, the learning rate, the features'.

The controller reads the step after each block (and again after the actions,
which may roll it back); the `rates` action shows the learning rate, and a
feature may read a variable of its own (the input wait's seconds,
`Feature.reads`). Each read is a call into TensorFlow, and between blocks
such a call costs far more than its work (code that has not run for a while
is slow to resume: a millisecond or more a call on the development machine,
see docs/performance.md). So one traced function reads them all, and the
actions take the values of the read that followed the block.
"""

from __future__ import annotations

from collections.abc import Mapping

import keras
import tensorflow as tf


class Readings:
    """The step, the learning rate and named variables, read together.

    `step()` reads them all now and returns the step; `learning_rate` and
    `value(name)` give the others from that read (in float64, which holds
    steps up to 2**53 exactly).

    Args:
      optimizer: its `iterations` is the step, its `learning_rate` the rate.
      variables: more scalars to read with them, by name.
    """

    def __init__(
        self, optimizer: keras.optimizers.Optimizer, variables: Mapping[str, tf.Variable] = {}
    ):
        self._names = list(variables)
        extra = [variables[name] for name in self._names]

        def read() -> tf.Tensor:
            values = [optimizer.iterations, optimizer.learning_rate, *extra]
            return tf.stack([tf.cast(v, tf.float64) for v in values])

        self._read = tf.function(read, autograph=False)  # TF ops only: nothing to convert
        self.learning_rate = float("nan")  # until the first read
        self._values = dict.fromkeys(self._names, 0.0)

    def step(self) -> int:
        """The step now; also reads the learning rate and the named variables."""
        values = self._read().numpy()
        self.learning_rate = float(values[1])
        self._values = dict(zip(self._names, (float(v) for v in values[2:]), strict=True))
        return int(values[0])

    def value(self, name: str) -> float:
        """The variable `name` as of the last `step()` (0.0 before the first)."""
        return self._values[name]
