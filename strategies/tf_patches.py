"""Every change towerflow makes to TensorFlow's or Keras's own objects, in one place.

Its sibling `strategies.tf_private` holds the private reads and hooks of the
loop and layers (Keras's optimizer internals, TF's composite values); both are
the only modules that reach TensorFlow's or Keras's private names
(`tests/test_private_apis.py`).

Each patch below works around one upstream behaviour, names it, and targets
the versions in its `Patch` (`PATCHES`). A patch applies only where what it
replaces is still there; on a version it does not target it applies the same
and logs one warning, so an upgrade is checked (`tests/test_tf_patches.py`
asserts each upstream behaviour still holds, and fails when upstream changes
it).

- `keras_variables_save_asynchronously`: Keras 3 variables copied to the host
  more than once by TF's asynchronous checkpoint (process-wide).
- `count_steps_atomically`: an optimizer's step counter counts with an
  atomic add (one live counter's `assign_add`; `parameter_server` only, whose
  asynchronous workers step at once).
- `sum_gradients_in_caller`: Keras's cross-replica sum of the gradients
  turned off while the train step has summed them itself (towerflow's own
  optimizer classes override the private method; `trainer.loop.optim`).
- `move_variable`: the TF variable behind a Keras variable replaced, as
  Keras's own `keras.Variable(tf_variable)` wraps one (`pipeline`'s stages).
- `tables_reach_workers_from_loops`: a `DistributedTable` captured in the
  outermost function graph (process-wide, `parameter_server`).
- `swap_class`: a documented subclass swap (`layer.__class__`) of a layer
  built by the user's model (`parameter_server`'s BatchNorm).
- `replace_call`: one live model's `call` (`pipeline`'s stages).
- `start_calls_unlocked`: TF's cluster start-up bindings (`pywrap_tfe`) run
  through `ctypes`, without the interpreter lock (`strategies.cluster.tf_start`).
- `take_async_checkpoint_error`: the error of a failed background checkpoint
  write, taken from TF's private field and cleared (`trainer.loop.checkpoints`).
- `saved_model_without_variables`: a SavedModel written without its variables'
  checkpoint (TF's private flag), which the caller writes through one traced
  write (`trainer.loop.export`, where the variables live on ps members).
- `made_by_keras_optimizer`: whether Keras is creating a variable for an
  optimizer (read from Keras's private name-scope stack; `mirrored`'s
  averaged layer state must leave optimizer state alone).
- `op_determinism`: op determinism set to a run's own setting, off included
  (process-wide; TensorFlow's public API can only turn it on).
- `replica_copy`: this replica's own copy of a distributed variable, which
  can be read row by row (`tf.gather` of a `mirrored` variable reads it whole;
  `trainer.layers`' tables, `trainer.loop.optim`'s sparse updates).
- `super_leaves_no_frames`: AutoGraph's `super()` in a traced function finds
  its class without leaving the caller's frames in a reference cycle
  (process-wide; every frame of the stack that traced it, a run's input
  iterators with them, lived until a garbage collection, whose end of an
  iterator then waited minutes for tf.data's threads).
- `device_datasets_untuned`: the per-device datasets of a `MultiDeviceIterator`
  (`mirrored`, `multi_worker`) run without tf.data's autotuning model, as
  towerflow's own pipelines do (`data.autotune`): they are new pipelines
  that inherit no options, with nothing to tune (a generator and a fixed
  prefetch), whose model thread made each iterator's end wait up to a minute
  (process-wide).
- `raised_through_autograph`: an error raised while a `tf.function` is traced
  reaches the caller as it is, one line (AutoGraph would wrap it in a
  `StagingError` of several lines; `trainer.layers`' row-aware refusal).
- private reads, no change: `flat_layers` (every layer of a model, nested
  ones included), `layers_after` (the layers that take a layer's outputs in a
  functional model: a warm start's `Hashing` salt check),
  `cross_device_ops_name` (what `MirroredStrategy` picked), `worker_count`
  (the workers `MultiWorkerMirroredStrategy` resolved), `ps_count` (the ps
  members of a bare `ParameterServerStrategy`, whose dynamic tables get a
  part on each: `strategies.sharding.current`), `lock_handle` (the resource
  handle of a `tf.CriticalSection`: where a dynamic table's lock lives).
- `autograph_leaves_no_files`: the module AutoGraph writes for each function it
  converts is removed once loaded, its source kept for tracebacks (process-wide;
  upstream removes them only at a normal exit, so every member that ends
  through `os._exit`, lost or forked, left them in the temp directory).
- `own_code_unconverted`: AutoGraph leaves towerflow's own functions as they
  are, but for the modules whose loops run over tensors (process-wide; they
  are written in TensorFlow ops, and converting them again in every process
  cost about 3 s of a run's start-up).
- `disarm_preemption_handler`: a live `PreemptionCheckpointHandler`'s watcher
  threads forgotten, so its `__del__` waits on nothing (`strategies.cluster.preemption`).
- `grpc_reconnects_quickly`: gRPC tries a cluster peer that refused a connection
  again after 50 ms, not a second (TensorFlow's `TF_GRPC_DEFAULT_OPTIONS`, set
  while a member joins its cluster, which TensorFlow reads once per process;
  `strategies.cluster.tf_start`, and a serving member).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import linecache
import logging
import os
import sys
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.operators import py_builtins
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.framework import errors


@dataclasses.dataclass(frozen=True)
class Patch:
    """One workaround: the library it changes, the versions it targets, the upstream behaviour."""

    library: str  # "tensorflow" | "keras"
    versions: tuple[str, ...]  # version prefixes it was written and tested for
    upstream: str  # the behaviour it works around


PATCHES = {
    "keras_variables_save_asynchronously": Patch(
        "keras",
        ("3.15",),
        "keras.Variable._copy_trackable_to_cpu makes a new tf.Variable on every call",
    ),
    "count_steps_atomically": Patch(
        "keras", ("3.15",), "keras.Variable.assign_add reads the value, then assigns the sum"
    ),
    "tables_reach_workers_from_loops": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "DistributedTable.resource_handle captures its call-time value in the current graph",
    ),
    "sum_gradients_in_caller": Patch(
        "keras",
        ("3.15",),
        "the TF optimizer's apply sums the gradients over replicas in "
        "_all_reduce_sum_gradients, with no public switch",
    ),
    "move_variable": Patch(
        "keras", ("3.15",), "keras.Variable wraps a TF variable given to _initialize"
    ),
    "flat_layers": Patch(
        "keras", ("3.15",), "Layer._flatten_layers lists nested layers; no public equivalent"
    ),
    "layers_after": Patch(
        "keras",
        ("3.15",),
        "a functional model's layer keeps the nodes that take its outputs in _outbound_nodes; "
        "no public equivalent",
    ),
    "cross_device_ops_name": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "MirroredStrategy keeps the cross-device ops it picked in extended._cross_device_ops",
    ),
    "own_collective_keys": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "every MirroredStrategy starts its collective group keys at 1 + the class's "
        "_collective_key_base (0, never raised): a second one in a process meets the first's "
        'cached collectives ("Collective instance 100 expected type 2 ...")',
    ),
    "worker_count": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "MultiWorkerMirroredStrategy keeps its resolved worker count in extended._num_workers",
    ),
    "ps_count": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "ParameterServerStrategy keeps its ps count in extended._num_ps, and its public "
        "cluster_resolver is None",
    ),
    "lock_handle": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "tf.CriticalSection keeps its mutex resource in _handle; no public handle or device",
    ),
    "swap_class": Patch(
        "keras",
        ("3.15",),
        "BatchNormalization assigns momentum * read + (1 - momentum) * batch (not atomic)",
    ),
    "replace_call": Patch(
        "keras", ("3.15",), "Layer.__call__ runs self.call, an instance attribute first"
    ),
    "take_async_checkpoint_error": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "an async checkpoint's write error is kept in a private field and raised at exit",
    ),
    "saved_model_without_variables": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "tf.saved_model.save writes the variables' checkpoint eagerly (a new traced function "
        "each call where they live on several members); only the private "
        "save_and_return_nodes can leave it out",
    ),
    "disarm_preemption_handler": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "PreemptionCheckpointHandler.__del__ joins its watcher threads (no public close)",
    ),
    "made_by_keras_optimizer": Patch(
        "keras",
        ("3.15",),
        "an optimizer creates its variables inside name_scope(caller=optimizer), kept in "
        "global_state's name_scope_stack",
    ),
    "op_determinism": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "tf.config.experimental has enable_op_determinism and no way to turn it off",
    ),
    "replica_copy": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "a DistributedVariable has no sparse_read, so tf.gather and tf.nn.embedding_lookup "
        "read it whole (ReadVariableOp, a full copy once the variable was updated row by row)",
    ),
    "start_calls_unlocked": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "pywrap_tfe's cluster start-up bindings hold the interpreter lock until they return",
    ),
    "super_leaves_no_frames": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "AutoGraph's super() finds its frame from inspect.currentframe(), whose f_locals "
        "keeps that frame: a cycle holding every frame of the stack that traced it",
    ),
    "device_datasets_untuned": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "MultiDeviceIterator's per-device datasets (_create_device_dataset) are new "
        "pipelines with TF's default options: each runs an autotuning thread, which can "
        "miss its cancellation and sleep out its period (up to 60 s) when deleted",
    ),
    "autograph_leaves_no_files": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "AutoGraph's loader.load_source writes each converted function to a "
        "__autograph_generated_file*.py in the temp directory, removed only by an atexit hook",
    ),
    "raised_through_autograph": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "AutoGraph rewraps an error raised in converted code unless it has `ag_pass_through`",
    ),
    "grpc_reconnects_quickly": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "TensorFlow's gRPC channels take their arguments from the TF_GRPC_DEFAULT_OPTIONS "
        "variable and set only the longest reconnect backoff (1 s), so a peer not yet "
        "listening is tried again after gRPC's initial backoff, 1 s",
    ),
    "own_code_unconverted": Patch(
        "tensorflow",
        ("2.20", "2.21"),
        "AutoGraph converts every function a converted one calls, unless its module matches "
        "a rule of its private config.CONVERSION_RULES (first match wins)",
    ),
}
_VERSIONS = {"tensorflow": tf.__version__, "keras": keras.__version__}
_warned: set[str] = set()


def targeted(name: str, registry: dict[str, Patch] | None = None) -> bool:
    """Whether the installed library is a version entry `name` targets (else one warning).

    `registry`: where `name` is registered, `PATCHES` unless given
    (`strategies.tf_private.ACCESSES`).
    """
    patch = (PATCHES if registry is None else registry)[name]
    version = _VERSIONS[patch.library]
    if version.startswith(patch.versions):
        return True
    if name not in _warned:
        _warned.add(name)
        logging.warning(
            "towerflow's patch %s targets %s %s, found %s: check that upstream still %s.",
            name,
            patch.library,
            " / ".join(patch.versions),
            version,
            patch.upstream,
        )
    return False


# TensorFlow (process-wide) ----------------------------------------------------------------


def saved_model_without_variables(obj: tf.Module, path: str, signatures: dict) -> None:
    """`tf.saved_model.save(obj, path, signatures)`, all but `path/variables/variables`.

    The caller has written the variables there (a checkpoint of an object
    whose children are `obj`'s, under the same names), so that the
    SavedModel's fingerprint covers them.
    """
    from tensorflow.python.saved_model import save  # noqa: PLC0415

    targeted("saved_model_without_variables")
    save.save_and_return_nodes(obj, path, signatures, experimental_skip_checkpoint=True)


def op_determinism(enabled: bool) -> None:
    """Op determinism on or off for what this process runs next, as one run's config says.

    A run with `train.deterministic` turns it on for the whole process, and
    TensorFlow offers no public way back; a later run in the same process
    (`trainer.check`, a test, a notebook) without it would inherit the
    refusals (unseeded random ops, clocks in the step).
    """
    from tensorflow.python.framework import config  # noqa: PLC0415

    if enabled:
        tf.config.experimental.enable_op_determinism()
    elif config.is_op_determinism_enabled():
        targeted("op_determinism")
        config.disable_op_determinism()


def cross_device_ops_name(strategy: tf.distribute.MirroredStrategy) -> str:
    """The class name of the cross-device ops `strategy` uses (what TF picked for "auto")."""
    targeted("cross_device_ops_name")
    return type(strategy.extended._cross_device_ops).__name__


def own_collective_keys() -> None:
    """The next `tf.distribute.MirroredStrategy` made in this process gets group keys of its own.

    Without it, two in one process (a notebook, runs in one interpreter, a test
    session) share their group and instance keys, and a collective of the second
    aborts on the first's of another type or dtype.
    """
    targeted("own_collective_keys")
    tf.distribute.MirroredStrategy._collective_key_base += _COLLECTIVE_KEYS_PER_STRATEGY


_COLLECTIVE_KEYS_PER_STRATEGY = 10_000  # group keys: one per device set a strategy reduces over


def worker_count(strategy: tf.distribute.MultiWorkerMirroredStrategy) -> int:
    """How many worker processes `strategy` resolved from its cluster."""
    targeted("worker_count")
    return int(strategy.extended._num_workers)


def ps_count(strategy: tf.distribute.experimental.ParameterServerStrategy) -> int:
    """How many ps members `strategy` connected to (no public name: see `PATCHES`)."""
    targeted("ps_count")
    return int(strategy.extended._num_ps)


def replica_copy(variable):
    """The copy of distributed `variable` that this replica (or update) reads; others as given.

    A distributed variable (`mirrored`, `multi_worker`) is no resource variable
    to `tf.gather` and `tf.nn.embedding_lookup`: they read the whole copy and
    gather from that. Once the copy has been updated row by row, TensorFlow
    copies the whole buffer on each such read: a 200,000-row table under
    `mirrored` paid a full copy per replica each step. The copy itself reads
    only the rows asked for (`ResourceGather`), and a `tf.GradientTape` sees the
    read as one of the distributed variable, whose handle in a replica is the
    copy's.
    """
    if not isinstance(variable, tf.distribute.DistributedValues):
        return variable
    targeted("replica_copy")
    return variable._get_on_device_or_primary()


def raised_through_autograph(error: Exception) -> Exception:
    """`error`, marked so that AutoGraph lets it through a traced function unchanged.

    AutoGraph replaces an error raised in the code it converts (a user's
    `tf.function` train step, and what it calls) with a `StagingError` whose
    message adds the traced lines; an error it finds marked `ag_pass_through`
    it leaves alone. For a one-line `UserError` raised while a step is traced.
    """
    targeted("raised_through_autograph")
    error.ag_pass_through = True
    return error


# Keras ----------------------------------------------------------------------------------


def made_by_keras_optimizer() -> bool:
    """Whether the variable being created belongs to a Keras optimizer (a slot, a loss scale).

    Keras creates an optimizer's variables inside `name_scope(..., caller=optimizer)`
    and keeps the open scopes in its private global state; there is no public
    way to ask which object a variable is being made for.
    """
    from keras.src.backend.common import global_state  # noqa: PLC0415

    targeted("made_by_keras_optimizer")
    stack = global_state.get_global_attribute("name_scope_stack", default=None) or []
    return any(isinstance(scope.caller, keras.optimizers.Optimizer) for scope in stack)


# Keras (process-wide) -------------------------------------------------------------------

_KERAS_COPY_TO_CPU = getattr(keras.Variable, "_copy_trackable_to_cpu", None)  # upstream's


def keras_variables_save_asynchronously() -> None:
    """Lets TF's asynchronous saver copy Keras variables more than once.

    Keras 3's `Variable._copy_trackable_to_cpu` makes a new `tf.Variable` each
    time, and TF calls it inside a `tf.function`, where only the first trace may
    create variables: the second asynchronous save fails. TF already keeps a
    host copy of the wrapped `tf.Variable` up to date, and the Keras variable
    saves exactly that value, so it can share that copy.

    Process-wide and never undone, by design: TF's saver calls it on any
    later save, from its own thread, for any Keras variable; the copy it
    gives is the value upstream's would hold, so nothing else sees a change.
    """
    if _KERAS_COPY_TO_CPU is None:
        return  # upstream no longer copies Keras variables itself
    targeted("keras_variables_save_asynchronously")

    def copy_to_cpu(variable, object_map):
        variable.value._copy_trackable_to_cpu(object_map)
        object_map[variable] = object_map[variable.value]

    keras.Variable._copy_trackable_to_cpu = copy_to_cpu


# Live objects -----------------------------------------------------------------------------


def count_steps_atomically(counter: keras.Variable) -> None:
    """Makes an optimizer's step counter (`optimizer.iterations`) count every step.

    Keras adds to its step counter by reading the value and assigning the sum;
    asynchronous parameter-server workers, stepping at once, then lose counts,
    so the job runs past `train.steps` and its schedule lags. The TF
    variable's own `assign_add` is atomic. Only this counter changes, once,
    and only `parameter_server` asks: elsewhere one process steps at a time.
    """
    if "assign_add" in vars(counter):
        return
    targeted("count_steps_atomically")
    counter.assign_add = lambda value: counter.value.assign_add(tf.cast(value, counter.dtype))


def move_variable(variable: keras.Variable, new: tf.Variable) -> None:
    """Keras `variable` wraps TF variable `new` from now on (the same Keras object).

    Keras wraps an existing TF variable through `_initialize` (its
    `keras.Variable(tf_variable)` path); there is no public way to give a
    built variable another one.

    Raises:
      RuntimeError: this Keras wraps TF variables differently.
    """
    targeted("move_variable")
    variable._initialize(new)
    if variable.value is not new:
        raise RuntimeError(
            f"Could not give variable `{variable.path}` a new TF variable: this Keras "
            "version wraps TF variables differently."
        )


def flat_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside `model`, nested ones included, each once (Keras's own walk)."""
    targeted("flat_layers")
    return list(model._flatten_layers(include_self=False))


def layers_after(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers that take `layer`'s outputs in a functional model's graph (none elsewhere)."""
    targeted("layers_after")
    return [node.operation for node in getattr(layer, "_outbound_nodes", [])]


def lock_handle(lock: tf.CriticalSection) -> tf.Tensor:
    """The resource handle of `lock`, whose `device` says where the lock lives."""
    targeted("lock_handle")
    return lock._handle


def swap_class(layer: keras.layers.Layer, new: type) -> None:
    """`layer`, built by the user's model, becomes an instance of `new`, a subclass of its class.

    A documented subclass swap: `new` has the same variables and config and
    differs only in `call`, so a model towerflow does not build runs it.

    Raises:
      TypeError: `new` is not a subclass of the layer's class.
    """
    targeted("swap_class")
    if not issubclass(new, type(layer)):
        raise TypeError(f"{new.__name__} is not a subclass of {type(layer).__name__}.")
    layer.__class__ = new


def replace_call(model, call: Callable) -> None:
    """`model.call` becomes `call` for this one model (not its class).

    Keras's `__call__` runs `self.call`, so the usual `training` and mask
    handling wraps the new one.
    """
    targeted("replace_call")
    object.__setattr__(model, "call", call)


# TensorFlow distribution (process-wide) ---------------------------------------------------


def tables_reach_workers_from_loops() -> None:
    """A vocabulary table (`StringLookup`, ...) used inside a loop reaches each worker's copy.

    Created under the strategy's scope, a lookup table is a `DistributedTable`:
    a copy on every worker, whose handle a scheduled function receives at call
    time (`capture_call_time_value`). TensorFlow captures it in the graph
    where the lookup is traced; inside the body of the loop of steps that is a
    nested graph, whose call-time captures nobody feeds ("You must feed a value
    for placeholder tensor ... Lookup/Placeholder"). Here the handle is captured
    once in the outermost function graph, which the call feeds, and the nested
    graph captures that tensor as any other.

    Process-wide and never undone, by design: a function is traced again
    at any later call (a new shape, a restored run), and outside nested
    graphs the property is upstream's own (the same handle as before).
    """
    from tensorflow.python.distribute import ps_values  # noqa: PLC0415
    from tensorflow.python.framework import func_graph  # noqa: PLC0415

    table = ps_values.DistributedTable
    if getattr(table, "_towerflow_outermost_capture", False):
        return
    targeted("tables_reach_workers_from_loops")
    per_graph = table.resource_handle.fget

    def resource_handle(self):
        graph = tf.compat.v1.get_default_graph()
        outermost = graph
        while isinstance(getattr(outermost, "outer_graph", None), func_graph.FuncGraph):
            outermost = outermost.outer_graph
        if outermost is graph or tf.executing_eagerly():
            return per_graph(self)
        with outermost.as_default():
            self._maybe_build_distributed_table()
            closure, spec = self.resource_handle_call_time_value()
            return outermost.capture_call_time_value(
                closure,
                spec,
                key=("towerflow-table", id(self)),
                default_value=self._coordinator_instance.resource_handle,
            )

    table._towerflow_upstream_resource_handle = per_graph
    table.resource_handle = property(resource_handle)
    table._towerflow_outermost_capture = True


def super_leaves_no_frames() -> None:
    """AutoGraph's `super()` leaves no frame of its caller's stack behind.

    Converted code calls `super()` through `py_builtins`, which walks the
    stack from `inspect.currentframe()` reading each frame's `f_locals`: its
    own frame's locals then hold that frame, a cycle through `f_back` that
    keeps every frame of the stack alive, and their locals (a run's step,
    its input iterators), until Python's next full garbage collection. An
    input iterator ended there may wait minutes for tf.data's threads
    (TensorFlow 2.21 on 2 cores), stalling whatever runs at that moment.
    Here the walk starts at the caller's frame and keeps no frame.

    Process-wide and never undone, by design: it finds the same frame as
    upstream's for any traced `super()` (towerflow's optimizers call it from
    their update steps, users' code may too), only without the cycle.
    """
    upstream = getattr(py_builtins, "_find_originating_frame", None)
    if upstream is None or upstream is _originating_frame:
        return  # upstream finds super()'s frame another way now, or it is patched already
    targeted("super_leaves_no_frames")
    py_builtins._find_originating_frame = _originating_frame


def autograph_leaves_no_files() -> None:
    """AutoGraph's generated modules leave no file in the temp directory.

    AutoGraph writes each function it converts to a file and imports it; it
    removes the files from an `atexit` hook, which a process ending through
    `os._exit` (a lost member, a forked member, the watchdog) never runs: a
    fault scenario's runs left dozens in `/tmp`. Here each file is removed as
    soon as its module is loaded, and its source stays in `linecache`
    (tracebacks, `pdb` and `inspect` read it there). Process-wide and never
    undone: the modules work the same without their files.
    """
    from tensorflow.python.autograph.pyct import loader  # noqa: PLC0415

    upstream = getattr(loader, "load_source", None)
    if upstream is None or getattr(upstream, "_towerflow_no_files", False):
        return  # upstream loads converted code another way now, or it is patched already
    targeted("autograph_leaves_no_files")

    def load_source(source: str, delete_on_exit: bool):
        module, file_name = upstream(source, delete_on_exit)
        if delete_on_exit:  # upstream's own word for a file nobody needs after the process
            # No modification time: `linecache.checkcache` keeps the entry without the file.
            linecache.cache[file_name] = (len(source), None, source.splitlines(True), file_name)
            with contextlib.suppress(FileNotFoundError):
                os.remove(file_name)
        return module, file_name

    load_source._towerflow_no_files = True
    load_source.__wrapped__ = upstream
    loader.load_source = load_source


# towerflow's own packages, whose functions AutoGraph leaves as they are (`own_code_unconverted`),
# and, within them, the modules it still converts: their loops run over tensors.
OWN_PACKAGES = ("trainer", "strategies", "towerflow")
CONVERTED_MODULES = ("strategies.base", "strategies.parameter_server")


def own_code_unconverted() -> None:
    """AutoGraph leaves towerflow's own functions unconverted, but for `CONVERTED_MODULES`.

    AutoGraph converts each function that a converted one calls, again in
    every process (about 150 of towerflow's functions in a run's first steps,
    3 s of CPU, a third of a small run's start-up). towerflow's functions are
    written in TensorFlow's ops, Python's `if` and `for` only over what is
    known while tracing; only the loops of `CONVERTED_MODULES` iterate over
    tensors. A user's function stays converted as before: a model's code is
    called by Keras (which AutoGraph leaves alone, as it did), and a user's own
    `train_step` is converted where towerflow calls it (`trainer.loop.steps`).
    Process-wide and never undone; a rule already there is not added again.
    """
    from tensorflow.python.autograph.core import config, config_lib  # noqa: PLC0415

    rules = getattr(config, "CONVERSION_RULES", None)
    if not isinstance(rules, tuple) or any(
        isinstance(rule, config_lib.DoNotConvert) and rule.matches(OWN_PACKAGES[0])
        for rule in rules
    ):
        return  # upstream decides another way now, or it is patched already
    targeted("own_code_unconverted")
    own = tuple(config_lib.Convert(name) for name in CONVERTED_MODULES) + tuple(
        config_lib.DoNotConvert(name) for name in OWN_PACKAGES
    )
    config.CONVERSION_RULES = own + rules


_UPSTREAM_DEVICE_DATASET = getattr(multi_device_iterator_ops, "_create_device_dataset", None)


def device_datasets_untuned() -> None:
    """A `MultiDeviceIterator`'s per-device datasets run without tf.data's autotuning model.

    Each device of a `mirrored` (or `multi_worker`) iterator reads through a
    pipeline of its own (a generator from the host buffer, a fixed prefetch)
    that TensorFlow makes with default options, so each runs an autotuning
    thread with nothing to tune. Deleting the iterator cancels those threads,
    and TensorFlow marks them cancelled only after running the callbacks that
    wake them: one that wakes in between sleeps out its period (doubling to
    60 s over the iterator's life) while the deleting thread holds Python's
    lock (docs/troubleshooting.md). Without the model there is no such
    thread. Process-wide and never undone: what it removes tuned nothing.
    """
    original = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if original is None or getattr(original, "_towerflow_untuned", False):
        return  # upstream makes device datasets another way now, or it is patched already
    targeted("device_datasets_untuned")

    def untuned(*args, **kwargs) -> tf.data.Dataset:
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(*args, **kwargs).with_options(options)

    untuned._towerflow_untuned = True
    untuned.__wrapped__ = original
    multi_device_iterator_ops._create_device_dataset = untuned


_AUTOGRAPH_ORIGINATING_FRAME = getattr(py_builtins, "_find_originating_frame", None)  # upstream's


def _originating_frame(caller_fn_scope, innermost: bool = True):
    """The frame of the converted function whose scope is `caller_fn_scope` (upstream's
    search, from the caller's frame on)."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        if frame.f_locals.get(caller_fn_scope.name) is caller_fn_scope:
            found = frame
            if innermost:
                break
        frame = frame.f_back
    if found is None:  # upstream asserts it too
        raise AssertionError("the converted caller of super() is not on the stack")
    return found


def take_async_checkpoint_error(checkpoint: tf.train.Checkpoint) -> Exception | None:
    """The error of the last failed background write, cleared so TF does not raise it again.

    TensorFlow (2.20, 2.21) keeps it in a private field and raises it only from
    an `atexit` hook, as a traceback after the process has reported; no public
    API returns it. Without that field (another version), None: the missing
    index file then tells a failed write apart.
    """
    helper = getattr(checkpoint, "_async_checkpointer_impl", None)
    error = getattr(helper, "_async_error", None)
    if error is not None:
        targeted("take_async_checkpoint_error")
        helper._async_error = None
    return error


GRPC_OPTIONS = "TF_GRPC_DEFAULT_OPTIONS"  # TensorFlow's: "name=value,..." gRPC channel arguments
GRPC_FIRST_RETRY = "grpc.initial_reconnect_backoff_ms=50"


@contextlib.contextmanager
def grpc_reconnects_quickly() -> Iterator[None]:
    """Inside the block, a refused connection to a cluster peer is tried again after 50 ms.

    The members of a cluster start their TensorFlow servers moments apart, so a
    member's first connection to a peer often comes before the peer listens; gRPC
    then waited its initial reconnect backoff, a second, in every cluster's start.
    TensorFlow reads the variable once, at its first gRPC channel: join the
    cluster inside the block (the variable is as it was after it). A user's own
    setting of the backoff in the variable stays.
    """
    targeted("grpc_reconnects_quickly")
    options = os.environ.get(GRPC_OPTIONS)
    name = GRPC_FIRST_RETRY.split("=")[0]
    if options and name in options:
        yield
        return
    os.environ[GRPC_OPTIONS] = ",".join(filter(None, [options, GRPC_FIRST_RETRY]))
    try:
        yield
    finally:
        if options is None:
            os.environ.pop(GRPC_OPTIONS, None)
        else:
            os.environ[GRPC_OPTIONS] = options


def disarm_preemption_handler(handler) -> None:
    """A `PreemptionCheckpointHandler`'s `__del__` will wait on nothing.

    It has no public close; its `__del__` joins its watcher threads, one of
    which waits on the coordination service's leader (an RPC without
    deadline) and never returns when that member is gone. Its local signal
    poller is told to stop, and both threads (daemons, ending with the
    process) are forgotten.
    """
    targeted("disarm_preemption_handler")
    stop = getattr(handler, "_poll_termination_signal_thread_should_stop", None)
    if stop is not None:
        stop.set()  # the local signal poller ends on its own; no peer is involved
    handler._cluster_wise_termination_watcher_thread = None
    handler._poll_termination_signal_thread = None


# Binding name -> the C function's argument types between the context and the status,
# and the values it takes after the status (the binding passes none).
BLOCKING = {
    "TFE_EnableCollectiveOps": ((ctypes.c_char_p, ctypes.c_size_t), ()),
    "TFE_ContextSetServerDef": ((ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ()),
    "TFE_ContextSetServerDefWithTimeoutAndRetries": (
        (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int),
        (False,),  # clear_existing_contexts
    ),
}


@contextlib.contextmanager
def start_calls_unlocked(call: Callable[[str, Callable[[], None]], None]) -> Iterator[None]:
    """Inside the block, TF's cluster start-up bindings (`BLOCKING`) run through `ctypes`.

    `pywrap_tfe`'s bindings hold the interpreter lock until TensorFlow has
    joined the cluster; the same C functions called through `ctypes` release
    it. Each call becomes `call(name, run)`, `run` making the C call (which
    raises TensorFlow's error for a failed status). The bindings are put back
    on leaving.
    """
    targeted("start_calls_unlocked")
    originals = {name: getattr(pywrap_tfe, name) for name in BLOCKING}
    try:
        for name, (types, tail) in BLOCKING.items():
            setattr(pywrap_tfe, name, unlocked(name, types, tail, call))
        yield
    finally:
        for name, original in originals.items():
            setattr(pywrap_tfe, name, original)


def unlocked(name: str, types: tuple, tail: tuple, call: Callable) -> Callable:
    """The binding `name` as a C call through `ctypes` (no interpreter lock held), run by `call`."""
    function = getattr(_library("libtensorflow_cc.so.2"), name)
    function.argtypes = (ctypes.c_void_p, *types, ctypes.c_void_p, *(ctypes.c_bool for _ in tail))
    function.restype = None

    def binding(context, *args):
        pointer = _context_pointer(context)
        args = tuple(_c_args(args))

        def run():
            status = _STATUS.TF_NewStatus()
            try:
                function(pointer, *args, status, *tail)
                code = _STATUS.TF_GetCode(status)
                if code:
                    message = _STATUS.TF_Message(status).decode(errors="replace")
                    raise errors.exception_type_from_error_code(code)(None, None, message)
            finally:
                _STATUS.TF_DeleteStatus(status)

        call(name, run)

    return binding


def _c_args(args) -> Iterator:
    """A binding's arguments after the context, as the C function takes them."""
    for arg in args:
        if isinstance(arg, bytes):  # a serialized `ServerDef`, then its length
            yield arg
            yield len(arg)
        else:
            yield arg


def _context_pointer(context) -> int:
    """The `TFE_Context*` inside the binding's capsule."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.argtypes = (ctypes.py_object, ctypes.c_char_p)
    get.restype = ctypes.c_void_p
    return get(context, None)


def _library(filename: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), filename))


def _status_library() -> ctypes.CDLL:
    library = _library("libtensorflow_framework.so.2")
    library.TF_NewStatus.restype = ctypes.c_void_p
    library.TF_NewStatus.argtypes = ()
    library.TF_GetCode.restype = ctypes.c_int
    library.TF_GetCode.argtypes = (ctypes.c_void_p,)
    library.TF_Message.restype = ctypes.c_char_p
    library.TF_Message.argtypes = (ctypes.c_void_p,)
    library.TF_DeleteStatus.restype = None
    library.TF_DeleteStatus.argtypes = (ctypes.c_void_p,)
    return library


_STATUS = _status_library()
