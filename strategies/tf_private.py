"""The private TensorFlow and Keras names the loop and the layers read or implement.

`strategies.tf_patches` holds what changes TensorFlow's or Keras's objects;
this module only reads private state or implements private hooks where no
public name exists. Each entry of `ACCESSES` names the library, the versions
it was written and tested for, and the upstream behaviour it relies on;
`tests/test_tf_private.py` asserts each still holds (a canary that fails when
upstream changes), and on an untargeted version the first use logs one
warning (`tf_patches.targeted`). No other module of towerflow names a private
TF or Keras API (`tests/test_private_apis.py`).

- Keras optimizers (`trainer.loop.optim`): `OptimizerHooks` gives three of
  Keras's private hooks public names a subclass overrides; `slots`,
  `variable_index`, `variable_key`, `built_variables` and `learning_rate_of`
  read what an optimizer keeps privately.
- `batch_moments`: a `BatchNormalization`'s mean and variance of a batch
  (`parameter_server`'s atomic moving statistics).
- `abort_collective_ops`: the collectives in flight end with an error
  (`trainer.loop.faults`, elastic training's watchdog).
- `WrappedComposite`: a value `tf.function` takes apart into one inner
  composite value (an iterator) and state of its own (`trainer.data.wait`).
- `SavedTensors`: tensors a checkpoint saves under their names
  (`trainer.loop.deltas`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from strategies import tf_patches

Patch = tf_patches.Patch

ACCESSES = {
    "optimizer_update_loop": Patch(
        "keras",
        ("3.15",),
        "the TF optimizer's apply updates each variable's copies in "
        "_distributed_tf_update_step(distribution, grads_and_vars, learning_rate)",
    ),
    "optimizer_gradient_sum": Patch(
        "keras",
        ("3.15",),
        "the TF optimizer's apply sums the gradients over replicas in "
        "_all_reduce_sum_gradients(grads_and_vars)",
    ),
    "optimizer_weight_decay": Patch(
        "keras",
        ("3.15",),
        "an optimizer asks _use_weight_decay(variable) of each variable before decaying it",
    ),
    "optimizer_slots": Patch(
        "keras",
        ("3.15",),
        "Adam, AdamW, Adagrad and Ftrl keep their slots in private lists (_momentums, "
        "_velocities, _velocity_hats, _accumulators, _linears), one per variable built on",
    ),
    "optimizer_variables": Patch(
        "keras",
        ("3.15",),
        "an optimizer numbers the variables it was built on (_trainable_variables, "
        "_get_variable_index) and keys them by _var_key; no public lookup",
    ),
    "optimizer_learning_rate": Patch(
        "keras",
        ("3.15",),
        "an optimizer keeps the schedule it was given in _learning_rate; the public "
        "learning_rate reads its current value",
    ),
    "batch_moments": Patch(
        "keras",
        ("3.15",),
        "BatchNormalization computes a batch's mean and variance in _moments(inputs, mask)",
    ),
    "abort_collective_ops": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "the eager context's abort_collective_ops(code, message) ends the collectives in "
        "flight (as MultiWorkerMirroredStrategy's own health check does); no public API",
    ),
    "composite_value": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "tf.function takes a value apart into components only if it subclasses "
        "tf.__internal__.CompositeTensor with a TypeSpec (_type_spec, _component_specs, "
        "_to_components, _from_components, _serialize)",
    ),
    "saved_tensors": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "a checkpoint saves the tensors a tf.__internal__.tracking.Trackable returns from "
        "_serialize_to_tensors; public objects save only variables",
    ),
}

SLOT_KINDS = ("momentums", "velocities", "velocity_hats", "accumulators", "linears")


def targeted(name: str) -> bool:
    """Whether the installed library is a version entry `name` targets (else one warning)."""
    return tf_patches.targeted(name, ACCESSES)


# Keras optimizers ---------------------------------------------------------------------------


class OptimizerHooks:
    """Keras's private optimizer hooks, under public names a subclass overrides.

    Mixed in just before the Keras class (`class Adam(..., OptimizerHooks,
    keras.optimizers.Adam)`): Keras calls its private hook, which calls the
    public one here; an override reaches Keras's own through `super()`.
    """

    def update_variables(self, distribution, grads_and_vars, learning_rate) -> None:
        """Updates each variable's copies with its gradient (Keras's own loop)."""
        targeted("optimizer_update_loop")
        super()._distributed_tf_update_step(distribution, grads_and_vars, learning_rate)

    def sum_gradients(self, grads_and_vars) -> list:
        """`grads_and_vars` with the gradients summed over the replicas (Keras's all-reduce)."""
        targeted("optimizer_gradient_sum")
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def uses_weight_decay(self, variable) -> bool:
        """Whether weight decay applies to `variable` (Keras's exclusions)."""
        targeted("optimizer_weight_decay")
        return super()._use_weight_decay(variable)

    @staticmethod
    def sums_gradients() -> bool:
        """Whether this Keras sums the gradients through the hook `sum_gradients` overrides."""
        return hasattr(keras.optimizers.Optimizer, "_all_reduce_sum_gradients")

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        return self.update_variables(distribution, grads_and_vars, learning_rate)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return self.sum_gradients(grads_and_vars)

    def _use_weight_decay(self, variable):
        return self.uses_weight_decay(variable)


def slots(optimizer: keras.optimizers.Optimizer, kind: str) -> list:
    """The slot variables of `kind` (`SLOT_KINDS`) of a built optimizer, by `variable_index`.

    Raises:
      ValueError: `kind` is not one of `SLOT_KINDS`.
    """
    if kind not in SLOT_KINDS:
        raise ValueError(f"Unknown slot kind '{kind}'; known: {', '.join(SLOT_KINDS)}.")
    targeted("optimizer_slots")
    return getattr(optimizer, f"_{kind}")


def variable_index(optimizer: keras.optimizers.Optimizer, variable) -> int:
    """The position of `variable` (or its copy, in an update) among `built_variables`."""
    targeted("optimizer_variables")
    return optimizer._get_variable_index(variable)


def variable_key(optimizer: keras.optimizers.Optimizer, variable):
    """The key `optimizer` knows `variable` by: one for a variable and all its copies."""
    targeted("optimizer_variables")
    return optimizer._var_key(variable)


def built_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables `optimizer` was built on, in order (`variable_index`)."""
    targeted("optimizer_variables")
    return optimizer._trainable_variables


def learning_rate_of(optimizer: keras.optimizers.Optimizer):
    """What `optimizer` was given as its learning rate: a schedule, or its rate variable."""
    targeted("optimizer_learning_rate")
    return optimizer._learning_rate


# Keras layers ------------------------------------------------------------------------------


def batch_moments(layer: keras.layers.BatchNormalization, inputs) -> tuple:
    """`(mean, variance)` of `inputs` over the axes `layer` normalizes, as its `call` computes."""
    targeted("batch_moments")
    return layer._moments(inputs, None)


# TensorFlow --------------------------------------------------------------------------------


def abort_collective_ops(message: str) -> None:
    """The collectives in flight in this process end with `UnavailableError(message)`.

    What `MultiWorkerMirroredStrategy`'s own health check calls when a peer is
    gone; the step waiting in them raises in its thread.
    """
    from tensorflow.python.eager import context  # noqa: PLC0415

    targeted("abort_collective_ops")
    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


class WrappedComposite(tf.__internal__.CompositeTensor):
    """A value around one composite value `inner` (an iterator), with Python `state` of its own.

    `tf.function` given one takes `inner` as its input and rebuilds the wrapper
    in the trace as `type(self)(inner, state)`; a plain Python object would be
    traced anew for each value and held in the trace as a capture. Two
    wrappers trace alike when their inner values do and their `state` is the
    same object. A subclass takes `(inner, state)` in its constructor.
    """

    def __init__(self, inner, state):
        self.inner, self.state = inner, state

    @property
    def _type_spec(self) -> _WrappedSpec:
        targeted("composite_value")
        return _WrappedSpec(type(self), tf.type_spec_from_value(self.inner), self.state)


class _WrappedSpec(tf.TypeSpec):
    """The inner value's spec; the state is the same object in every trace."""

    def __init__(self, value_type: type, inner: tf.TypeSpec, state):
        self._value_type, self._inner, self._state = value_type, inner, state

    @property
    def value_type(self) -> type:
        return self._value_type

    @property
    def _component_specs(self) -> tf.TypeSpec:
        return self._inner

    def _to_components(self, value: WrappedComposite):
        return value.inner

    def _from_components(self, inner) -> WrappedComposite:
        return self._value_type(inner, self._state)

    def _serialize(self) -> tuple:
        # A class and the state are not hashable keys; their names and identity are.
        kind = f"{self._value_type.__module__}.{self._value_type.__qualname__}"
        return (kind, self._inner, id(self._state))

    # TypeSpec's own versions of these rebuild a spec from `_serialize`, which holds
    # the state's identity, not the state.
    def _without_tensor_names(self) -> _WrappedSpec:
        return _WrappedSpec(self._value_type, self._inner._without_tensor_names(), self._state)

    def is_subtype_of(self, other) -> bool:
        return self._same_state(other) and self._inner.is_subtype_of(other._inner)

    def most_specific_common_supertype(self, others) -> _WrappedSpec | None:
        if not all(self._same_state(other) for other in others):
            return None
        inner = self._inner.most_specific_common_supertype([other._inner for other in others])
        return None if inner is None else _WrappedSpec(self._value_type, inner, self._state)

    def _same_state(self, other) -> bool:
        return (
            type(other) is type(self)
            and other._value_type is self._value_type
            and other._state is self._state
        )


class SavedTensors(tf.__internal__.tracking.Trackable):
    """Tensors a checkpoint saves under their names (`<attribute>/.ATTRIBUTES/<name>`).

    `tensors` is read at each save: set it where the save is traced. Read them
    back with `tf.train.load_checkpoint`.
    """

    def __init__(self):
        self.tensors: dict[str, tf.Tensor] = {}

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        targeted("saved_tensors")
        return self.tensors
