"""Spare replicas for `parameter_server`: each update averages the first k of n workers' gradients.

    python -m trainer.launch --workers=3 --ps=1 -- --strategy=parameter_server \\
        --config.strategy.parameter_server.sync_replicas=2

TF1's `SyncReplicasOptimizer(replicas_to_aggregate=k, total_num_replicas=n)`,
rebuilt from the TensorFlow pieces it stood on and driven by the coordinator:

- On every ps member, one gradient accumulator
  (`tf.raw_ops.ResourceConditionalAccumulator`) for the variables that member
  holds: a worker pushes their gradients, flattened into one vector, tagged
  with the step they were computed at. The accumulator drops a push whose
  step is below its own (a late gradient), and hands out the aggregate once
  k pushes are in, moving its step on by one.
- On the first ps member, one queue of announced steps per worker.
- Each block of steps, the chief schedules one closure per worker and runs
  the block's steps itself, in one `tf.function`: per step, it takes the
  aggregate of each accumulator (waiting for k pushes), applies their
  average with the optimizer (on the ps devices: the gradients never reach
  the chief), then announces the next step to every worker.
- A worker reads the announced step t, computes its gradients at the
  variables of step t, pushes them tagged t, and waits for the next
  announcement: it contributes at most once to each step. A straggler's push
  arrives after step t was taken and is dropped by the accumulator: late
  gradients are never applied to a later step.

Each push also carries a count, its step and its worker (a one-hot), summed
by the accumulator with the gradients, so every update knows how many
gradients it averaged, that all of them were computed at its step, and whose
they were: the block reports these (`SyncReplicas.report`).

Each worker's gradient is that of a whole `train.global_batch_size` batch (as
in async training, and as with `SyncReplicasOptimizer`), so one update
averages k batches. The average is over the pushes in when the take runs:
exactly k when the take is waiting as the k-th arrives (as it normally is),
more if more arrived first. With several ps members, each member's variables are
averaged over the pushes that reached that member first; all of them were
computed at the update's step. Sparse gradients (embedding tables, sharded
or not) are pushed dense: right, but a table's full size per push.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf

from strategies.base import SplitTrainStep

# The sums each synchronous step adds to the task's sums (the task's metrics leave them out).
SUMS = (
    "sync_pushed_by_worker",
    "sync_applied_by_worker",
    "sync_averaged",
    "sync_min_averaged",
    "sync_wrong_step",
    "sync_most_by_one_worker",
)
_MARKS = 2  # after a push's gradients: its count (1.0), its step within the block


@dataclasses.dataclass
class _Group:
    """The variables of one ps member, and the accumulator beside them."""

    device: str
    indices: list[int]  # positions in `SplitTrainStep.variables`
    shapes: list[tf.TensorShape]
    accumulator: tf.Tensor = None

    @property
    def size(self) -> int:
        return sum(shape.num_elements() for shape in self.shapes)


class SyncReplicas:
    """Synchronous training on n workers, each update the average of the first k gradients.

    Args:
      strategy: the chief's `tf.distribute.ParameterServerStrategy`.
      coordinator: its `ClusterCoordinator`.
      step: the train step, whose halves run apart (`SplitTrainStep`).
      replicas: k, the gradients averaged per update.
      workers: n, the worker members.
    """

    def __init__(self, strategy, coordinator, step: SplitTrainStep, replicas: int, workers: int):
        self.strategy, self.coordinator, self.train_step = strategy, coordinator, step
        self.replicas, self.workers = replicas, workers
        self.step = 0  # steps taken so far by this process's accumulators
        name = f"towerflow_sync_{uuid.uuid4().hex}"  # fresh resources on the ps members per run
        self.groups = _groups(step.variables)
        for i, group in enumerate(self.groups):
            with tf.device(group.device):
                group.accumulator = tf.raw_ops.ResourceConditionalAccumulator(
                    dtype=tf.float32,
                    shape=[group.size + _MARKS + workers],
                    shared_name=f"{name}_accumulator_{i}",
                    reduction_type="SUM",
                )
        with tf.device(self.groups[0].device):
            self.queues = [
                tf.raw_ops.FIFOQueueV2(
                    component_types=[tf.int64],
                    shapes=[[]],
                    capacity=-1,
                    shared_name=f"{name}_announced_{w}",
                )
                for w in range(workers)
            ]
        with strategy.scope():  # on a ps member; not in checkpoints (it counts this run's steps)
            self.announced = tf.Variable(0, dtype=tf.int64, trainable=False, name="sync_step")
        self._work = tf.function(self._work_fn)
        self._coordinate = tf.function(self._coordinate_fn)

    def run(self, iterator, n: int) -> dict:
        """Runs `n` synchronous steps; returns the workers' sums and the block's records."""
        start, end = tf.constant(self.step, tf.int64), tf.constant(self.step + n, tf.int64)
        results = [
            self.coordinator.schedule(self._work, args=(iterator, start, end))
            for _ in range(self.workers)
        ]
        with _quiet_apply_warning():
            records = self._coordinate(start, tf.constant(n, tf.int64))
        self.coordinator.join()
        self.step += n
        sums = [result.fetch() for result in results]
        return {**tf.nest.map_structure(lambda *parts: tf.add_n(parts), *sums), **records}

    # --- on the workers ----------------------------------------------------

    def _work_fn(self, iterator, start, end) -> dict:
        """A worker's part of a block: one push per announced step, until step `end`."""
        worker = tf.cast(
            tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int32
        )
        first = self.announced.read_value()
        # A closure run again after its block ended (its worker was lost) finds the block
        # over: it computes once, pushes nothing and counts nothing.
        totals, pushes = self._push(iterator, first, start, worker, only_if=first < end)
        totals = tf.nest.map_structure(
            lambda total: total * tf.cast(first < end, total.dtype), totals
        )
        with tf.control_dependencies(pushes):
            step = tf.cond(first < end, lambda: self._wait_after(first, worker), lambda: first)
        while step < end:
            more, pushes = self._push(iterator, step, start, worker)
            totals = tf.nest.map_structure(tf.add, totals, more)
            with tf.control_dependencies(pushes):
                step = self._wait_after(step, worker)
        return totals

    def _push(self, iterator, step, start, worker, only_if=None) -> tuple[dict, list]:
        """Gradients at the variables of `step`, pushed to every accumulator tagged `step`.

        With `only_if` (a boolean tensor), they are pushed only where it holds.
        """
        with tf.control_dependencies([step]):  # the variables are read once `step` is announced
            grads, sums = self.strategy.run(self.train_step.gradients, args=(next(iterator),))
        marks = tf.concat(
            [
                [1.0, tf.cast(step - start, tf.float32)],
                tf.one_hot(worker, self.workers, dtype=tf.float32),
            ],
            0,
        )
        pushes = []
        for group in self.groups:
            parts = [_flat(grads[i], shape) for i, shape in zip(group.indices, group.shapes)]
            flat = tf.concat([*parts, marks], 0)

            def push(group=group, flat=flat) -> tf.Tensor:
                tf.raw_ops.ResourceAccumulatorApplyGradient(
                    handle=group.accumulator, local_step=step, gradient=flat
                )
                return tf.constant(True)

            if only_if is None:
                pushes.append(push())
            else:
                pushes.append(tf.cond(only_if, push, lambda: tf.constant(False)))
        sums = dict(sums)
        sums["sync_pushed_by_worker"] = tf.one_hot(worker, self.workers, dtype=tf.float32)
        return sums, pushes

    def _wait_after(self, step, worker) -> tf.Tensor:
        """The next step announced to `worker` after `step` (waits for it)."""

        def drain(queue) -> tf.Tensor:
            def newest(seen):
                waiting = tf.maximum(tf.raw_ops.QueueSizeV2(handle=queue), 1)
                got = tf.raw_ops.QueueDequeueManyV2(
                    handle=queue, n=waiting, component_types=[tf.int64]
                )[0]
                return tf.maximum(seen, tf.reduce_max(got))

            return tf.while_loop(lambda seen: seen <= step, newest, [step])[0]

        return tf.switch_case(worker, [functools.partial(drain, q) for q in self.queues])

    # --- on the chief ------------------------------------------------------

    def _coordinate_fn(self, start, n) -> dict:
        """The block's steps: take k pushes per accumulator, apply their average, announce."""
        variables = [_tf_variable(v) for v in self.train_step.variables]
        averaged = tf.TensorArray(tf.float32, size=tf.cast(n, tf.int32))
        wrong_step = tf.constant(0.0)
        most_by_one = tf.constant(0.0)
        applied_by_worker = tf.zeros([self.workers])
        for i in tf.range(n):
            grads = [None] * len(variables)
            counts = []
            for group in self.groups:
                with tf.device(group.device):
                    total = tf.raw_ops.ResourceAccumulatorTakeGradient(
                        handle=group.accumulator, num_required=self.replicas, dtype=tf.float32
                    )
                    total = tf.ensure_shape(total, [group.size + _MARKS + self.workers])
                    count, steps = total[group.size], total[group.size + 1]
                    whose = total[group.size + _MARKS :]
                    parts = tf.split(total[: group.size], [s.num_elements() for s in group.shapes])
                    for index, shape, part in zip(group.indices, group.shapes, parts):
                        grads[index] = tf.reshape(part / count, shape)
                counts.append(count)
                # Every push was made at this step: its steps add up to count x step.
                wrong_step += tf.abs(count * tf.cast(i, tf.float32) - steps)
                most_by_one = tf.maximum(most_by_one, tf.reduce_max(whose))
                if group is self.groups[0]:
                    applied_by_worker += whose
            self.strategy.run(self.train_step.apply, args=(grads,))
            # The next step is announced once the update is in every variable.
            updated = [v.read_value() for v in variables]
            with tf.control_dependencies(updated):
                self.announced.assign(start + i + 1)
                for queue in self.queues:
                    tf.raw_ops.QueueEnqueueV2(handle=queue, components=[start + i + 1])
            averaged = averaged.write(tf.cast(i, tf.int32), tf.reduce_min(tf.stack(counts)))
        averaged = averaged.stack()
        return {
            "sync_averaged": tf.reduce_sum(averaged),
            "sync_min_averaged": tf.reduce_min(averaged),
            "sync_wrong_step": wrong_step,
            "sync_most_by_one_worker": most_by_one,
            "sync_applied_by_worker": applied_by_worker,
        }


