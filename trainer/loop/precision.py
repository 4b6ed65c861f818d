"""Numeric precision of training: `train.precision` = float32, mixed_bfloat16 or mixed_float16.

Under a mixed policy the layers compute in 16 bits while their variables stay
float32 (Keras dtype policies); the tasks cast the outputs to float32 for the
loss. float16 also needs loss scaling against underflowing gradients, so its
optimizer is wrapped in `keras.optimizers.LossScaleOptimizer`, and the train
step scales the loss with `optimizer.scale_loss`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from towerflow.errors import UserError

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def check(name: str) -> str:
    """Returns `name` if it is a known precision.

    Raises:
      UserError: an unknown name.
    """
    if name not in PRECISIONS:
        raise UserError(
            f"Unknown `train.precision` '{name}'; known: {', '.join(PRECISIONS)}; "
            "e.g. `--config.train.precision=mixed_bfloat16`."
        )
    return name


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    """Layers created inside compute in precision `name`; the global policy is restored after."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(check(name))
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer, name: str) -> keras.optimizers.Optimizer:
    """`optimizer`, with dynamic loss scaling for float16."""
    if check(name) == "mixed_float16":
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
