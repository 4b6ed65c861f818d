"""Progressive validation: each batch of the stream is scored as the model stands, then trained on.

Test-then-train, as online teams judge a model: before a batch's update, the
model's inference forward (`training=False`, the eval step) scores it, and
the eval sums (loss, weight, examples, correct, the AUC's score histograms)
go into a *window*, a ring of the last `slots` global batches' sums held in
variables. After a block, the window's sums give the objective's metrics
over the last `slots` batches (`progressive_loss`, `progressive_auc`, ...,
and `progressive_examples`, the examples they cover), with the same
histograms as a plain evaluation: so with a learning rate of 0 they equal
an evaluation of the same records.

`eval.window_examples` is rounded up to whole global batches
(`slots_for`). The ring is written in the step, by every strategy:

- synchronous replicas (`mirrored`, `multi_worker`, ...) each hold part of
  the global batch: the step all-reduces its sums (one small all-reduce a
  step), and the first replica's write counts (`ONLY_FIRST_REPLICA`), so
  every copy of the ring holds the global batch's sums;
- asynchronous `parameter_server` workers write the ring on the ps members
  as their steps come. Each write takes the next batch number from a counter
  there (`assign_add`, then a read: two workers writing at once may, rarely,
  read the same number; the batch that took a number one of them skipped is
  then left out, and `progressive_examples` shows the window one batch short).

The ring is in the checkpoint (`Window` is a `tf.Module`), so a resumed run
goes on with its window.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_collections
import numpy as np
import tensorflow as tf

from strategies.base import SplitTrainStep, TrainStepProtocol
from towerflow.errors import UserError

PREFIX = "progressive_"  # the windowed metrics' names: `progressive_loss`, `progressive_auc`, ...


def check(config: ml_collections.ConfigDict) -> None:
    """`eval.progressive` needs a stream that follows files and a window of 1 example or more.

    Raises:
      UserError: progressive validation without `data.follow`, or a window below 1 example.
    """
    if not config.eval.get("progressive", False):
        return
    if not config.data.get("follow", False):
        raise UserError(
            "`eval.progressive` scores the stream of `data.follow` before training on it, and "
            "`data.follow` is False; set `--config.data.follow=True` (with `data.files`), or "
            "`--config.eval.progressive=False`."
        )
    window = config.eval.window_examples
    if window < 1:
        raise UserError(
            f"`eval.window_examples` ({window}) must be at least 1 (the examples the "
            "progressive metrics cover, rounded up to whole global batches); set e.g. "
            "`--config.eval.window_examples=100000`."
        )


def slots_for(window_examples: int, global_batch: int) -> int:
    """The global batches a window of `window_examples` holds: rounded up to a whole batch."""
    return max(1, math.ceil(window_examples / global_batch))


class Window(tf.Module):
    """The eval sums of the last `slots` global batches, in variables of the strategy's scope.

    Create it inside `strategy.scope()`. `write(sums)` runs in the step
    (replica context); `sums()` reads the window after a block.

    Args:
      spec: the eval step's sums, `{name: tf.TensorSpec}` (float32, any shape);
        see `sums_spec`.
      slots: the global batches the window holds (`slots_for`).
    """

    def __init__(self, spec: dict[str, tf.TensorSpec], slots: int):
        super().__init__(name="progressive_window")
        self.slots = slots
        self._names = sorted(spec)
        self._shapes = [tuple(spec[name].shape) for name in self._names]
        width = sum(math.prod(shape) for shape in self._shapes)
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA  # every replica writes the same
        self.ring = tf.Variable(
            tf.zeros([slots, width]), trainable=False, aggregation=first, name="sums"
        )
        # The batch number each slot holds (-1: none yet), and the batches written.
        self.numbers = tf.Variable(
            tf.fill([slots], tf.constant(-1, tf.int64)),
            trainable=False,
            aggregation=first,
            name="numbers",
        )
        self.written = tf.Variable(
            tf.constant(0, tf.int64), trainable=False, aggregation=first, name="written"
        )

    def write(self, sums: dict[str, tf.Tensor]) -> None:
        """Puts one step's eval `sums` (this replica's part of the batch) in the next slot."""
        row = tf.concat([tf.reshape(tf.cast(sums[n], tf.float32), [-1]) for n in self._names], 0)
        replica = tf.distribute.get_replica_context()
        if replica.num_replicas_in_sync > 1:  # each replica scored its part of the global batch
            row = replica.all_reduce(tf.distribute.ReduceOp.SUM, row)
        number = self.written.assign_add(1) - 1
        slot = tf.math.floormod(number, self.slots)[None]
        self.ring.scatter_update(tf.IndexedSlices(row[None], slot))
        self.numbers.scatter_update(tf.IndexedSlices(number[None], slot))

    def sums(self) -> dict[str, np.ndarray | float]:
        """The window's sums (scalars as floats), over the newest `slots` batches written."""
        numbers = self.numbers.numpy()
        held = (numbers >= 0) & (numbers > numbers.max() - self.slots)  # -1: never written
        total = self.ring.numpy()[held].sum(axis=0, dtype=np.float64)
        sums, start = {}, 0
        for name, shape in zip(self._names, self._shapes):
            size = math.prod(shape)
            part = total[start : start + size].reshape(shape)
            sums[name] = float(part) if not shape else part
            start += size
        return sums

    def metrics(self, objective_metrics: Callable[[dict], dict]) -> dict[str, float]:
        """The objective's metrics over the window, as `progressive_<name>`, and its examples."""
        sums = self.sums()
        metrics = {f"{PREFIX}{name}": value for name, value in objective_metrics(sums).items()}
        metrics[f"{PREFIX}examples"] = sums.get("examples", 0.0)
        return metrics


