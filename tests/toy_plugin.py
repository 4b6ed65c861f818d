"""A third-party strategy plugin, as another package would ship it."""

import tensorflow as tf

from strategies.base import Strategy


class Toy(Strategy):
    """A third-party plugin, for the registry test."""

    def _build(self) -> tf.distribute.Strategy:
        return tf.distribute.OneDeviceStrategy("/cpu:0")

    @property
    def communication(self) -> str:
        return "none"
