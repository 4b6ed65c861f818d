"""`mirrored`: synchronous replicas on the local devices, gradients all-reduced."""

import tensorflow as tf

from strategies import devices, transfer
from strategies.base import Strategy
from strategies.errors import UserError
from strategies.registry import register

CROSS_DEVICE_OPS = {
    "auto": None,  # TensorFlow's pick for the devices at hand
    "nccl": tf.distribute.NcclAllReduce,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "reduce_to_one": tf.distribute.ReductionToOneDevice,
}


@register("mirrored")
class Mirrored(Strategy):
    """Synchronous replicas on all local GPUs (else logical CPUs), a copy of every variable each."""

    supports_gradient_transfer = True

    @classmethod
    def local_replicas(cls, options, logical_cpus: int) -> int:
        return devices.one_per_device(options, logical_cpus)

    def _build(self) -> tf.distribute.Strategy:
        names = devices.parse_devices(self.options.get("devices", ""), "strategy.mirrored.devices")
        self.gradient_transfer = transfer.from_options(self.options, "mirrored")
        self._reduction = self.options.get("cross_device_ops", "auto")
        return tf.distribute.MirroredStrategy(
            names, cross_device_ops=_cross_device_ops(self._reduction, names)
        )

    @property
    def communication(self) -> str:
        ops = type(self.tf_strategy.extended._cross_device_ops).__name__  # what TF picked
        return (
            f"gradients all-reduced across {self.num_replicas_in_sync} replicas each step "
            f"({self._reduction}: {ops}); every device keeps a full copy of the variables"
        )


def _cross_device_ops(name: str, names: list[str]):
    if name not in CROSS_DEVICE_OPS:
        raise UserError(
            f"Unknown `strategy.mirrored.cross_device_ops` '{name}'; "
            f"known: {', '.join(CROSS_DEVICE_OPS)}."
        )
    if name == "nccl" and not any("GPU" in d for d in names):
        raise UserError(
            "`strategy.mirrored.cross_device_ops` 'nccl' needs GPUs, and none are in use; "
            "use 'auto' or 'reduce_to_one'."
        )
    cls = CROSS_DEVICE_OPS[name]
    if cls is None and not any("GPU" in d for d in names):
        # On CPUs, TF's pick is collective all-reduce, whose instance keys start afresh in
        # every MirroredStrategy: two strategies in one process (tests, notebooks) clash.
        # Reducing to one device is exact and as fast for CPU replicas.
        cls = tf.distribute.ReductionToOneDevice
    return cls() if cls else None