def sums_spec(eval_step: Callable, batch_spec) -> dict[str, tf.TensorSpec]:
    """The eval step's sums for batches of `batch_spec` (a dataset's `element_spec`), traced.

    Traced only: nothing runs, so it may be called where the model's variables
    live elsewhere (on ps members).
    """
    traced = tf.function(eval_step).get_concrete_function(batch_spec)
    return {
        name: tf.TensorSpec(tensor.shape, tensor.dtype)
        for name, tensor in traced.structured_outputs.items()
    }


class ProgressiveStep:
    """A train step whose every batch is first scored into a `Window`: test, then train.

    `step(batch)` scores the batch with `eval_step` (the model as it stands,
    `training=False`), writes its sums into `window`, then runs `inner(batch)`,
    whose sums it returns. The inner step's update comes after the scoring:
    both touch the model's variables, which orders them in the traced step.
    `wrap` gives a `ProgressiveSplitStep` for a step with halves.
    """

    def __init__(self, inner: TrainStepProtocol, eval_step: Callable, window: Window):
        self.inner, self.eval_step, self.window = inner, eval_step, window
        self.variables, self.iterations = inner.variables, inner.iterations
        self.unroll = getattr(inner, "unroll", None)  # what the inner step asks of a loop

    def __call__(self, batch) -> dict:
        self.score(batch)
        return self.inner(batch)

    def score(self, batch) -> None:
        """Writes `batch`'s eval sums, as the model stands, into the window."""
        self.window.write(self.eval_step(batch))


class ProgressiveSplitStep(ProgressiveStep):
    """A `ProgressiveStep` of a step with halves: scored in `gradients`, before they are taken."""

    def gradients(self, batch) -> tuple[list, dict]:
        """Scores `batch` into the window, then the inner step's gradients and sums."""
        self.score(batch)
        return self.inner.gradients(batch)

    def apply(self, grads: list) -> None:
        """The inner step's update."""
        self.inner.apply(grads)


def wrap(inner: TrainStepProtocol, eval_step: Callable, window: Window) -> ProgressiveStep:
    """`inner` scoring each batch into `window` first; a step with halves keeps its halves."""
    if isinstance(inner, SplitTrainStep):
        return ProgressiveSplitStep(inner, eval_step, window)
    return ProgressiveStep(inner, eval_step, window)
