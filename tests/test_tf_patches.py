"""`strategies.tf_patches`: each upstream behaviour it works around still holds.

Each test asserts the unpatched TensorFlow/Keras behaviour, so it fails when
upstream changes it (the patch may then be dropped), and that the patch does
what it says.
"""

import ctypes
import gc
import importlib.util
import inspect
import logging
import os
import sys
import tempfile
import threading
import weakref
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.autograph.operators import py_builtins
from tensorflow.python.util import object_identity

from strategies import tf_patches


def test_installed_versions_are_the_ones_every_patch_targets():
    for name in tf_patches.PATCHES:
        assert tf_patches.targeted(name), name


def test_an_untargeted_version_logs_one_warning_naming_the_upstream_behaviour(caplog):
    patch = tf_patches.Patch("keras", ("0.1",), "does something")
    with (
        mock.patch.dict(tf_patches.PATCHES, {"old": patch}),
        caplog.at_level(logging.WARNING),
    ):
        assert not tf_patches.targeted("old")
        assert not tf_patches.targeted("old")
    tf_patches._warned.discard("old")
    warnings = [r.getMessage() for r in caplog.records if "old" in r.getMessage()]
    assert len(warnings) == 1
    assert "targets keras 0.1, found" in warnings[0] and "does something" in warnings[0]


def test_keras_copies_a_variable_to_the_host_as_a_new_tf_variable_each_time():
    variable = keras.Variable(np.ones(3, np.float32))
    copies = []
    for _ in range(2):
        object_map = object_identity.ObjectIdentityDictionary()
        tf_patches._KERAS_COPY_TO_CPU(variable, object_map)
        assert isinstance(object_map[variable], tf.Variable)
        assert object_map[variable] is not object_map[variable.value]
        copies.append(object_map[variable])
    assert copies[0] is not copies[1]


def test_patched_keras_variables_share_the_host_copy_of_their_tf_variable():
    with mock.patch.object(keras.Variable, "_copy_trackable_to_cpu", tf_patches._KERAS_COPY_TO_CPU):
        tf_patches.keras_variables_save_asynchronously()
        variable = keras.Variable(np.ones(3, np.float32))
        object_map = object_identity.ObjectIdentityDictionary()
        variable._copy_trackable_to_cpu(object_map)
        assert object_map[variable] is object_map[variable.value]


def test_keras_assign_add_reads_then_assigns_and_the_patched_counter_adds_atomically():
    optimizer = keras.optimizers.SGD(0.1)
    counter = optimizer.iterations
    with mock.patch.object(type(counter), "assign", autospec=True) as assign:
        counter.assign_add(1)
    assign.assert_called_once()  # upstream: value read, then the sum assigned
    tf_patches.count_steps_atomically(counter)
    tf_patches.count_steps_atomically(counter)  # once only
    with mock.patch.object(type(counter), "assign", autospec=True) as assign:
        counter.assign_add(2)
    assign.assert_not_called()
    assert int(counter.numpy()) == 2
    assert "assign_add" not in vars(keras.optimizers.SGD(0.1).iterations)  # one optimizer only


def test_an_optimizer_built_for_any_strategy_keeps_keras_own_step_counter():
    from configs import default  # noqa: PLC0415
    from trainer.loop import optim  # noqa: PLC0415

    optimizer = optim.build(default.get_config().optimizer, total_steps=10)
    assert "assign_add" not in vars(optimizer.iterations)  # only `parameter_server` patches it


def test_the_parameter_server_plugin_makes_the_counter_atomic_before_its_steps():
    from strategies import parameter_server  # noqa: PLC0415

    source = inspect.getsource(parameter_server.ParameterServer.run_steps)
    assert "tf_patches.count_steps_atomically(step_fn.iterations)" in source


def test_keras_tf_optimizer_sums_gradients_over_replicas_in_a_private_method():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer  # noqa: PLC0415

    source = inspect.getsource(tf_optimizer.TFOptimizer)
    assert "def _all_reduce_sum_gradients" in source
    assert "self._all_reduce_sum_gradients(" in source  # called by its own apply
    assert "all_reduce" in inspect.getsource(tf_optimizer.TFOptimizer._all_reduce_sum_gradients)


