"""`strategies.tf_private`: each private TF/Keras name it reads or implements is still there.

Each test asserts the upstream behaviour an entry relies on, so it fails when
upstream changes it (the accessor must then follow), and that the accessor
gives what it says.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from strategies import tf_private


def test_installed_versions_are_the_ones_every_access_targets():
    for name in tf_private.ACCESSES:
        assert tf_private.targeted(name), name


class _Hooked(tf_private.OptimizerHooks, keras.optimizers.SGD):
    """Records each public hook Keras reaches through its private one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def update_variables(self, distribution, grads_and_vars, learning_rate):
        self.seen.append("update_variables")
        return super().update_variables(distribution, grads_and_vars, learning_rate)

    def sum_gradients(self, grads_and_vars):
        self.seen.append("sum_gradients")
        return super().sum_gradients(grads_and_vars)

    def uses_weight_decay(self, variable):
        self.seen.append("uses_weight_decay")
        return super().uses_weight_decay(variable)


def test_keras_applies_gradients_through_its_private_update_sum_and_decay_hooks():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        variable = tf.Variable([1.0, 1.0])
        optimizer = _Hooked(0.5, weight_decay=0.1, name="hooked")
        optimizer.build([variable])

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([tf.constant([1.0, 1.0])], [variable]))

    step()
    assert set(optimizer.seen) == {"update_variables", "sum_gradients", "uses_weight_decay"}
    # Summed over the 2 replicas: 1 - 0.5 * 0.1 (decay), then - 0.5 * 2.
    np.testing.assert_allclose(variable.numpy(), [1.0 - 0.05 - 1.0] * 2, rtol=1e-6)
    assert tf_private.OptimizerHooks.sums_gradients()


@pytest.mark.parametrize(
    ("optimizer", "kinds"),
    [
        (keras.optimizers.Adam(amsgrad=True), ("momentums", "velocities", "velocity_hats")),
        (keras.optimizers.AdamW(), ("momentums", "velocities")),
        (keras.optimizers.Adagrad(), ("accumulators",)),
        (keras.optimizers.Ftrl(), ("accumulators", "linears")),
    ],
    ids=["adam", "adamw", "adagrad", "ftrl"],
)
def test_keras_optimizers_keep_their_slots_in_private_lists_by_variable_index(optimizer, kinds):
    variables = [tf.Variable(tf.ones([2])), tf.Variable(tf.ones([3, 4]))]
    optimizer.build(variables)
    assert tf_private.built_variables(optimizer) == variables
    for kind in kinds:
        assert not hasattr(optimizer, kind), kind  # no public name
        for variable in variables:
            slot = tf_private.slots(optimizer, kind)[tf_private.variable_index(optimizer, variable)]
            assert slot.shape == variable.shape, kind
    keys = {tf_private.variable_key(optimizer, v) for v in variables}
    assert len(keys) == 2


def test_an_unknown_slot_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="known: momentums, velocities"):
        tf_private.slots(keras.optimizers.Adam(), "moments")


def test_a_variable_and_its_replica_copies_share_one_optimizer_key():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        variable = tf.Variable([1.0])
        optimizer = keras.optimizers.SGD()
        optimizer.build([variable])
    copies = strategy.experimental_local_results(variable)
    keys = {tf_private.variable_key(optimizer, v) for v in (variable, *copies)}
    assert len(keys) == 1 and tf_private.variable_index(optimizer, copies[1]) == 0


def test_an_optimizer_keeps_its_schedule_privately_and_shows_only_its_value():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule)
    assert tf_private.learning_rate_of(optimizer) is schedule
    assert not isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule)


def test_batch_normalization_computes_a_batchs_moments_in_a_private_method():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 2))
    inputs = tf.constant([[1.0, 2.0], [3.0, 6.0]])
    mean, variance = tf_private.batch_moments(layer, inputs)
    np.testing.assert_allclose(mean.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(variance.numpy(), [1.0, 4.0])
    assert "self._moments(" in inspect.getsource(keras.layers.BatchNormalization.call)


def test_the_eager_context_aborts_collectives_with_a_code_and_message_only_privately():
    from tensorflow.python.eager import context  # noqa: PLC0415

    assert list(inspect.signature(context.Context.abort_collective_ops).parameters) == [
        "self",
        "code",
        "message",
    ]
    assert not hasattr(tf.distribute, "abort_collective_ops")  # no public name
    source = inspect.getsource(tf_private.abort_collective_ops)
    assert "abort_collective_ops(tf.errors.UNAVAILABLE, message)" in source


class _Counted(tf_private.WrappedComposite):
    def __next__(self):
        self.state.assign_add(1)
        return next(self.inner)


def test_a_wrapped_iterator_is_a_function_input_traced_once_for_all_iterators():
    counter = tf.Variable(0, dtype=tf.int64)
    traces = []

    @tf.function
    def take(iterator):
        traces.append(1)
        return next(iterator) + next(iterator)

    dataset = tf.data.Dataset.range(10)
    first, second = _Counted(iter(dataset), counter), _Counted(iter(dataset), counter)
    assert int(take(first)) == 1 and int(take(first)) == 5 and int(take(second)) == 1
    assert len(traces) == 1 and int(counter.numpy()) == 6
    other = _Counted(iter(dataset), tf.Variable(0, dtype=tf.int64))
    take(other)
    assert len(traces) == 2  # another state: another trace


def test_a_checkpoint_saves_the_tensors_a_trackable_serializes(tmp_path):
    saved = tf_private.SavedTensors()
    saved.tensors = {"rows": tf.constant([1.0, 2.0])}
    path = tf.train.Checkpoint(delta=saved).write(str(tmp_path / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    np.testing.assert_array_equal(reader.get_tensor("delta/.ATTRIBUTES/rows"), [1.0, 2.0])
