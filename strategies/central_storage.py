"""`central_storage`: variables on the host, one tower per device."""

import contextlib
import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from strategies import devices, transfer
from strategies.base import Strategy, Traits, read_options
from strategies.options import CentralStorageOptions
from strategies.registry import register


@register("central_storage")
class CentralStorage(Strategy, options=CentralStorageOptions):
    """Variables on the host, one replica (tower) per device, gradients reduced on the host."""

    # Variables live away from the devices that compute; the loss scale's counters
    # cannot update from a branch there.
    traits = Traits(jit_compile=False, loss_scaling=False, gradient_transfer=True)

    @classmethod
    def local_replicas(cls, options, logical_cpus: int) -> int:
        return devices.one_per_device(read_options(cls, options), logical_cpus)

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        compute = devices.parse_devices(self.options.devices, "strategy.central_storage.devices")
        sent = transfer.from_options(self.options, "central_storage")
        self.traits = dataclasses.replace(self.traits, transfer=sent)
        spec = self.options.parameter_device
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

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The strategy's scope, where state variables can be updated from a tower."""
        with self.tf_strategy.scope(), tf.variable_creator_scope(_state_updatable_by_towers):
            yield

    @property
    def communication(self) -> str:
        host = self.tf_strategy.extended.parameter_devices[0]
        return (
            f"each of {self.num_replicas_in_sync} towers reads the variables from {host} "
            "and sends its gradients there, where they are summed and applied once"
        )


def _state_updatable_by_towers(next_creator, **kwargs):
    """Creates a variable; non-trainable state without an aggregation gets one.

    Keras creates its non-trainable state (a `Dropout`'s seed-generator state,
    `BatchNormalization`'s moving statistics) with aggregation "none", which to
    `tf.distribute` means: each replica updates its own copy. Under
    `mirrored` every replica has one; here the towers share the one copy on
    the host, and TF refuses a tower's update of it ("You must specify an
    aggregation method to update a AggregatingVariable in Replica Context").
    The towers' new values are averaged into the copy (floats: moving
    statistics become those of the whole global batch), or the first tower's
    is kept (integers, e.g. seed states, which every tower advances alike).
    """
    aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
    if kwargs.get("trainable") is False and aggregation == tf.VariableAggregation.NONE:
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        kwargs["aggregation"] = (
            tf.VariableAggregation.MEAN
            if dtype.is_floating
            else tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
    return next_creator(**kwargs)