def test_a_keras_variable_wraps_the_tf_variable_it_is_given():
    variable = keras.Variable(np.ones(2, np.float32), name="moved")
    new = tf.Variable(np.full(2, 3.0, np.float32))
    tf_patches.move_variable(variable, new)
    assert variable.value is new and float(np.sum(variable.numpy())) == 6.0


def test_nested_layers_are_listed_by_keras_private_walk_only():
    inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="inner_dense")])
    model = keras.Sequential([keras.Input((2,)), inner, keras.layers.Dense(1, name="top")])
    assert "inner_dense" not in [layer.name for layer in model.layers]  # public: top level
    names = [layer.name for layer in tf_patches.flat_layers(model)]
    assert "inner_dense" in names and "top" in names and model.name not in names


def test_the_layers_after_a_layer_are_read_from_keras_private_nodes():
    inputs = keras.Input((3,), dtype="int64")
    hashing = keras.layers.Hashing(10, name="hashing")
    table = keras.layers.Embedding(10, 2, name="table")
    keras.Model(inputs, table(keras.layers.Reshape((3,))(hashing(inputs))))
    (after,) = tf_patches.layers_after(hashing)
    assert after.name.startswith("reshape") and tf_patches.layers_after(after) == [table]
    assert tf_patches.layers_after(table) == []  # the model's output: nothing after it


def test_each_mirrored_strategy_gets_collective_keys_of_its_own():
    assert isinstance(tf.distribute.MirroredStrategy._collective_key_base, int)  # upstream's
    ctx = tf.distribute.get_replica_context
    first = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    vectors, ids = first.run(
        lambda: (ctx().all_gather(tf.ones([3, 4]), 0), ctx().all_gather(tf.constant([1, 2]), 0))
    )
    assert first.experimental_local_results(ids)[1].numpy().tolist() == [1, 2, 1, 2]

    tf_patches.own_collective_keys()  # without it: "Collective instance 100 expected type 2"
    second = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    summed = tf.function(lambda: second.run(lambda: ctx().all_reduce("sum", tf.ones([1]))))()
    assert [t.numpy().tolist() for t in second.experimental_local_results(summed)] == [[2.0]] * 2


def test_mirrored_keeps_its_cross_device_ops_in_a_private_field():
    from tensorflow.python.distribute import cross_device_ops  # noqa: PLC0415

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert not hasattr(strategy.extended, "cross_device_ops")  # no public name
    name = tf_patches.cross_device_ops_name(strategy)
    assert issubclass(getattr(cross_device_ops, name), cross_device_ops.CrossDeviceOps)


def test_multi_worker_keeps_its_worker_count_in_a_private_field():
    from tensorflow.python.distribute import collective_all_reduce_strategy as mw  # noqa: PLC0415

    source = inspect.getsource(mw.CollectiveAllReduceExtended)
    assert "self._num_workers = " in source
    assert not hasattr(mw.CollectiveAllReduceExtended, "num_workers")  # no public name


def test_parameter_server_keeps_its_ps_count_in_a_private_field():
    from tensorflow.python.distribute import parameter_server_strategy_v2 as ps  # noqa: PLC0415

    source = inspect.getsource(ps.ParameterServerStrategyV2Extended.__init__)
    assert "self._num_ps = " in source
    assert not hasattr(ps.ParameterServerStrategyV2Extended, "num_ps")  # no public name
    # The public `cluster_resolver` reads the extended's resolver, which it never sets.
    assert "self._cluster_resolver = " not in source


def test_a_critical_section_keeps_its_mutex_handle_in_a_private_field():
    lock = tf.CriticalSection(name="canary_lock", shared_name="canary_lock")
    assert not hasattr(lock, "handle") and not hasattr(lock, "device")  # no public name
    handle = tf_patches.lock_handle(lock)
    assert handle.dtype == tf.resource and "CPU:0" in handle.device


