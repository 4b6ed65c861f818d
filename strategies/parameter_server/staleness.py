"""Staleness-aware asynchronous training for `parameter_server`.

    python -m trainer.launch --workers=3 --ps=1 -- --strategy=parameter_server \\
        --config.strategy.parameter_server.staleness=scale

An asynchronous update is *stale* by the updates other workers applied
between this worker's read of the variables and its own update. A counter
on a ps member counts updates: a worker reads it before its step and again
just before it applies, and the difference is the update's staleness. Each
block reports a histogram of it and its mean (TensorBoard: `staleness`,
`staleness_mean`).

`strategy.parameter_server.staleness` says what to do with a stale update:

- `none` (the default): apply it as it is; only record it.
- `scale`: divide its gradient by 1 + staleness. For `sgd` and `momentum`
  that divides the update's learning rate (staleness-aware async SGD, Zhang
  et al. 2016, with 1 + s so that a fresh update keeps its rate). Adam's
  update does not scale with the gradient: there it damps the stale
  gradient's share of the moment estimates instead.
- `drop_above=N`: discard an update staler than N (the optimizer does not
  see it, and the step counter does not move).

`strategy.parameter_server.warmup_steps` runs the job's first steps on one
worker alone (no staleness) before the others join. `AsyncUpdates` is the
plugin's runner for this mode (`sync.SyncUpdates` is the other one).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from strategies.base import SplitTrainStep, TrainStepProtocol
from strategies.parameter_server.units import UnitRunner
from strategies.units import REPEATED, UnitStream
from towerflow.errors import UserError

BUCKETS = 32  # staleness 0, 1, ..., 30, and 31 or more
MODES = ("none", "scale", "drop_above=N")
# The sums each async step adds to the task's sums (the task's metrics leave them out).
SUMS = ("staleness_histogram", "staleness_sum", "stale_dropped")


@dataclasses.dataclass(frozen=True)
class Staleness:
    """What to do with a stale update: "none", "scale" or "drop_above" (with `limit`)."""

    mode: str = "none"
    limit: int = 0

    @classmethod
    def parse(cls, text: str) -> Staleness:
        """`strategy.parameter_server.staleness`, e.g. "scale" or "drop_above=4".

        Raises:
          UserError: anything else, in one line.
        """
        value = str(text).strip()
        if value in ("none", "scale"):
            return cls(value)
        name, _, limit = value.partition("=")
        if name == "drop_above" and limit.strip().isdigit():
            return cls("drop_above", int(limit))
        raise UserError(
            f"Unknown `strategy.parameter_server.staleness` '{text}'; known: "
            f"{', '.join(MODES)} (N >= 0 updates); e.g. "
            "`--config.strategy.parameter_server.staleness=drop_above=4`."
        )

    def describe(self) -> str:
        """One phrase for the start-up line."""
        if self.mode == "scale":
            return "stale gradients divided by 1 + staleness"
        if self.mode == "drop_above":
            return f"updates staler than {self.limit} dropped"
        return ""


class AsyncUpdates:
    """`parameter_server`'s asynchronous mode: each worker applies its own updates as it goes.

    A block's steps are split over the workers, one closure each; each runs
    its share in one `tf.function`, each step applying its own update, and a
    closure that a failed worker did not finish runs again on another worker.
    The first `warmup_steps` steps of the job run on one worker alone. Every
    update's staleness is recorded (and acted on, as `policy` says).

    Args:
      strategy: the chief's `tf.distribute.ParameterServerStrategy`.
      coordinator: its `ClusterCoordinator`.
      policy: what to do with a stale update.
      warmup_steps: the job's first steps, run on one worker alone.
      workers: the worker members.
    """

    own_sums = (*SUMS, REPEATED)

    def __init__(self, strategy, coordinator, policy: Staleness, warmup_steps: int, workers: int):
        self.strategy, self.coordinator = strategy, coordinator
        self.policy, self.warmup_steps, self.workers = policy, warmup_steps, workers
        self._updates = None  # the cluster's update counter, on a ps member; made on first use
        self._loops: dict = {}  # train step -> its traced loop
        self._units = UnitRunner(strategy, coordinator, workers)  # for a `UnitStream`

    @property
    def splits_steps(self) -> bool:
        """Whether the step's halves run apart (any policy but `none`)."""
        return self.policy.mode != "none"

    def describe(self) -> str:
        """How updates meet, for the start-up line."""
        how = [
            f"{self.workers} workers each pull the variables and push their gradients "
            "asynchronously, scheduled by the chief; staleness recorded",
            self.policy.describe(),
        ]
        if self.warmup_steps:
            how.append(f"the first {self.warmup_steps} steps on one worker")
        return ", ".join(filter(None, how))

    def run(self, step: TrainStepProtocol, iterator, n: int) -> dict:
        """Runs `n` steps split over the workers; returns their sums and the staleness records.

        `iterator` may be a `UnitStream`: then each of its units is one closure,
        on whichever worker is free (`strategies.parameter_server.units`).
        """
        self._make_counter()
        if isinstance(iterator, UnitStream):
            if step not in self._loops:
                self._loops[step] = recorded_step(self.strategy, step, self.policy, self._updates)
            return self._units.run(self._loops[step], step, iterator, n)
        if step not in self._loops:
            self._loops[step] = make_loop(self.strategy, step, self.policy, self._updates)
        loop = self._loops[step]
        alone = min(n, max(0, self.warmup_steps - self._steps_done(step)))
        results = []
        if alone:  # warm-up: one worker, no staleness; the others join after it
            results.append(self.coordinator.schedule(loop, args=(iterator, _int64(alone))))
            self.coordinator.join()
        rest = n - alone
        shares = [len(range(i, rest, self.workers)) for i in range(min(rest, self.workers))]
        results += [self.coordinator.schedule(loop, args=(iterator, _int64(s))) for s in shares]
        self.coordinator.join()
        sums = [result.fetch() for result in results]
        return tf.nest.map_structure(lambda *parts: tf.add_n(parts), *sums)

    def report(self, sums: dict, steps: int) -> tuple[dict, dict]:
        """The block's staleness (see `report`), and the records a lost worker made repeat."""
        scalars, histograms = report(sums, steps, self.policy)
        if REPEATED in sums:
            scalars[REPEATED] = sums[REPEATED]
        return scalars, histograms

    def _make_counter(self) -> None:
        if self._updates is None:
            with self.strategy.scope():  # on a ps member; counts this run's updates
                self._updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="updates")

    def _steps_done(self, step: TrainStepProtocol) -> int:
        """The job's step: the optimizer's counter, else the updates this run counted."""
        return int((step.iterations if isinstance(step, SplitTrainStep) else self._updates).numpy())


