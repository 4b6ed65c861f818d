"""`one_device`: every variable and op on one named device."""

import dataclasses

import tensorflow as tf

from strategies import devices
from strategies.base import Strategy
from strategies.registry import register


@dataclasses.dataclass(frozen=True)
class OneDeviceOptions:
    """`strategy.one_device`."""

    device: str = ""  # e.g. "/gpu:0"; "" = the first GPU, else the CPU
    gradient_dtype: str = "float32"  # one replica: nothing to all-reduce


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