def test_keras_batch_normalization_assigns_its_moving_statistics():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 2))
    with mock.patch.object(type(layer.moving_mean), "assign", autospec=True) as assign:
        layer(np.ones((4, 2), np.float32), training=True)
    assert assign.call_count == 2  # mean and variance: read, then assigned (not atomic)


def test_swap_class_takes_a_subclass_only():
    class Atomic(keras.layers.BatchNormalization):
        pass

    layer = keras.layers.BatchNormalization()
    tf_patches.swap_class(layer, Atomic)
    assert type(layer) is Atomic
    with pytest.raises(TypeError, match="Dense is not a subclass of Atomic"):
        tf_patches.swap_class(layer, keras.layers.Dense)


def test_keras_call_runs_a_call_set_on_the_instance():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    seen = []

    def call(inputs, training=None, mask=None, **kwargs):
        seen.append(training)
        return inputs * 0.0

    tf_patches.replace_call(model, call)
    out = model(np.ones((1, 2), np.float32), training=True)
    assert seen == [True] and float(np.sum(out)) == 0.0
    assert keras.Sequential.call is not call  # the class keeps its own


def test_distributed_table_captures_its_handle_in_the_current_graph():
    from tensorflow.python.distribute import ps_values  # noqa: PLC0415

    table = ps_values.DistributedTable
    upstream = getattr(table, "_towerflow_upstream_resource_handle", table.resource_handle.fget)
    source = inspect.getsource(upstream)
    assert "capture_call_time_value" in source and "outer_graph" not in source
    tf_patches.tables_reach_workers_from_loops()
    assert "outer_graph" in inspect.getsource(table.resource_handle.fget)
    tf_patches.tables_reach_workers_from_loops()  # once only
    assert table._towerflow_upstream_resource_handle is upstream


def test_tf_start_bindings_are_c_functions_and_the_patch_puts_them_back():
    from tensorflow.python import pywrap_tfe  # noqa: PLC0415
    from tensorflow.python.eager import context  # noqa: PLC0415

    originals = {name: getattr(pywrap_tfe, name) for name in tf_patches.BLOCKING}
    for name, original in originals.items():
        assert inspect.isbuiltin(original), name  # a binding: holds the interpreter lock
    library = ctypes.CDLL(tf_patches._library("libtensorflow_cc.so.2")._name)
    for name in tf_patches.BLOCKING:
        assert getattr(library, name)  # the C function the patch calls instead
    calls = []
    with tf_patches.start_calls_unlocked(lambda name, run: calls.append(name)):
        for name in tf_patches.BLOCKING:
            assert getattr(pywrap_tfe, name) is not originals[name]
        eager = context.context()
        eager.ensure_initialized()
        pywrap_tfe.TFE_EnableCollectiveOps(eager._handle, b"")  # `run` not called here
    assert calls == ["TFE_EnableCollectiveOps"]
    assert {name: getattr(pywrap_tfe, name) for name in tf_patches.BLOCKING} == originals


