"""`one_device`: every variable and op on one named device."""

import tensorflow as tf

from strategies import devices
from strategies.base import Strategy
from strategies.options import OneDeviceOptions
from strategies.registry import register


@register("one_device")
class OneDevice(Strategy, options=OneDeviceOptions):
    """One replica on one device (option `device`; default the first GPU, else the CPU)."""

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        spec = self.options.device
        device = devices.parse_devices(spec, "strategy.one_device.device")[0] if spec else None
        return tf.distribute.OneDeviceStrategy(device or (devices.gpus() or devices.cpus())[0])

    @property
    def communication(self) -> str:
        return "none: one replica, variables on its device"
