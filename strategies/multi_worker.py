"""`multi_worker`: synchronous all-reduce across worker processes (between-graph replication).

Workers step together, so they also stop together: SIGTERM to any of them
makes all save at one agreed step (`preemption.CoordinatedWatch`). A worker
that dies or hangs is found by TensorFlow's coordination service (its
heartbeats name a dead peer in about 11 s) and by the loop's watchdog, and
its peers stop naming it. A collective has no timeout of its own by default
(`timeout_seconds = 0`, which means none, not zero seconds; a negative one is
refused): TensorFlow keeps one sleeping thread per collective
op for the whole timeout, which grows the thread count with the step rate.
Before the TensorFlow strategy starts, every member waits (boundedly, saying
for whom) until the other members of `TF_CONFIG` answer (`cluster.start_up`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from strategies import mirrored, tf_patches, transfer
from strategies.base import Strategy, Traits
from strategies.cluster import membership, preemption, tf_start
from strategies.cluster import tf_config as cluster_lib
from strategies.options import MultiWorkerOptions
from strategies.registry import register
from towerflow.errors import UserError

# `strategy.multi_worker.implementation`, upper case, names one of its members.
_IMPLEMENTATION = tf.distribute.experimental.CommunicationImplementation


@register("multi_worker")
class MultiWorker(Strategy, options=MultiWorkerOptions):
    """Synchronous replicas in every worker of a `TF_CONFIG` cluster, gradients all-reduced."""

    traits = Traits(gradient_transfer=True)
    _gather_fn = None  # the traced all-reduce of `_gather`, made on first use

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        cluster = cluster_lib.from_env()
        self.membership = membership.Membership(
            cluster,
            gather=self._gather if cluster else None,
            watch=self._coordinated_watch if cluster else None,
        )
        if self.membership.role == "evaluate":  # the sidecar evaluator is not in the collective
            return tf.distribute.get_strategy()
        if cluster and cluster.num_ps:
            raise UserError(
                f"`TF_CONFIG` lists {cluster.num_ps} ps members, which `multi_worker` does "
                "not use; use `--strategy=parameter_server`, or drop the ps job."
            )
        # Checked first: a bad option fails at once.
        sent = transfer.from_options(self.options, "multi_worker")
        self.traits = dataclasses.replace(self.traits, transfer=sent)
        options = self._communication_options()
        if not cluster:
            return tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=self._resolver(), communication_options=options
            )
        timeout = self.options.startup_timeout_seconds
        setting = "strategy.multi_worker.startup_timeout_seconds"
        cluster_lib.start_up(cluster, timeout, setting)
        with tf_start.bounded(timeout, setting, cluster.member_name):
            return tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=self._resolver(), communication_options=options
            )

    def _resolver(self):
        """The training cluster without the evaluator, which is not part of the collective."""
        cluster = self.membership.cluster
        if not cluster:  # one local worker; TensorFlow's own reading would fail on a blank one
            return tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.as_dict()),
            task_type=cluster.task_type,
            task_id=cluster.task_index,
            rpc_layer=cluster.rpc_layer,
        )

    def _communication_options(self) -> tf.distribute.experimental.CommunicationOptions:
        # TensorFlow starts one detached thread per collective op that sleeps for the
        # whole timeout: any timeout makes the thread count grow with the step rate.
        # Without one, a dead or hung peer is still found by the coordination service's
        # heartbeats and the loop's watchdog. (`MultiWorkerOptions` checked the values.)
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.traits.transfer.bytes_per_pack,
            timeout_seconds=float(self.options.timeout_seconds) or None,  # 0: None, no timeout
            implementation=_IMPLEMENTATION[self.options.implementation.upper()],
        )

    def scope(self) -> contextlib.AbstractContextManager:
        """The strategy's scope, where layer state updated in a step is averaged over replicas."""
        return mirrored.replica_state_averaged(self.tf_strategy)

    def _coordinated_watch(self) -> preemption.CoordinatedWatch:
        """Every worker saves at the same step when any of them gets SIGTERM."""
        return preemption.CoordinatedWatch(self.tf_strategy.cluster_resolver)

    def _gather(self, value: int) -> list[int]:
        """Every replica's `value`, in replica order (the chief's first): one all-reduce.

        Each replica puts its worker's value at its own place in a vector that
        the all-reduce sums, so every worker sees every worker's value.
        """
        if self._gather_fn is None:
            replicas = self.num_replicas_in_sync

            def place(v):
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                return tf.one_hot(replica, replicas, dtype=tf.int64) * v

            @tf.function  # one collective; run eagerly, TensorFlow warns of its overhead
            def gather(v):
                return self.reduce("sum", self.tf_strategy.run(place, args=(v,)), axis=None)

            self._gather_fn = gather
        return [int(v) for v in self._gather_fn(tf.constant(value, tf.int64))]

    @property
    def communication(self) -> str:
        if self.membership.role == "evaluate":
            return "none: a sidecar evaluator reads checkpoints from model_dir"
        workers = tf_patches.worker_count(self.tf_strategy)  # what TF_CONFIG resolved to
        return (
            f"gradients all-reduced across {self.num_replicas_in_sync} replicas in "
            f"{workers} worker process(es) each step ({self.options.implementation}"
            f" collectives, {self._timeout_text()})"
        )

    def _timeout_text(self) -> str:
        timeout = self.options.timeout_seconds
        return f"timeout {timeout:g} s" if timeout else "no per-collective timeout"