def test_tensorflow_reads_grpc_options_from_its_variable_and_the_patch_keeps_a_users_own(
    monkeypatch,
):
    import mmap  # noqa: PLC0415

    path = tf_patches._library("libtensorflow_cc.so.2")._name
    with open(path, "rb") as library, mmap.mmap(library.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for name in (tf_patches.GRPC_OPTIONS, tf_patches.GRPC_FIRST_RETRY.split("=")[0]):
            assert m.find(name.encode() + b"\0") >= 0, f"{name} is gone from {path}"
    monkeypatch.delenv(tf_patches.GRPC_OPTIONS, raising=False)
    with tf_patches.grpc_reconnects_quickly():
        assert os.environ[tf_patches.GRPC_OPTIONS] == tf_patches.GRPC_FIRST_RETRY
    assert tf_patches.GRPC_OPTIONS not in os.environ, "as it was after the block"
    monkeypatch.setenv(tf_patches.GRPC_OPTIONS, "grpc.keepalive_time_ms=9000")
    with tf_patches.grpc_reconnects_quickly():
        expected = f"grpc.keepalive_time_ms=9000,{tf_patches.GRPC_FIRST_RETRY}"
        assert os.environ[tf_patches.GRPC_OPTIONS] == expected
    assert os.environ[tf_patches.GRPC_OPTIONS] == "grpc.keepalive_time_ms=9000"
    mine = "grpc.initial_reconnect_backoff_ms=700"
    monkeypatch.setenv(tf_patches.GRPC_OPTIONS, mine)
    with tf_patches.grpc_reconnects_quickly():
        assert os.environ[tf_patches.GRPC_OPTIONS] == mine


def test_a_preemption_handler_joins_its_threads_on_del_until_disarmed():
    from tensorflow.python.distribute.failure_handling import failure_handling  # noqa: PLC0415

    handler = object.__new__(tf.distribute.experimental.PreemptionCheckpointHandler)
    thread, stop = mock.Mock(), threading.Event()
    handler._poll_termination_signal_thread_should_stop = stop
    handler._poll_termination_signal_thread = thread
    handler._cluster_wise_termination_watcher_thread = None
    handler.__del__()
    thread.join.assert_called_once()  # upstream: `__del__` waits for its threads
    handler._poll_termination_signal_thread = thread
    handler._cluster_wise_termination_watcher_thread = mock.Mock()
    stop.clear()
    tf_patches.disarm_preemption_handler(handler)
    assert stop.is_set()
    with mock.patch.object(failure_handling.context, "context") as eager:
        handler.__del__()
    eager.assert_not_called()  # no RPC to the leader
    thread.join.assert_called_once()  # and no second join


def test_an_async_checkpoint_keeps_its_write_error_in_a_private_field(tmp_path):
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    checkpoint.save(str(tmp_path / "ckpt"), options=tf.train.CheckpointOptions(enable_async=True))
    checkpoint.sync()
    helper = checkpoint._async_checkpointer_impl
    assert helper._async_error is None  # the field upstream keeps the error in
    assert tf_patches.take_async_checkpoint_error(checkpoint) is None
    helper._async_error = OSError("disk full")
    assert str(tf_patches.take_async_checkpoint_error(checkpoint)) == "disk full"
    assert helper._async_error is None, "cleared: TF does not raise it again at exit"


def test_op_determinism_goes_back_off_which_tensorflow_alone_cannot_do():
    assert not hasattr(tf.config.experimental, "disable_op_determinism")  # upstream: on only
    try:
        tf_patches.op_determinism(True)
        with pytest.raises(tf.errors.FailedPreconditionError, match="determinism"):
            tf.timestamp()  # TF refuses clocks then (as the input-wait timing found)
    finally:
        tf_patches.op_determinism(False)
    assert float(tf.timestamp()) > 0


def test_keras_names_the_optimizer_as_the_caller_of_its_variables_scope():
    seen = []

    def creator(next_creator, **kwargs):
        seen.append((kwargs.get("name"), tf_patches.made_by_keras_optimizer()))
        return next_creator(**kwargs)

    layer = keras.layers.BatchNormalization()
    with tf.variable_creator_scope(creator):
        layer.build((None, 2))
        keras.optimizers.SGD(momentum=0.9).build(layer.trainable_variables)
    made = dict(seen)
    assert not made["moving_mean"] and not made["gamma"]
    assert made["iteration"] and any(made[n] for n in made if "momentum" in n), seen


def test_a_gather_of_a_mirrored_variable_reads_it_whole_and_its_replica_copy_only_the_rows():
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        table = tf.Variable(np.arange(20, dtype=np.float32).reshape(10, 2))
    copy = strategy.experimental_local_results(table)[0]
    assert tf_patches.replica_copy(copy) is copy  # not distributed: as is

    def kernels(read) -> tuple[set[str], list]:
        @tf.function
        def lookup():
            def replica():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(read())
                return tape.gradient(loss, table)

            return strategy.run(replica)

        grads = strategy.experimental_local_results(lookup())
        return {op.type for op in lookup.get_concrete_function().graph.get_operations()}, grads

    upstream, _ = kernels(lambda: tf.nn.embedding_lookup(table, [1, 2]))
    assert {"ReadVariableOp", "GatherV2"} <= upstream and "ResourceGather" not in upstream
    ours, grads = kernels(lambda: tf.nn.embedding_lookup(tf_patches.replica_copy(table), [1, 2]))
    assert "ResourceGather" in ours and "GatherV2" not in ours
    for grad in grads:  # the tape sees the read as one of the distributed variable
        assert isinstance(grad, tf.IndexedSlices) and grad.indices.numpy().tolist() == [1, 2]


def test_autograph_rewraps_an_error_raised_in_a_traced_function_unless_marked():
    class OneLine(ValueError):
        pass

    def fails(marked: bool):
        @tf.function
        def traced():
            error = OneLine("one line")
            raise tf_patches.raised_through_autograph(error) if marked else error

        return traced

    with pytest.raises(Exception) as unmarked:  # upstream: a StagingError, several lines
        fails(False)()
    assert type(unmarked.value) is not OneLine and "\n" in str(unmarked.value)
    with pytest.raises(OneLine) as marked:
        fails(True)()
    assert str(marked.value) == "one line"


class _Base:
    def value(self, x):
        return x + 1


class _Traced(_Base):
    def value(self, x):
        return super().value(x)  # traced, AutoGraph calls it through `py_builtins`


class _Held:
    """Something the tracing caller holds (as a run holds its input iterator)."""


def _trace_super_while_holding() -> weakref.ref:
    held = _Held()
    tf.function(lambda x: _Traced().value(x)).get_concrete_function(tf.constant(1.0))
    return weakref.ref(held)


def test_autograph_super_keeps_the_tracing_frames_until_a_collection_unless_patched():
    gc.disable()
    try:
        with mock.patch.object(
            py_builtins, "_find_originating_frame", tf_patches._AUTOGRAPH_ORIGINATING_FRAME
        ):
            held = _trace_super_while_holding()
            assert held() is not None  # a cycle of frames holds the caller's locals
            gc.collect()
            assert held() is None
            tf_patches.super_leaves_no_frames()
            held = _trace_super_while_holding()
            assert held() is None  # freed as the call returned, no collection needed
    finally:
        gc.enable()


def test_a_multi_device_iterators_device_datasets_autotune_by_default_unless_patched():
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    def device_dataset_autotune():
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        untuned = tf.data.Options()
        untuned.autotune.enabled = False  # the source pipeline, as towerflow's run
        made = []
        create = ops._create_device_dataset

        def recorded(*args, **kwargs):
            made.append(create(*args, **kwargs))
            return made[-1]

        source = tf.data.Dataset.range(8).batch(2).with_options(untuned)
        with mock.patch.object(ops, "_create_device_dataset", recorded):
            iter(strategy.experimental_distribute_dataset(source))
        return {dataset.options().autotune.enabled for dataset in made}

    # Upstream: a new pipeline per device, with TensorFlow's default options (autotuning).
    upstream = tf_patches._UPSTREAM_DEVICE_DATASET  # as imported: another test may have patched
    with mock.patch.object(ops, "_create_device_dataset", upstream):
        assert device_dataset_autotune() == {None}
        tf_patches.device_datasets_untuned()
        tf_patches.device_datasets_untuned()  # once only
        assert ops._create_device_dataset.__wrapped__ is upstream
        assert device_dataset_autotune() == {False}


def test_a_saved_model_is_written_without_its_variables_only_through_a_private_flag(tmp_path):
    # Upstream: no public option leaves the variables' checkpoint out.
    assert "skip_checkpoint" not in str(inspect.signature(tf.saved_model.SaveOptions))
    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])
    module.read = tf.function(lambda: module.v * 1.0, input_signature=[])
    signatures = {"serving_default": module.read.get_concrete_function()}
    path = tmp_path / "model"
    tf.train.Checkpoint(root=module).write(str(path / "variables" / "variables"))
    tf_patches.saved_model_without_variables(module, str(path), signatures)
    assert (path / "saved_model.pb").exists()
    loaded = tf.saved_model.load(str(path))  # the variables as the caller wrote them
    np.testing.assert_array_equal(loaded.v.numpy(), [1.0, 2.0])
    # The private flag does leave them out: nothing else writes them there.
    bare = tmp_path / "bare"
    tf_patches.saved_model_without_variables(module, str(bare), signatures)
    assert (bare / "saved_model.pb").exists()
    assert not (bare / "variables" / "variables.index").exists()


