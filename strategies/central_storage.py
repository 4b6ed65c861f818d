"""`central_storage`: variables on the host, one tower per device."""

import tensorflow as tf

from strategies import devices
from strategies.base import Strategy
from strategies.registry import register


@register("central_storage")
class CentralStorage(Strategy):
    """Variables on the host, one replica (tower) per device, gradients reduced on the host."""

    @classmethod
    def local_replicas(cls, options, logical_cpus: int) -> int:
        return devices.one_per_device(options, logical_cpus)

    def _build(self) -> tf.distribute.Strategy:
        compute = devices.parse_devices(
            self.options.get("devices", ""), "strategy.central_storage.devices"
        )
        spec = self.options.get("parameter_device", "")
        host = (
            devices.parse_devices(spec, "strategy.central_storage.parameter_device")[0]
            if (spec)
            else "/device:CPU:0"
        )
        strategy = tf.distribute.experimental.CentralStorageStrategy(compute, parameter_device=host)
        # Hand a short last batch to some towers (and nothing to the rest) instead of
        # dropping it, as `mirrored` does, so evaluation counts every example.
        strategy.extended.experimental_enable_get_next_as_optional = True
        return strategy

    @property
    def communication(self) -> str:
        host = self.tf_strategy.extended.parameter_devices[0]
        return (
            f"each of {self.num_replicas_in_sync} towers reads the variables from {host} "
            "and sends its gradients there, where they are summed and applied once"
        )
