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
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import tensorflow as tf

from strategies import cluster as cluster_lib
from strategies import sharding
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
        self.coordinator = None
        if self.role != "evaluate":  # the evaluator is not part of the training cluster
            cluster_lib.start_up(
                self.cluster,
                self.options.get("startup_timeout_seconds", cluster_lib.STARTUP_TIMEOUT_S),
                "strategy.parameter_server.startup_timeout_seconds",
            )
        if self.role != "train":  # servers and the evaluator hold no cluster-wide strategy
            return tf.distribute.get_strategy()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster.as_dict()),  # without the evaluator: it has no server
            task_type="chief",
            task_id=0,
            rpc_layer=self.cluster.rpc_layer,
        )
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=None)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        return strategy

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
        return (
            f"variables on {self.cluster.num_ps} ps task(s) ({placement}); "
            f"{self.cluster.num_workers} workers each pull the variables and push their "
            "gradients asynchronously, scheduled by the chief"
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables go to the ps tasks; sharded layers follow the sharding policy."""
        with self.tf_strategy.scope(), sharding.policy(self.policy):
            yield

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

        def per_worker_dataset() -> tf.data.Dataset:
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return tf.switch_case(tf.cast(index, tf.int32), branches)

        return self.coordinator.create_per_worker_dataset(per_worker_dataset)

    def run_steps(self, step_fn: StepFn, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps in all, split over the workers, each applying its own updates.

        Each closure runs its share of the steps in one `tf.function`; a closure
        that a failed worker did not finish runs again on another worker.
        """
        loop = self._compile("train", step_fn, self._make_train_loop)
        workers = self.cluster.num_workers
        shares = [len(range(i, n, workers)) for i in range(min(n, workers))]
        results = [
            self.coordinator.schedule(loop, args=(iterator, tf.constant(share, tf.int64)))
            for share in shares
        ]
        self.coordinator.join()
        sums = [result.fetch() for result in results]
        return _to_floats(tf.nest.map_structure(lambda *parts: tf.add_n(parts), *sums))

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