def test_autograph_leaves_its_generated_modules_in_the_temp_directory_unless_patched(tmp_path):
    from tensorflow.python.autograph.pyct import loader  # noqa: PLC0415

    upstream = getattr(loader.load_source, "__wrapped__", loader.load_source)
    source = "def f(x):\n    return x + 1\n"
    with mock.patch.object(tempfile, "tempdir", str(tmp_path)):
        with mock.patch.object(loader, "load_source", upstream):
            _, kept = upstream(source, True)  # upstream: removed only by an atexit hook
            assert os.path.dirname(kept) == str(tmp_path) and os.path.exists(kept)
            assert os.path.basename(kept).startswith("__autograph_generated_file")
            os.remove(kept)
            tf_patches.autograph_leaves_no_files()
            tf_patches.autograph_leaves_no_files()  # once only
            assert loader.load_source.__wrapped__ is upstream
            module, gone = loader.load_source(source, True)
    assert not os.path.exists(gone) and module.f(1) == 2
    assert inspect.getsource(module.f) == source  # from linecache, the file gone
    assert list(tmp_path.iterdir()) == []


def _module_with_a_tensor_if(name: str, folder):
    """A module `name`, from a file (AutoGraph reads the source), whose `sign` needs AutoGraph."""
    path = folder / f"{name.replace('.', '_')}.py"
    path.write_text("def sign(x):\n    if x > 0:\n        return x\n    return -x\n")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_autograph_converts_a_called_function_unless_a_rule_names_its_module(tmp_path):
    from tensorflow.python.autograph.core import config, config_lib

    module = _module_with_a_tensor_if("towerflow_canary.signs", tmp_path)
    traced = tf.function(lambda x: module.sign(x))
    with mock.patch.dict(sys.modules, {module.__name__: module}):
        assert float(traced(tf.constant(-2.0))) == 2.0  # converted: the `if` became a cond
        rules = (config_lib.DoNotConvert("towerflow_canary"), *config.CONVERSION_RULES)
        with mock.patch.object(config, "CONVERSION_RULES", rules):
            with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
                tf.function(lambda x: module.sign(x))(tf.constant(-2.0))  # left as it is