def _int64(value: int) -> tf.Tensor:
    return tf.constant(value, tf.int64)


def recorded_step(
    strategy: tf.distribute.Strategy, step_fn: TrainStepProtocol, policy: Staleness, updates
):
    """One asynchronous step that records its update's staleness.

    `updates` is the cluster's update counter (an int64 variable on a ps
    member). Under `none` the step runs as it always did, and the counter
    moves once it is done; otherwise the step's halves run apart, with the
    policy between them. Returns the step's sums plus `staleness_histogram`,
    `staleness_sum` and `stale_dropped`.
    """
    if policy.mode == "none":
        one_step = _whole_step(strategy, step_fn, updates)
    else:
        one_step = _split_step(strategy, step_fn, policy, updates)

    def with_records(batch) -> dict:
        sums, stale, dropped = one_step(batch)
        bucket = tf.cast(tf.minimum(stale, BUCKETS - 1), tf.int32)
        return {
            **sums,
            "staleness_histogram": tf.one_hot(bucket, BUCKETS, dtype=tf.float32),
            "staleness_sum": tf.cast(stale, tf.float32),
            "stale_dropped": dropped,
        }

    return with_records


def make_loop(
    strategy: tf.distribute.Strategy, step_fn: TrainStepProtocol, policy: Staleness, updates
):
    """A worker's loop of n asynchronous steps (`recorded_step`); returns their sums."""
    with_records = recorded_step(strategy, step_fn, policy, updates)

    @tf.function
    def loop(iterator, n):
        totals = with_records(next(iterator))
        for _ in tf.range(n - 1):
            totals = tf.nest.map_structure(tf.add, totals, with_records(next(iterator)))
        return totals

    return loop


def _whole_step(strategy: tf.distribute.Strategy, step_fn: TrainStepProtocol, updates):
    """The step as it always ran (`none`); the counter moves once it is done."""

    def whole_step(batch) -> tuple[dict, tf.Tensor, tf.Tensor]:
        read = updates.read_value()
        with tf.control_dependencies([read]):  # the step reads the variables after it
            sums = strategy.run(step_fn, args=(batch,))
        with tf.control_dependencies(tf.nest.flatten(sums)):
            stale = updates.assign_add(1) - 1 - read
        return sums, stale, tf.constant(0.0)

    return whole_step


def _split_step(
    strategy: tf.distribute.Strategy, step_fn: TrainStepProtocol, policy: Staleness, updates
):
    """The step's halves apart, with the staleness policy between them."""

    def split_step(batch) -> tuple[dict, tf.Tensor, tf.Tensor]:
        read = updates.read_value()
        with tf.control_dependencies([read]):
            grads, sums = strategy.run(step_fn.gradients, args=(batch,))
        present = [t for t in tf.nest.flatten(grads, expand_composites=True) if t is not None]
        with tf.control_dependencies(present):
            stale = updates.read_value() - read
        factor = 1.0 / (1.0 + tf.cast(stale, tf.float32)) if policy.mode == "scale" else 1.0

        def scaled_apply(grads: list, factor) -> None:
            # Scaled inside the replica, where the strategy's reduction finds the device.
            step_fn.apply([_scaled(g, factor) for g in grads])

        def apply() -> tf.Tensor:
            with tf.control_dependencies([updates.assign_add(1)]):
                strategy.run(scaled_apply, args=(grads, factor))
            return tf.constant(0.0)

        if policy.mode != "drop_above":
            return sums, stale, apply()
        dropped = tf.cond(stale <= policy.limit, apply, lambda: tf.constant(1.0))
        return sums, stale, dropped

    return split_step


def report(sums: dict, steps: int, policy: Staleness) -> tuple[dict, dict]:
    """The block's staleness: mean (and updates dropped) as scalars, the histogram."""
    histogram = np.asarray(sums["staleness_histogram"])
    scalars = {"staleness_mean": sums["staleness_sum"] / max(steps, 1)}
    if policy.mode == "drop_above":
        scalars["stale_dropped"] = sums["stale_dropped"]
    return scalars, {"staleness": histogram}


def _scaled(gradient, factor):
    """`gradient` times `factor` (a float factor is 1: the gradient as it is)."""
    if gradient is None or isinstance(factor, float):
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)