class SyncUpdates:
    """`parameter_server`'s synchronous mode with spare replicas (`sync_replicas` = k > 0).

    Builds its `SyncReplicas` (accumulators and queues on the ps members) for
    the train step it is first given; the step's halves always run apart.
    """

    own_sums = SUMS
    splits_steps = True

    def __init__(self, strategy, coordinator, replicas: int, workers: int):
        self.strategy, self.coordinator = strategy, coordinator
        self.replicas, self.workers = replicas, workers
        self._sync: SyncReplicas | None = None

    def describe(self) -> str:
        """How updates meet, for the start-up line."""
        k, n = self.replicas, self.workers
        return (
            f"synchronous with {n - k} spare worker(s): each step all {n} workers push their "
            f"gradients to accumulators on the ps members, and one update averages the first "
            f"{k}; late ones are dropped"
        )

    def run(self, step: SplitTrainStep, iterator, n: int) -> dict:
        """Runs `n` synchronous steps; returns the workers' sums and the block's records."""
        if self._sync is None:
            self._sync = SyncReplicas(
                self.strategy, self.coordinator, step, self.replicas, self.workers
            )
        return self._sync.run(iterator, n)

    def report(self, sums: dict, steps: int) -> tuple[dict, dict]:
        """The block's synchronous figures (see `report`)."""
        return report(sums, steps)


