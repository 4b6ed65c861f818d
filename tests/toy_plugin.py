"""A third-party strategy plugin, as another package would ship it."""

import tensorflow as tf

from strategies.base import Strategy
from strategies.cluster import tf_config as cluster
from strategies.cluster.membership import Membership


class Toy(Strategy):
    """A third-party plugin, for the registry test."""

    def _build(self) -> tf.distribute.Strategy:
        # Who this process is comes from its cluster, not from the plugin's own code.
        self.membership = Membership(cluster.from_env())
        return tf.distribute.OneDeviceStrategy("/cpu:0")

    @property
    def communication(self) -> str:
        return "none"
