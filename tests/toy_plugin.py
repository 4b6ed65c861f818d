"""A third-party strategy plugin, as another package would ship it."""

import dataclasses

import tensorflow as tf

from strategies.base import Strategy
from strategies.cluster import tf_config as cluster
from strategies.cluster.membership import Membership


@dataclasses.dataclass(frozen=True)
class ToyOptions:
    """`strategy.toy`: declared by the plugin, as a built-in's are."""

    device: str = "/cpu:0"  # where its one replica runs


class Toy(Strategy, options=ToyOptions):
    """A third-party plugin, for the registry test."""

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        # Who this process is comes from its cluster, not from the plugin's own code.
        self.membership = Membership(cluster.from_env())
        return tf.distribute.OneDeviceStrategy(self.options.device)

    @property
    def communication(self) -> str:
        return "none"