def report(sums: dict, steps: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """The block's synchronous figures: scalars for the metrics, per-worker histograms.

    Scalars: `replicas_averaged` (gradients per update, mean), `min_replicas_averaged`,
    `late_dropped` (pushes not applied, per step), `wrong_step_pushes` (applied at
    another step than computed: always 0) and `most_pushes_by_one_worker` (to one
    step: at most 1).
    """
    pushed = np.asarray(sums["sync_pushed_by_worker"])
    applied = np.asarray(sums["sync_applied_by_worker"])
    scalars = {
        "replicas_averaged": sums["sync_averaged"] / max(steps, 1),
        "min_replicas_averaged": sums["sync_min_averaged"],
        "late_dropped": float(pushed.sum() - applied.sum()) / max(steps, 1),
        "wrong_step_pushes": sums["sync_wrong_step"],
        "most_pushes_by_one_worker": sums["sync_most_by_one_worker"],
    }
    return scalars, {"pushed_by_worker": pushed, "applied_by_worker": applied}


def _groups(variables: list) -> list[_Group]:
    """The variables by ps member, in the order members first hold one."""
    groups: dict[str, _Group] = {}
    for index, variable in enumerate(variables):
        inner = _tf_variable(variable)
        group = groups.setdefault(inner.device, _Group(inner.device, [], []))
        group.indices.append(index)
        group.shapes.append(inner.shape)
    return list(groups.values())


def _tf_variable(variable) -> tf.Variable:
    return variable.value if isinstance(variable, keras.Variable) else variable


def _flat(gradient, shape: tf.TensorShape) -> tf.Tensor:
    """A gradient as one float32 vector: sparse ones made dense, a missing one zeros."""
    if gradient is None:
        return tf.zeros([shape.num_elements()], tf.float32)
    return tf.reshape(tf.cast(tf.convert_to_tensor(gradient), tf.float32), [-1])


@contextlib.contextmanager
def _quiet_apply_warning() -> Iterator[None]:
    """Silences TF's warning that a strategy method ran outside `ClusterCoordinator.schedule`.

    The chief applies the averaged gradients itself, on purpose: the update's
    ops run on the ps devices, beside the variables and the accumulators.
    """

    def keep(record: logging.LogRecord) -> bool:
        return "without using `ClusterCoordinator.schedule`" not in record.getMessage()

    logger = tf.get_logger()
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
