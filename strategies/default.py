"""`default`: ordinary TensorFlow behaviour, no distribution."""

import tensorflow as tf

from strategies.base import Strategy
from strategies.registry import register


@register("default")
class Default(Strategy):
    """Ordinary single-device TensorFlow: no distribution, TF places every op."""

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        return tf.distribute.get_strategy()

    @property
    def compute_devices(self) -> list[str]:
        return ["(placed by TensorFlow)"]

    @property
    def communication(self) -> str:
        return "none: one replica, variables where TensorFlow places them"
