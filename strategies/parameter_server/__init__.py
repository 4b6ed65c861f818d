"""`parameter_server`: variables on ps members, workers step asynchronously, the chief coordinates.

    python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server

Every member of the `TF_CONFIG` cluster runs the same program; its task type
picks its part (`role`):

- `ps` and `worker` members start a `tf.distribute.Server` and serve until the
  chief is gone ("serve");
- the `chief` is the coordinator ("train"): it creates the variables on the
  ps members, schedules training steps on the workers with a
  `tf.distribute.coordinator.ClusterCoordinator`, evaluates, checkpoints
  and exports;
- an `evaluator` evaluates checkpoints on the side ("evaluate").

Variables are placed round-robin over the ps members, whole. Big ones are split
by the layers of `trainer.layers` under the sharding policy of the options
(`partitioner`: none | fixed | min_size | max_size, see
`strategies.sharding`), which `scope()` makes active; TF's own
`variable_partitioner` is not used, as Keras 3 variables cannot wrap the
`ShardedVariable`s it makes. Each worker reads its own shard of the input
(`InputContext(num_workers, worker index)`) and applies its updates as it
goes: there is no synchronisation between workers (asynchronous training).

Two options change how updates meet (`config.strategy.parameter_server`);
the plugin chooses its update mode once, at start, as one small runner
(`updates`: `run`, `report`, `describe`):

- `sync_replicas = k` (0: asynchronous): synchronous training with spare
  replicas; each update averages the first k of the n workers' gradients,
  and late ones are dropped (`strategies.parameter_server.sync`).
- `staleness`: none | scale | drop_above=N, with `warmup_steps`: what an
  asynchronous update does about the updates applied since its worker read
  the variables; each block records their histogram (`strategies.parameter_server.staleness`).

"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import keras
import tensorflow as tf

from strategies import sharding, tf_patches, tf_private
from strategies.base import DatasetFn, StepFn, Strategy, TrainStepProtocol, Traits, _to_floats
from strategies.cluster import membership, tf_start
from strategies.cluster import tf_config as cluster_lib
from strategies.options import ParameterServerOptions
from strategies.parameter_server import staleness as ps_staleness
from strategies.parameter_server import sync as ps_sync
from strategies.registry import register
from towerflow.errors import UserError


@register("parameter_server")
class ParameterServer(Strategy, options=ParameterServerOptions):
    """Variables (whole or sharded) on ps members, asynchronous workers driven by the chief."""

    # Workers take steps, and batches, as they come; asynchronous workers also take input
    # handed out in units (`strategies.units`), one closure a unit.
    traits = Traits(ordered_input=False, takes_units=True)

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        cluster = cluster_lib.from_env()
        self.policy = sharding.Policy(  # checked first: a bad option fails on any machine
            partitioner=self.options.partitioner,
            num_shards=self.options.num_shards,
            min_shard_bytes=self.options.min_shard_bytes,
            max_shard_bytes=self.options.max_shard_bytes,
            num_ps=max(1, cluster.num_ps if cluster else 1),
        )
        self.membership = membership.Membership(
            _parameter_server_cluster(cluster), serving_types=("ps", "worker")
        )
        self._cluster = self.membership.cluster  # the plugin reads it often
        self._check_update_options()
        self._block_steps = 0
        timeout = self.options.startup_timeout_seconds
        setting = "strategy.parameter_server.startup_timeout_seconds"
        if self.membership.role != "evaluate":  # the evaluator is not part of the training cluster
            cluster_lib.start_up(self._cluster, timeout, setting)
        strategy, self.coordinator = tf.distribute.get_strategy(), None
        if self.membership.role == "train":  # servers and the evaluator: no cluster-wide strategy
            with tf_start.bounded(timeout, setting, self._cluster.member_name):
                strategy = self._coordinated_strategy()
            self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
            # The coordinator places each part of a dynamic table on its ps member.
            self.policy = dataclasses.replace(self.policy, on_ps=True)
        # The update mode, chosen once: synchronous with spare replicas, or asynchronous.
        workers = self._cluster.num_workers
        if self.sync_replicas:
            self.updates = ps_sync.SyncUpdates(
                strategy, self.coordinator, self.sync_replicas, workers
            )
        else:
            self.updates = ps_staleness.AsyncUpdates(
                strategy, self.coordinator, self.staleness, self.warmup_steps, workers
            )
        self.traits = dataclasses.replace(
            self.traits,
            splits_steps=self.updates.splits_steps,
            # Units go to whichever worker is free: not the synchronous mode's rounds, nor the
            # warm-up's one worker.
            takes_units=not (self.sync_replicas or self.warmup_steps),
        )
        return strategy

    def _coordinated_strategy(self) -> tf.distribute.ParameterServerStrategy:
        """The chief's strategy over the training cluster (the evaluator has no server)."""
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self._cluster.as_dict()),
            task_type="chief",
            task_id=0,
            rpc_layer=self._cluster.rpc_layer,
        )
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=None)
        tf_patches.tables_reach_workers_from_loops()
        return strategy

    def _check_update_options(self) -> None:
        """Reads `sync_replicas`, `staleness`, `warmup_steps`; one line if bad."""
        workers = self._cluster.num_workers
        self.sync_replicas = self.options.sync_replicas
        self.staleness = ps_staleness.Staleness.parse(self.options.staleness)
        self.warmup_steps = self.options.warmup_steps
        option = "`strategy.parameter_server.sync_replicas`"
        if not 0 <= self.sync_replicas <= workers:
            raise UserError(
                f"{option} ({self.sync_replicas}) must be between 0 (asynchronous) and the "
                f"{workers} workers of the cluster ({workers}: every worker, no spare); use "
                f"{max(workers - 1, 1)} for one spare worker, or start more workers."
            )
        if self.sync_replicas and (self.staleness.mode != "none" or self.warmup_steps):
            raise UserError(
                f"{option} ({self.sync_replicas}) is synchronous: its updates are never stale, "
                "so `strategy.parameter_server.staleness` and `warmup_steps` do not apply; "
                "set `staleness=none` and `warmup_steps=0`, or `sync_replicas=0` (asynchronous)."
            )

    @property
    def compute_devices(self) -> list[str]:
        if self.membership.role != "train":
            return ["/device:CPU:0"]
        local = self.tf_strategy.extended.worker_devices  # the same on every worker
        return [
            f"/job:worker/replica:0/task:{index}{device}"
            for index in range(self._cluster.num_workers)
            for device in local
        ]

    @property
    def communication(self) -> str:
        placement = "whole, round-robin"
        if self.policy.partitioner != "none":
            placement = (
                f"round-robin, big ones sharded by the {self.policy.partitioner} partitioner"
            )
        where = f"variables on {self._cluster.num_ps} ps member(s) ({placement}); "
        return where + self.updates.describe()

    def describe(self, variables=()) -> dict:
        return {
            **super().describe(variables),
            "sync_replicas": self.sync_replicas,
            "staleness": self.options.staleness,
            "warmup_steps": self.warmup_steps,
        }

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables go to the ps members; sharded layers follow the sharding policy."""
        with self.tf_strategy.scope(), sharding.policy(self.policy):
            yield

    def place_model(self, model) -> None:
        """Its BatchNorm layers update their moving statistics as deltas on the ps.

        Keras's `BatchNormalization` assigns `momentum * read + (1 - momentum) *
        batch`: between asynchronous workers, an update made after another
        worker's read is overwritten and lost. `AtomicBatchNormalization` adds
        `(1 - momentum) * (batch - read)` instead, one atomic op on the ps.
        """
        for layer in tf_patches.flat_layers(model):
            if type(layer) is keras.layers.BatchNormalization and not layer.renorm:
                tf_patches.swap_class(layer, AtomicBatchNormalization)

    def distribute_dataset(self, dataset_fn: DatasetFn):
        """One input pipeline per worker: `dataset_fn` for that worker's `InputContext`.

        The function a per-worker dataset is made from is traced once, on the
        chief, and runs on every worker; each picks its own branch by its index.
        """
        branches = [
            functools.partial(
                dataset_fn,
                tf.distribute.InputContext(
                    num_input_pipelines=self._cluster.num_workers,
                    input_pipeline_id=index,
                    num_replicas_in_sync=self.num_replicas_in_sync,
                ),
            )
            for index in range(self._cluster.num_workers)
        ]

        def per_worker_dataset() -> tf.data.Dataset:
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return tf.switch_case(tf.cast(index, tf.int32), branches)

        return self.coordinator.create_per_worker_dataset(per_worker_dataset)

    def run_steps(self, step_fn: TrainStepProtocol, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps in the update mode the options chose (`updates`).

        Workers step at once here: the optimizer's step counter counts atomically.
        """
        if hasattr(step_fn, "iterations"):  # a train step (a bare function counts nothing)
            tf_patches.count_steps_atomically(step_fn.iterations)
        self._block_steps = n
        return _to_floats(self.updates.run(step_fn, iterator, n))

    def report(self, sums: dict) -> tuple[dict, dict, dict]:
        """Synchronous: gradients averaged and dropped per update; async: staleness."""
        task_sums = {k: v for k, v in sums.items() if k not in self.updates.own_sums}
        return task_sums, *self.updates.report(sums, self._block_steps)

    def evaluate(self, step_fn: StepFn, dataset_fn: DatasetFn) -> dict[str, float]:
        """One pass over the eval data on the chief, reading the variables from the ps members."""
        loop = self._compile("eval", step_fn, self._make_eval_loop)
        return _to_floats(loop(dataset_fn(tf.distribute.InputContext())))

    def _eval_batch(self, step_fn: StepFn, batch) -> dict:
        return step_fn(batch)  # on the chief itself, not scheduled on a worker


def _parameter_server_cluster(cluster: cluster_lib.ClusterSpec | None) -> cluster_lib.ClusterSpec:
    if cluster is None or not (cluster.has_chief and cluster.num_workers and cluster.num_ps):
        found = "no `TF_CONFIG`"
        if cluster is not None:
            found = f"member types {', '.join(cluster.addresses)}"
        raise UserError(
            "A `parameter_server` run needs a `TF_CONFIG` cluster with a chief, workers and "
            f"ps (found {found}); use `python -m trainer.launch --workers=2 --ps=2 -- "
            "--strategy=parameter_server`."
        )
    return cluster


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
        mean, variance = tf_private.batch_moments(self, inputs)
        for statistic, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            delta = (batch - tf.cast(statistic.value, dtype)) * (1.0 - self.momentum)
            statistic.value.assign_add(tf.cast(delta, statistic.dtype))
        gamma = tf.cast(self.gamma, dtype) if self.scale else None
        beta = tf.cast(self.beta, dtype) if self.center else None
        outputs = keras.ops.batch_normalization(
            inputs, mean, variance, self.axis, offset=beta, scale=gamma, epsilon=self.epsilon
        )
        return tf.cast(outputs, self.compute_dtype)
