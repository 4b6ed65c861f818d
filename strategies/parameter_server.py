"""`parameter_server`: variables on ps tasks, workers step asynchronously, the chief coordinates.

    python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server

Every task of the `TF_CONFIG` cluster runs the same program; its task type
picks its part (`role`):

- `ps` and `worker` tasks start a `tf.distribute.Server` and serve until the
  chief is gone ("serve");
- the `chief` is the coordinator ("train"): it creates the variables on the
  ps tasks, schedules training steps on the workers with a
  `tf.distribute.coordinator.ClusterCoordinator`, evaluates, checkpoints
  and exports;
- an `evaluator` evaluates checkpoints on the side ("evaluate").

Variables are placed round-robin over the ps tasks, whole. Big ones are split
by the layers of `trainer.layers` under the sharding policy of the options
(`partitioner`: none | fixed | min_size | max_size, see
`strategies.sharding`), which `scope()` makes active; TF's own
`variable_partitioner` is not used, as Keras 3 variables cannot wrap the
`ShardedVariable`s it makes. Each worker reads its own shard of the input
(`InputContext(num_workers, worker index)`) and applies its updates as it
goes: there is no synchronisation between workers (asynchronous training).

Two options change how updates meet (`config.strategy.parameter_server`):

- `sync_replicas = k` (0: asynchronous): synchronous training with spare
  replicas; each update averages the first k of the n workers' gradients,
  and late ones are dropped (`strategies.ps_sync`).
- `staleness`: none | scale | drop_above=N, with `warmup_steps`: what an
  asynchronous update does about the updates applied since its worker read
  the variables; each block records their histogram (`strategies.ps_staleness`).

`test_straggler = "WORKER:SECONDS"` (tests and benchmarks only) makes one
worker sleep that long before each of its batches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import keras
import tensorflow as tf

from strategies import cluster as cluster_lib
from strategies import ps_staleness, ps_sync, sharding, tf_start
from strategies.base import DatasetFn, StepFn, Strategy, _to_floats
from strategies.errors import TaskLost, UserError
from strategies.registry import register

STARTUP_S = 600.0  # how long ps and worker servers wait for the chief to come up
_ROLES = {"chief": "train", "worker": "serve", "ps": "serve", "evaluator": "evaluate"}


@register("parameter_server")
class ParameterServer(Strategy):
    """Variables (whole or sharded) on ps tasks, asynchronous workers driven by the chief."""

    def _build(self) -> tf.distribute.Strategy:
        cluster = cluster_lib.from_env()
        self.policy = sharding.Policy(  # checked first: a bad option fails on any machine
            partitioner=self.options.get("partitioner", "none"),
            num_shards=self.options.get("num_shards", 2),
            min_shard_bytes=self.options.get("min_shard_bytes", sharding.DEFAULT_MIN_SHARD_BYTES),
            max_shard_bytes=self.options.get("max_shard_bytes", 0),
            num_ps=max(1, cluster.num_ps if cluster else 1),
        )
        self.cluster = _parameter_server_cluster(cluster)
        self._check_update_options()
        self.coordinator = None
        self._sync: ps_sync.SyncReplicas | None = None
        self._updates = None  # async: the cluster's update counter, on a ps task
        self._block_steps = 0
        timeout = self.options.get("startup_timeout_seconds", cluster_lib.STARTUP_TIMEOUT_S)
        setting = "strategy.parameter_server.startup_timeout_seconds"
        if self.role != "evaluate":  # the evaluator is not part of the training cluster
            cluster_lib.start_up(self.cluster, timeout, setting)
        if self.role != "train":  # servers and the evaluator hold no cluster-wide strategy
            return tf.distribute.get_strategy()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster.as_dict()),  # without the evaluator: it has no server
            task_type="chief",
            task_id=0,
            rpc_layer=self.cluster.rpc_layer,
        )
        with tf_start.bounded(timeout, setting, self.cluster.task_name):
            strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=None)
        _tables_reach_workers_from_loops()
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        return strategy

    def _check_update_options(self) -> None:
        """Reads `sync_replicas`, `staleness`, `warmup_steps`, `test_straggler`; one line if bad."""
        workers = self.cluster.num_workers
        self.sync_replicas = self.options.get("sync_replicas", 0)
        self.staleness = ps_staleness.Staleness.parse(self.options.get("staleness", "none"))
        self.warmup_steps = self.options.get("warmup_steps", 0)
        self.straggler = _straggler(self.options.get("test_straggler", ""), workers)
        option = "`strategy.parameter_server.sync_replicas`"
        if not 0 <= self.sync_replicas <= workers:
            raise UserError(
                f"{option} ({self.sync_replicas}) must be between 0 (asynchronous) and the "
                f"{workers} workers of the cluster ({workers}: every worker, no spare); use "
                f"{max(workers - 1, 1)} for one spare worker, or start more workers."
            )
        if self.warmup_steps < 0:
            raise UserError(
                f"`strategy.parameter_server.warmup_steps` ({self.warmup_steps}) must be >= 0."
            )
        if self.sync_replicas and (self.staleness.mode != "none" or self.warmup_steps):
            raise UserError(
                f"{option} ({self.sync_replicas}) is synchronous: its updates are never stale, "
                "so `strategy.parameter_server.staleness` and `warmup_steps` do not apply; "
                "set `staleness=none` and `warmup_steps=0`, or `sync_replicas=0` (asynchronous)."
            )

    @property
    def splits_steps(self) -> bool:
        return bool(self.sync_replicas) or self.staleness.mode != "none"

    @property
    def role(self) -> str:
        return _ROLES[self.cluster.task_type]

    @property
    def is_chief(self) -> bool:
        return self.cluster.task_type == "chief"

    @property
    def evaluates_inline(self) -> bool:
        return not self.cluster.has_evaluator

    @property
    def compute_devices(self) -> list[str]:
        if self.role != "train":
            return ["/device:CPU:0"]
        local = self.tf_strategy.extended.worker_devices  # the same on every worker
        return [
            f"/job:worker/replica:0/task:{task}{device}"
            for task in range(self.cluster.num_workers)
            for device in local
        ]

    @property
    def communication(self) -> str:
        placement = "whole, round-robin"
        if self.policy.partitioner != "none":
            placement = (
                f"round-robin, big ones sharded by the {self.policy.partitioner} partitioner"
            )
        workers = self.cluster.num_workers
        where = f"variables on {self.cluster.num_ps} ps task(s) ({placement}); "
        if self.sync_replicas:
            return where + (
                f"synchronous with {workers - self.sync_replicas} spare worker(s): each step "
                f"all {workers} workers push their gradients to accumulators on the ps tasks, "
                f"and one update averages the first {self.sync_replicas}; late ones are dropped"
            )
        how = [
            f"{workers} workers each pull the variables and push their gradients "
            "asynchronously, scheduled by the chief; staleness recorded",
            self.staleness.describe(),
        ]
        if self.warmup_steps:
            how.append(f"the first {self.warmup_steps} steps on one worker")
        return where + ", ".join(filter(None, how))

    def describe(self, variables=()) -> dict:
        return {
            **super().describe(variables),
            "sync_replicas": self.sync_replicas,
            "staleness": self.options.get("staleness", "none"),
            "warmup_steps": self.warmup_steps,
        }

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables go to the ps tasks; sharded layers follow the sharding policy."""
        with self.tf_strategy.scope(), sharding.policy(self.policy):
            yield

    def place_model(self, model) -> None:
        """Its BatchNorm layers update their moving statistics as deltas on the ps.

        Keras's `BatchNormalization` assigns `momentum * read + (1 - momentum) *
        batch`: between asynchronous workers, an update made after another
        worker's read is overwritten and lost. `AtomicBatchNormalization` adds
        `(1 - momentum) * (batch - read)` instead, one atomic op on the ps.
        """
        for layer in model._flatten_layers(include_self=False):
            if type(layer) is keras.layers.BatchNormalization and not layer.renorm:
                layer.__class__ = AtomicBatchNormalization

    def serve(self) -> None:
        """Runs this ps or worker task's server until the chief is gone."""
        config = tf.compat.v1.ConfigProto(
            # Fewer inter-op threads than workers + 1 deadlock a worker or ps under load.
            inter_op_parallelism_threads=max(4, self.cluster.num_workers + 2)
        )
        server = tf.distribute.Server(
            tf.train.ClusterSpec(self.cluster.as_dict()),
            job_name=self.cluster.task_type,
            task_index=self.cluster.task_index,
            protocol=self.cluster.rpc_layer,
            config=config,
            start=True,
        )
        chief = self.cluster.jobs["chief"][0]
        if not cluster_lib.wait_until_gone(chief, startup_s=STARTUP_S):
            raise TaskLost(
                f"the chief at {chief} did not come up within {STARTUP_S:g} s; start it with "
                "the same `TF_CONFIG` cluster."
            )
        del server  # the process ends, and the server with it

    def distribute_dataset(self, dataset_fn: DatasetFn):
        """One input pipeline per worker: `dataset_fn` for that worker's `InputContext`.

        The function a per-worker dataset is made from is traced once, on the
        chief, and runs on every worker; each picks its own branch by its index.
        """
        branches = [
            functools.partial(
                dataset_fn,
                tf.distribute.InputContext(
                    num_input_pipelines=self.cluster.num_workers,
                    input_pipeline_id=index,
                    num_replicas_in_sync=self.num_replicas_in_sync,
                ),
            )
            for index in range(self.cluster.num_workers)
        ]

        if self.straggler:
            worker, seconds = self.straggler
            branches[worker] = _sleeping(branches[worker], seconds)

        def per_worker_dataset() -> tf.data.Dataset:
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return tf.switch_case(tf.cast(index, tf.int32), branches)

        return self.coordinator.create_per_worker_dataset(per_worker_dataset)

    def run_steps(self, step_fn: StepFn, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps: synchronous ones (`sync_replicas`), or split over the workers.

        Asynchronously, each closure runs its share of the steps in one
        `tf.function`, each step applying its own update; a closure that a
        failed worker did not finish runs again on another worker. The first
        `warmup_steps` steps of the job run on one worker alone.
        """
        self._block_steps = n
        if self.sync_replicas:
            if self._sync is None:
                self._sync = ps_sync.SyncReplicas(
                    self.tf_strategy,
                    self.coordinator,
                    step_fn.halves,
                    self.sync_replicas,
                    self.cluster.num_workers,
                )
            return _to_floats(self._sync.run(iterator, n))
        if self._updates is None:
            with self.tf_strategy.scope():  # on a ps task; counts this run's updates
                self._updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="updates")
        loop = self._compile(
            "train",
            step_fn,
            lambda fn: ps_staleness.make_loop(self.tf_strategy, fn, self.staleness, self._updates),
        )
        alone = min(n, max(0, self.warmup_steps - _steps_done(step_fn, self._updates)))
        results = []
        if alone:  # warm-up: one worker, no staleness; the others join after it
            results.append(self.coordinator.schedule(loop, args=(iterator, _int64(alone))))
            self.coordinator.join()
        workers, rest = self.cluster.num_workers, n - alone
        shares = [len(range(i, rest, workers)) for i in range(min(rest, workers))]
        results += [self.coordinator.schedule(loop, args=(iterator, _int64(s))) for s in shares]
        self.coordinator.join()
        sums = [result.fetch() for result in results]
        return _to_floats(tf.nest.map_structure(lambda *parts: tf.add_n(parts), *sums))

    def report(self, sums: dict) -> tuple[dict, dict, dict]:
        """Synchronous: gradients averaged and dropped per update; async: staleness."""
        own = ps_sync.SUMS if self.sync_replicas else ps_staleness.SUMS
        task_sums = {k: v for k, v in sums.items() if k not in own}
        if self.sync_replicas:
            return task_sums, *ps_sync.report(sums, self._block_steps)
        return task_sums, *ps_staleness.report(sums, self._block_steps, self.staleness)

    def evaluate(self, step_fn: StepFn, dataset_fn: DatasetFn) -> dict[str, float]:
        """One pass over the eval data on the chief, reading the variables from the ps tasks."""
        loop = self._compile("eval", step_fn, self._make_eval_loop)
        return _to_floats(loop(dataset_fn(tf.distribute.InputContext())))

    def _eval_batch(self, step_fn: StepFn, batch) -> dict:
        return step_fn(batch)  # on the chief itself, not scheduled on a worker


def _parameter_server_cluster(cluster: cluster_lib.ClusterSpec | None) -> cluster_lib.ClusterSpec:
    if cluster is None or not (cluster.has_chief and cluster.num_workers and cluster.num_ps):
        found = "no `TF_CONFIG`" if cluster is None else f"jobs {', '.join(cluster.jobs)}"
        raise UserError(
            "A `parameter_server` run needs a `TF_CONFIG` cluster with a chief, workers and "
            f"ps (found {found}); use `python -m trainer.launch --workers=2 --ps=2 -- "
            "--strategy=parameter_server`."
        )
    return cluster


def _int64(value: int) -> tf.Tensor:
    return tf.constant(value, tf.int64)


def _steps_done(step_fn: StepFn, updates: tf.Variable) -> int:
    """The job's step: the optimizer's counter, else the updates this run counted."""
    halves = getattr(step_fn, "halves", None)
    return int((halves.iterations if halves else updates).numpy())


def _straggler(text: str, workers: int) -> tuple[int, float] | None:
    """`test_straggler` "WORKER:SECONDS" as (worker, seconds); None for "".

    Raises:
      UserError: not of that form, or no such worker.
    """
    if not str(text).strip():
        return None
    worker, _, seconds = str(text).partition(":")
    try:
        parsed = int(worker), float(seconds)
    except ValueError:
        parsed = None
    if parsed is None or not 0 <= parsed[0] < workers or parsed[1] < 0:
        raise UserError(
            f"`strategy.parameter_server.test_straggler` ('{text}') must be 'WORKER:SECONDS' "
            f"with WORKER one of 0..{workers - 1} and SECONDS >= 0, e.g. '2:0.2', or ''."
        )
    return parsed


def _sleeping(dataset_fn, seconds: float):
    """`dataset_fn` whose dataset sleeps `seconds` before each batch (a straggling worker)."""

    def sleeping() -> tf.data.Dataset:
        dataset = dataset_fn()
        spec = dataset.element_spec
        variant = tf.raw_ops.SleepDataset(
            input_dataset=tf.data.experimental.to_variant(dataset),
            sleep_microseconds=tf.constant(round(seconds * 1e6), tf.int64),
            output_types=[s.dtype for s in tf.nest.flatten(spec)],
            output_shapes=[s.shape for s in tf.nest.flatten(spec)],
        )
        return tf.data.experimental.from_variant(variant, spec)

    return sleeping


class AtomicBatchNormalization(keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics take each step's update as an atomic delta.

    The statistic `s` moves by `(1 - momentum) * (batch - s)`, `s` as this step
    read it, applied with the TensorFlow variable's `assign_add`: concurrent
    steps of several workers all count, as under one worker in turn. A masked
    call keeps Keras's own update.
    """

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or mask is not None:
            return super().call(inputs, training=training, mask=mask)
        dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32  # as Keras's own
        inputs = tf.cast(inputs, dtype)
        mean, variance = self._moments(inputs, None)
        for statistic, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            delta = (batch - tf.cast(statistic.value, dtype)) * (1.0 - self.momentum)
            statistic.value.assign_add(tf.cast(delta, statistic.dtype))
        gamma = tf.cast(self.gamma, dtype) if self.scale else None
        beta = tf.cast(self.beta, dtype) if self.center else None
        outputs = keras.ops.batch_normalization(
            inputs, mean, variance, self.axis, offset=beta, scale=gamma, epsilon=self.epsilon
        )
        return tf.cast(outputs, self.compute_dtype)


def _tables_reach_workers_from_loops() -> None:
    """A vocabulary table (`StringLookup`, ...) used inside a loop reaches each worker's copy.

    Created under the strategy's scope, a lookup table is a `DistributedTable`:
    a copy on every worker, whose handle a scheduled function receives at call
    time (`capture_call_time_value`). TensorFlow captures it in the graph
    where the lookup is traced; inside the body of the loop of steps that is a
    nested graph, whose call-time captures nobody feeds ("You must feed a value
    for placeholder tensor ... Lookup/Placeholder"). Here the handle is captured
    once in the outermost function graph, which the call feeds, and the nested
    graph captures that tensor as any other.
    """
    from tensorflow.python.distribute import ps_values  # noqa: PLC0415
    from tensorflow.python.framework import func_graph  # noqa: PLC0415

    table = ps_values.DistributedTable
    if getattr(table, "_towerflow_outermost_capture", False):
        return
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

    table.resource_handle = property(resource_handle)
    table._towerflow_outermost_capture = True