def test_own_code_is_left_unconverted_but_for_the_modules_looping_over_tensors(tmp_path):
    from tensorflow.python.autograph.core import config

    ours = (*tf_patches.OWN_PACKAGES, *tf_patches.CONVERTED_MODULES)
    upstream = tuple(r for r in config.CONVERSION_RULES if not any(r.matches(n) for n in ours))
    with mock.patch.object(config, "CONVERSION_RULES", upstream):  # as if a run had not patched it
        tf_patches.own_code_unconverted()
        tf_patches.own_code_unconverted()  # once only
        rules = config.CONVERSION_RULES
        own = _module_with_a_tensor_if("trainer.loop.canary", tmp_path)
        looping = _module_with_a_tensor_if("strategies.base_canary", tmp_path)
        looping_too = _module_with_a_tensor_if("strategies.base.canary", tmp_path)
        user = _module_with_a_tensor_if("my_pkg.tasks", tmp_path)
        modules = {m.__name__: m for m in (own, looping, looping_too, user)}
        with mock.patch.dict(sys.modules, modules):
            with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
                tf.function(lambda x: own.sign(x))(tf.constant(-2.0))
            with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
                tf.function(lambda x: looping.sign(x))(tf.constant(-2.0))  # a name's prefix
            assert float(tf.function(lambda x: looping_too.sign(x))(tf.constant(-2.0))) == 2.0
            assert float(tf.function(lambda x: user.sign(x))(tf.constant(-2.0))) == 2.0
    assert len(rules) == len(upstream) + 5
