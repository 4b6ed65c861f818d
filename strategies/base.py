"""The strategy interface every plugin implements.

Glossary (the classic distributed-TensorFlow terms, as `tf.distribute` uses them):

- *replica* (tower): one copy of the model's computation, on one device.
- *member*: one process of a cluster; `TF_CONFIG` calls it a `task`.
- *member type*: `chief`, `worker`, `ps` or `evaluator`: `TF_CONFIG`'s task type, a key of
  its `cluster` (TensorFlow's `ClusterSpec` calls each a job; here `ClusterSpec.addresses`).
- *worker*: a member that runs replicas; one machine may hold several.
- *chief*: the member that writes checkpoints, summaries and exports.
- *parameter server* (ps): a member that only holds variables.
- *replica context* vs *cross-replica context*: code passed to
  `call_for_each_replica` runs once per replica (replica context); code around
  it, inside `scope()`, sees all replicas at once (cross-replica context).
- *sync* vs *async*: synchronous plugins average every replica's gradients
  into one update per step; the asynchronous `parameter_server` plugin lets
  each worker apply its own updates as it goes.
- *membership* (`strategy.membership`, `strategies.cluster.membership.Membership`):
  who this process is in its cluster (role, chief) and whether the others
  are alive (lost members, agreement, preemption, restored steps). It is not
  part of distributing a step, so it is not part of this interface; a
  plugin of several processes builds it from its cluster in `build_tf_strategy()`.
- *role* (`strategy.membership.role`): what a member does, from its type and the
  strategy: "train" runs the loop, "serve" runs a server for the others (the ps and
  workers of a parameter-server cluster), "evaluate" evaluates checkpoints beside
  training. (`python -m trainer.data_service --role` keeps its flag's name for which of
  the tf.data service's two servers a process runs.)
- *job*: one training run as the user starts it: one config, one `model_dir`, every
  member that trains it; a restart with the same `model_dir` continues the job. A
  scheduler's job is named with its scheduler (a Slurm job, a Kubernetes Job, a JobSet's
  replicated job), and the tf.data service's as a tf.data service job (`data.service_job`).
- *table*: a `DynamicEmbedding`'s memory of ids, a row per admitted id, with its *index*
  (id to row); under `parameter_server` it is split by id into *parts*, one per ps member.
  A `TableConfig` describes one (Keras-RS's name). A fixed-size embedding variable split
  over ps members (`ShardedEmbedding`) is split into *shards*; it is not a table.
- *plan*: what a command decides before it starts anything, named for what it plans:
  `trainer.launch.LaunchPlan` (a local cluster's members, their command, restarts), a
  sweep's trials and slots (`trainer.sweep.plan`), what a warm start loads.
- *plugin*: a `Strategy` subclass, registered by name (`strategies.register`,
  or an installed package's `towerflow.strategies` entry point).
- *traits* (`Traits`): what a plugin supports and how it runs steps, which the
  loop checks before it builds anything.
- *options*: a plugin's settings, the `config.strategy.<name>` section, declared
  once as a dataclass (`class P(Strategy, options=POptions)`).

The interface the loop uses: `scope()`, `distribute_dataset(dataset_fn)`,
`call_for_each_replica(fn, args)`, `reduce(op, value)`, `local_results(value)`,
`num_replicas_in_sync`, `run_steps(step_fn, iterator, n)`,
`evaluate(step_fn, dataset_fn)`, `describe(variables)`, `place_model(model)`
and `report(sums)`; what the plugin supports and how it runs steps (`traits`);
its `name`, its `options`, the `tf_strategy` it wraps and its `membership`.
Those 16 are all the public members the loop reads.

The hooks a plugin implements, its public contract: `build_tf_strategy()`
(the `tf.distribute.Strategy` it wraps, from `self.options`) and
`communication` (one line on what crosses devices or processes); where it
differs from the default, `local_replicas(options, logical_cpus)` (replicas in
one process, asked before TensorFlow starts) and `compute_devices` (the devices
that run replicas). With its `Traits` and its options dataclass that is all a
plugin must give; it may override any member of the interface where it
differs. The hooks of towerflow 0.1 (`_build`, `_communication`,
`_local_replicas`, `_compute_devices`, `Options`, `supports_*`) still work
until towerflow 0.3, with one line naming the new name (`strategies.deprecated`).

A plugin wraps one real `tf.distribute.Strategy` (`tf_strategy`) and adds only
what differs for it. A short example, the whole contract in use:

    strategy = strategies.get("mirrored")
    with strategy.scope():
        model = make_model()
    dataset = strategy.distribute_dataset(dataset_fn)
    totals = strategy.run_steps(step_fn, iter(dataset), n=100)

`step_fn(batch)` runs in replica context and returns a dict of scalar sums
(e.g. `{"loss": ..., "examples": ...}`); `run_steps` adds them over replicas
and steps and returns floats.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import keras
import ml_collections
import tensorflow as tf

from strategies import deprecated, transfer, unrolled
from strategies.cluster import membership
from strategies.packed_sums import BufferedSums, PackedSums, Unbuffered
from towerflow.errors import UserError
from towerflow.sections import Section

StepFn = Callable[[Any], dict]
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@runtime_checkable
class TrainStepProtocol(Protocol):
    """The train step as a plugin sees it: `step(batch)` in replica context, the task's sums.

    `trainer.loop.steps.TrainStep` and `CustomTrainStep` (a user task's
    own `train_step`, which applies its own gradients) implement it. A step that
    also splits into halves is a `SplitTrainStep`. A step may also ask a loop
    for several steps to each iteration of its `while` (`unroll`, a
    `strategies.unrolled.Unroll`; one where it has none).
    """

    variables: list  # the trainable variables, in the order of the gradients
    iterations: tf.Variable  # the optimizer's update counter (the step)

    def __call__(self, batch) -> dict: ...


@runtime_checkable
class SplitTrainStep(TrainStepProtocol, Protocol):
    """A train step that splits into halves: `step(batch)` is `apply(gradients(batch)[0])`.

    A plugin that runs the halves apart uses them by name: synchronous
    `parameter_server` with spare replicas computes gradients on the workers
    and applies their average on the ps; staleness-aware async looks at the
    update between the two. `trainer.loop.steps.TrainStep` is one; a user task's
    own `train_step` is not, and a plugin that splits steps (`Traits`) refuses it.
    """

    def gradients(self, batch) -> tuple[list, dict]:
        """This replica's gradients of `variables` on `batch`, and the task's sums."""
        ...

    def apply(self, grads: list) -> None:
        """One optimizer update from `grads` (in replica context)."""
        ...


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a plugin supports, and how it runs steps: what the loop checks and adapts to.

    A plugin declares its own as a class attribute (`traits = Traits(jit_compile=False)`);
    one whose traits depend on its options sets `self.traits` in `build_tf_strategy()`
    (`dataclasses.replace(self.traits, transfer=...)`). The loop reads them from the
    class before anything is built (`train.jit_compile`, precision, `data.follow`) and
    from the built plugin after.

    Attributes:
      jit_compile: `train.jit_compile` works (XLA needs the variables on the device
        that computes).
      loss_scaling: `train.precision=mixed_float16` works.
      gradient_transfer: the plugin all-reduces gradients, so `gradient_dtype` (and
        packing) may be set in its options.
      transfer: how gradients cross (`strategies.transfer.GradientTransfer`).
      ordered_input: steps take the input pipeline's batches in its order (exact
        resume, `data.follow`).
      splits_steps: `run_steps` runs a step's halves apart (`SplitTrainStep`).
      takes_units: `run_steps` also takes a `strategies.units.UnitStream` for its
        iterator: workers that take work when free train input handed out in units
        (`data.follow` under asynchronous `parameter_server`).
    """

    # `train.jit_compile` works: XLA needs the variables on the device that computes,
    # which a plugin that keeps them elsewhere (on the host, by stage) breaks.
    jit_compile: bool = True
    # `train.precision=mixed_float16` works: Keras's loss-scale optimizer updates its
    # counters inside a branch, which a plugin with variables on the host cannot run.
    loss_scaling: bool = True
    # `gradient_dtype` (and packing) can be set: the plugin all-reduces gradients and sets
    # `transfer` from its options in `build_tf_strategy` (see `strategies.transfer`).
    gradient_transfer: bool = False
    transfer: transfer.GradientTransfer = transfer.GradientTransfer()  # how gradients cross
    # Steps take an input pipeline's batches in its order (exact resume); False where
    # workers take steps as they come (asynchronous `parameter_server`).
    ordered_input: bool = True
    # `run_steps` runs the step's halves apart (`SplitTrainStep`): a user task's
    # own `train_step` has none, so it cannot run (synchronous `parameter_server`).
    splits_steps: bool = False
    # `run_steps` takes a `strategies.units.UnitStream` too: each unit goes to whichever
    # worker is free, so input that cannot be one ordered stream still trains each record
    # once (`data.follow` under asynchronous `parameter_server`).
    takes_units: bool = False


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a plugin that has none."""


def local_replicas(
    plugin: type[Strategy], options: ml_collections.ConfigDict | None, logical_cpus: int
) -> int:
    """`plugin.local_replicas(options, logical_cpus)`, for callers that hold the class.

    How many replicas `plugin` will run in this process, told before TensorFlow
    starts: it sets how many threads each op gets (`devices.intra_op_threads`).
    """
    return plugin.local_replicas(options, logical_cpus)


def read_options(plugin: type[Strategy], section) -> ml_collections.ConfigDict:
    """`section` (`config.strategy.<name>`) over the defaults of the plugin's options.

    The plugin's options dataclass (`class P(Strategy, options=POptions)`) is
    where its option defaults live, once; `configs/default.py` builds its
    `strategy.<name>` sections from the built-in ones, so
    `--config.strategy.<name>.<option>` works. It is read as any declared config
    section is (`towerflow.sections.Section.parse`): each value's type, then the
    dataclass's own rules (its `__post_init__` raising `UserError`), so a bad one
    stops before anything is built.

    Raises:
      UserError: `section` holds a field the plugin does not declare, a value of
        another type than declared, or a value its options dataclass refuses.
    """
    declared = Section(f"strategy.{plugin.name}", plugin._options_type)
    given = dict(section.items()) if section is not None else {}
    unknown = declared.undeclared(given)
    if unknown:  # named as an option of the plugin, which declares it
        names = [field.name for field in dataclasses.fields(plugin._options_type)]
        raise UserError(
            f"`strategy.{plugin.name}.{unknown[0]}` is no option of `{plugin.name}`; its "
            f"options: {', '.join(names) or 'none'} (as the plugin declares them)."
        )
    return ml_collections.ConfigDict(dataclasses.asdict(declared.parse(given)))


# tf.data warns about reading dataset options while a distributed loop is traced; harmless.
warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")

# The sums a loop of steps carries in one vector (`BufferedSums`): the objectives' scalars
# and the AUC's score histograms (400) fit; a step's of more, or not float32, are carried
# as they are.
LOOP_SUMS = 1024
_REDUCE_OPS = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


class Strategy(abc.ABC):
    """One way of distributing training, behind the towerflow interface.

    A plugin subclasses it, gives its options dataclass as a class keyword
    (`class P(Strategy, options=POptions)`), declares its `traits` where they
    differ from `Traits()`, and implements `build_tf_strategy()` and
    `communication`; docs/plugins.md has a whole plugin, installed as a package
    and trained by the test suite. `strategies.get(name, options)` builds it:
    `self.options` is set, then `self.tf_strategy = self.build_tf_strategy()`.
    """

    name: str = "?"  # set by `@register`
    # What it supports and how it runs steps; one whose traits depend on its options
    # sets `self.traits` in `build_tf_strategy`.
    traits: Traits = Traits()

    # The plugin's options, a dataclass whose fields' defaults are the options' defaults,
    # given as `class P(Strategy, options=POptions)`; `self.options` holds them over
    # `config.strategy.<name>` (`read_options`).
    _options_type: type = NoOptions

    def __init_subclass__(cls, options: type | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if options is not None:
            cls._options_type = options
        deprecated.adopt(cls)  # a plugin of towerflow 0.1's interface, with one line

    def __init__(self, options: ml_collections.ConfigDict | None = None):
        self.options = read_options(type(self), options)
        if not self.traits.gradient_transfer:  # nothing all-reduced: float32 only
            transfer.refuse(self.options, self.name)
        # One process until `build_tf_strategy` says otherwise: a plugin of several
        # processes sets its own from the cluster (`membership.Membership(cluster, ...)`).
        self.membership = membership.Membership()
        self.tf_strategy: tf.distribute.Strategy = self.build_tf_strategy()
        deprecated.adopt_built(self)
        self._compiled: dict[str, tuple[StepFn, Callable]] = {}  # kind: (step, its loop)

    # --- the hooks a plugin implements ----------------------------------------

    @abc.abstractmethod
    def build_tf_strategy(self) -> tf.distribute.Strategy:
        """Creates the `tf.distribute.Strategy` this plugin wraps, from `self.options`.

        Called once, when the plugin is built (`strategies.get`); the result is
        `self.tf_strategy`. A plugin of several processes also sets
        `self.membership` here, and one whose traits depend on its options sets
        `self.traits`.

        Raises:
          UserError: an option this plugin cannot run with, in one line naming it.
        """

    @property
    @abc.abstractmethod
    def communication(self) -> str:
        """One line on what crosses devices or processes each step (`describe()` shows it)."""

    @classmethod
    def local_replicas(cls, options: ml_collections.ConfigDict | None, logical_cpus: int) -> int:
        """How many replicas this plugin will run in this process, told before TF starts.

        It sets how many threads each op gets (`devices.intra_op_threads`); the
        default is one. A plugin that runs several replicas (or stages) in one
        process overrides it.

        Args:
          options: `config.strategy.<name>` (read it with `read_options(cls, options)`),
            or None for the declared defaults.
          logical_cpus: `devices.logical_cpus`, the CPUs TensorFlow will split the host into.
        """
        return 1

    @property
    def compute_devices(self) -> list[str]:
        """The devices that run replicas; the default asks `tf_strategy`."""
        return list(self.tf_strategy.extended.worker_devices)

    # --- the interface -------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager:
        """Variables created inside follow this strategy's placement policy."""
        return self.tf_strategy.scope()

    def distribute_dataset(self, dataset_fn: DatasetFn):
        """Builds the input pipeline(s) from `dataset_fn(input_context)`.

        `dataset_fn` batches with `input_context.get_per_replica_batch_size(...)`
        and shards by `input_context.input_pipeline_id`.
        """
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn)

    def call_for_each_replica(self, fn: Callable, args: tuple = (), kwargs: dict | None = None):
        """Runs `fn(*args, **kwargs)` once per replica; returns per-replica values."""
        return self.tf_strategy.run(fn, args=args, kwargs=kwargs)

    def reduce(self, op: str | tf.distribute.ReduceOp, value, axis: int | None = None):
        """Combines per-replica `value`s into one tensor with `op` ("sum" or "mean")."""
        return self.tf_strategy.reduce(_reduce_op(op), value, axis=axis)

    def local_results(self, value) -> tuple:
        """The per-replica components of `value` that live in this process."""
        return self.tf_strategy.experimental_local_results(value)

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas average into one update."""
        return self.tf_strategy.num_replicas_in_sync

    def place_model(self, model: keras.Model) -> None:
        """Lays out `model`, just built inside `scope()`, before its optimizer is built.

        A plugin that places a model's layers itself (model parallelism, e.g.
        `pipeline`) moves their variables here and sets how the model runs; the
        default keeps the placement `scope()` gave.

        Raises:
          UserError: a model this plugin cannot lay out, in one line.
        """
        del model  # `scope()` placed every variable

    def run_steps(self, step_fn: TrainStepProtocol | StepFn, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps of `step_fn` inside one `tf.function`.

        Returns the step outputs summed over replicas and steps, as floats.
        """
        loop = self._compile("train", step_fn, self._make_train_loop)
        return _to_floats(loop(iterator, tf.constant(n, tf.int64)))

    def evaluate(self, step_fn: StepFn, dataset_fn: DatasetFn) -> dict[str, float]:
        """Runs `step_fn` once over every batch of a finite `dataset_fn`.

        The whole pass runs inside one `tf.function`. Returns the step outputs
        summed over replicas and batches, as floats.
        """
        loop = self._compile("eval", step_fn, self._make_eval_loop)
        return _to_floats(loop(self.distribute_dataset(dataset_fn)))

    def describe(self, variables: Iterable = ()) -> dict:
        """Where every variable lives, which devices compute, what communicates."""
        return {
            "strategy": self.name,
            "tf_strategy": type(self.tf_strategy).__name__,
            "replicas_in_sync": self.num_replicas_in_sync,
            "compute_devices": self.compute_devices,
            "communication": "; ".join(filter(None, [self.communication, self._transfer_text()])),
            "gradient_transfer": self.traits.transfer.as_dict(),
            "variables": {_variable_name(v): variable_devices(v) for v in variables},
        }

    def report(self, sums: dict) -> tuple[dict, dict[str, float], dict[str, Any]]:
        """A block's `run_steps` sums split into the task's sums and the plugin's own figures.

        Returns the task's sums (what the train step returned, for its
        metrics), then the plugin's scalars (shown with the train metrics,
        e.g. the mean staleness of async updates) and histograms (counts per
        bucket 0, 1, ...: a 1-D array). The last two are empty unless the
        plugin adds sums of its own.
        """
        return sums, {}, {}

    def _transfer_text(self) -> str:
        how = self.traits.transfer.describe()
        return f"gradients cross {how}" if how else ""

    # --- helpers for plugins -------------------------------------------------

    def _reduced_step(self, step_fn: StepFn, batch) -> dict:
        outputs = self.call_for_each_replica(step_fn, args=(batch,))
        return tf.nest.map_structure(lambda v: self.reduce("sum", v), outputs)

    def _make_train_loop(self, step_fn: StepFn) -> Callable:
        unroll = unrolled.asked(step_fn)

        def loop(iterator, n, sums):
            # Each replica adds up its own sums over the loop, and they are reduced once at
            # its end: between processes every reduction is a collective (a network round
            # trip), and reducing each step's sums cost multi_worker four of them a step.
            def add_step(totals, batch):
                return sums.add(totals, step_fn(batch))

            def more_steps(totals):
                return self.call_for_each_replica(add_step, args=(totals, next(iterator)))

            if isinstance(sums, BufferedSums):  # from zero: the step traced once a place
                totals, rest, k = self.call_for_each_replica(sums.zeros), n, unroll.steps
            else:  # the first step, traced alone, gives the totals and its ops
                totals, ops = unrolled.traced_ops(
                    lambda: self.call_for_each_replica(
                        lambda batch: sums.pack(step_fn(batch)), args=(next(iterator),)
                    )
                )
                rest, k = n - 1, unrolled.steps_per_iteration(step_fn, ops)
            if k > 1:  # the steps that do not fill an iteration (one step more traced)
                for _ in tf.range(rest % k):
                    totals = more_steps(totals)
            for _ in tf.range(rest // k):  # a long run's small step: k > 1
                for _ in range(k):
                    totals = more_steps(totals)
            if isinstance(sums, BufferedSums):  # of a known length again, to be reduced
                totals = self.call_for_each_replica(sums.trim, args=(totals,))
            return sums.unpack(tf.nest.map_structure(lambda v: self.reduce("sum", v), totals))

        # Counting a step's ops needs it traced before the loop (`unrolled`).
        return _buffered_if_it_fits(loop, buffered=not unroll.if_small)

    def _eval_batch(self, step_fn: StepFn, batch) -> dict:
        """One eval batch's sums; a plugin that evaluates outside its replicas overrides it."""
        return self._reduced_step(step_fn, batch)

    def _make_eval_loop(self, step_fn: StepFn) -> Callable:
        def loop(dataset, sums):
            iterator = iter(dataset)
            if isinstance(sums, BufferedSums):
                totals = sums.zeros()
            else:
                totals = sums.pack(self._eval_batch(step_fn, next(iterator)))
            for batch in iterator:
                totals = sums.add(totals, self._eval_batch(step_fn, batch))
            return sums.unpack(totals)

        return _buffered_if_it_fits(loop)

    def _compile(self, kind: str, step_fn: StepFn, make: Callable) -> Callable:
        # One loop of each kind: a new step (each `train.run` makes one) replaces the last,
        # so a finished run's loop does not stay alive, nor the iterators its traces hold
        # (with their tf.data threads).
        step, loop = self._compiled.get(kind, (None, None))
        if step is not step_fn:
            loop = make(step_fn)
            self._compiled[kind] = (step_fn, loop)
        return loop


deprecated.keep_old_names(Strategy)


def _buffered_if_it_fits(loop: Callable, buffered: bool = True) -> Callable:
    """`loop(*args, sums)` as a `tf.function`: its totals in a `BufferedSums` where they fit.

    The first call traces the buffered loop; where a step's sums do not fit one
    (`Unbuffered`, raised while it traces, before anything ran), the loop is
    traced again with the sums carried as they are, and that one is kept.
    """
    # Partials, not lambdas: TensorFlow counts the traces of a function by its code, and
    # warns of "retracing" when each run of a process makes and traces its own loops.
    buffered_loop = tf.function(functools.partial(_with_sums, loop, _buffered_sums))
    packed_loop = tf.function(functools.partial(_with_sums, loop, PackedSums))

    def run(*args):
        nonlocal buffered
        if buffered:
            try:
                return buffered_loop(*args)
            except Unbuffered:
                buffered = False
        return packed_loop(*args)

    return run


def _with_sums(loop: Callable, make_sums: Callable, *args):
    """`loop(*args)` with new sums (a trace's own: `BufferedSums` learns the step's layout)."""
    return loop(*args, sums=make_sums())


def _buffered_sums() -> BufferedSums:
    return BufferedSums(LOOP_SUMS)


def _reduce_op(op: str | tf.distribute.ReduceOp) -> tf.distribute.ReduceOp:
    if isinstance(op, tf.distribute.ReduceOp):
        return op
    if str(op).lower() not in _REDUCE_OPS:
        raise ValueError(f"Unknown reduce op {op!r}; use one of: {', '.join(_REDUCE_OPS)}.")
    return _REDUCE_OPS[str(op).lower()]


def _to_floats(values: dict) -> dict:
    """Scalars become floats; vectors (e.g. histograms) become numpy arrays."""
    return {k: float(v) if v.shape.rank == 0 else v.numpy() for k, v in values.items()}


def _variable_name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def variable_devices(variable) -> list[str]:
    """The device of every copy or shard of `variable` (Keras or TF)."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    if hasattr(inner, "variables") and not hasattr(inner, "values"):  # ShardedVariable
        return [shard.device for shard in inner.variables]
    if hasattr(inner, "values"):  # MirroredVariable and other distributed values
        return [copy.device for copy in inner.values]
    return [inner.device]
