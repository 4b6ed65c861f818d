"""`mirrored`: synchronous replicas on the local devices, gradients all-reduced."""

import contextlib
import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from strategies import devices, tf_patches, transfer
from strategies.base import Strategy, Traits, read_options
from strategies.options import MirroredOptions
from strategies.registry import register
from towerflow.errors import UserError

# The TensorFlow class of each of `options.CROSS_DEVICE_OPS` but "auto" (TensorFlow's pick).
_CROSS_DEVICE_OPS = {
    "nccl": tf.distribute.NcclAllReduce,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "reduce_to_one": tf.distribute.ReductionToOneDevice,
}


@register("mirrored")
class Mirrored(Strategy, options=MirroredOptions):
    """Synchronous replicas on all local GPUs (else logical CPUs), a copy of every variable each."""

    traits = Traits(gradient_transfer=True)

    @classmethod
    def local_replicas(cls, options, logical_cpus: int) -> int:
        return devices.one_per_device(read_options(cls, options), logical_cpus)

    def scope(self) -> contextlib.AbstractContextManager:
        """The strategy's scope, where layer state updated in a step is averaged over replicas."""
        return replica_state_averaged(self.tf_strategy)

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        names = devices.parse_devices(self.options.devices, "strategy.mirrored.devices")
        sent = transfer.from_options(self.options, "mirrored")
        self.traits = dataclasses.replace(self.traits, transfer=sent)
        self._reduction = self.options.cross_device_ops
        tf_patches.own_collective_keys()
        return tf.distribute.MirroredStrategy(
            names, cross_device_ops=_cross_device_ops(self._reduction, names)
        )

    @property
    def communication(self) -> str:
        ops = tf_patches.cross_device_ops_name(self.tf_strategy)  # what TF picked
        return (
            f"gradients all-reduced across {self.num_replicas_in_sync} replicas each step "
            f"({self._reduction}: {ops}); every device keeps a full copy of the variables"
        )


@contextlib.contextmanager
def replica_state_averaged(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """`strategy.scope()`, where floating-point layer state is averaged over the replicas.

    Keras creates the state its layers update in a step (`BatchNormalization`'s
    moving statistics) with aggregation "none", which to `tf.distribute` means
    that each replica updates its own copy from its own part of the batch: the
    copies drift apart, and the one checkpointed and exported is replica 0's.
    Created here, such a variable gets aggregation "mean": a replica's update
    is averaged over the replicas and every copy gets the same value.
    Integer state (a seed generator's, `trainer.layers.Dropout`'s step), which
    every replica advances alike, and an optimizer's own state are left as they are.
    """

    def averaged(next_creator, **kwargs):
        aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        if (
            kwargs.get("trainable") is False
            and aggregation == tf.VariableAggregation.NONE
            and dtype.is_floating
            # An optimizer's state (slots, a loss scale) is updated in cross-replica
            # context, or assigned in a branch where "mean" could not merge.
            and not tf_patches.made_by_keras_optimizer()
        ):
            kwargs["aggregation"] = tf.VariableAggregation.MEAN
        return next_creator(**kwargs)

    with strategy.scope(), tf.variable_creator_scope(averaged):
        yield


def _cross_device_ops(name: str, names: list[str]):
    """The cross-device ops `name` (one of `options.CROSS_DEVICE_OPS`) makes for devices `names`."""
    if name == "nccl" and not any("GPU" in d for d in names):
        raise UserError(
            "`strategy.mirrored.cross_device_ops` 'nccl' needs GPUs, and none are in use; "
            "use 'auto' or 'reduce_to_one'."
        )
    cls = _CROSS_DEVICE_OPS.get(name)  # None: "auto"
    if cls is None and not any("GPU" in d for d in names):
        # On CPUs, TF's pick is collective all-reduce, whose instance keys start afresh in
        # every MirroredStrategy: two strategies in one process (tests, notebooks) clash.
        # Reducing to one device is exact and as fast for CPU replicas.
        cls = tf.distribute.ReductionToOneDevice
    return cls() if cls else None
