"""Per-replica train and eval steps.

Each step runs in replica context on one replica's share of the global batch,
`(features, labels)` or `(features, labels, sample_weights)`, and returns
weighted sums (see `trainer.loop.objectives`). The loss is scaled by the global batch
size, so summing gradients over replicas gives the global-batch mean.

With gradient accumulation (`train.accumulation_steps = k`), a replica's
share is cut into k micro-batches that run one after another; their gradients
are summed locally and applied once, so a step is still one update of the
global batch (one all-reduce, one push to the parameter servers). Each
micro-batch is a step of a global batch k times smaller whose loss counts
1/k, so the summed gradient is the global batch's. Layers that look at their
batch see micro-batches: `BatchNormalization` normalises each micro-batch
and updates its moving statistics k times a step, and dropout draws a mask
per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import ml_collections
import tensorflow as tf

from strategies.transfer import GradientTransfer
from strategies.unrolled import Unroll
from towerflow.errors import UserError
from trainer.loop import compiled, objectives, optim


class TrainStep:
    """One optimizer step on one replica's batch `(x, y)`, in two halves a plugin can run apart.

    `step(batch)` is `step.apply(step.gradients(batch)[0])` and returns the
    objective's sums. A plugin that runs the halves apart (synchronous
    `parameter_server` applies on the ps members; staleness-aware async looks at
    the update between them) calls `gradients` and `apply` by name; see
    `strategies.base.SplitTrainStep`, which this class implements.

    Args:
      model, optimizer: what is trained (built inside the strategy's scope).
      objective: gives this replica's share of the loss and the step's sums (`train_sums`).
      global_batch_size: the loss is scaled by it, so replicas' gradients add up
        to the global-batch mean.
      clip_global_norm: clip the summed gradient to this norm (0: no clipping).
      jit_compile: XLA compiles the forward and backward pass; the update stays
        outside, where the strategy aggregates gradients across replicas (which
        one XLA computation on one device cannot do). XLA also needs the
        variables on the device that computes, which rules out `central_storage`.
      accumulation_steps: k > 1 runs the replica's batch as k micro-batches whose
        gradients and sums are added up before the one update (see the module
        docstring); the replica's batch must divide by k.
      transfer: a transfer that sums in the step (bfloat16 or packs,
        `strategies.transfer`) sums the gradients over replicas here; the
        optimizer applies the sum as given.
      unroll: the steps a strategy's loop traces into each iteration of its
        `while` (`strategies.unrolled`); one where None.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        objective,
        global_batch_size: int,
        clip_global_norm: float = 0.0,
        jit_compile: bool = False,
        accumulation_steps: int = 1,
        transfer: GradientTransfer | None = None,
        unroll: Unroll | None = None,
    ):
        self.model, self.optimizer, self.objective = model, optimizer, objective
        self.unroll = unroll
        self.clip_global_norm = clip_global_norm
        self.accumulation_steps = accumulation_steps
        self.transfer = transfer
        self.micro_global_batch = global_batch_size // accumulation_steps
        self.variables = model.trainable_variables  # in the order of the gradients
        self.iterations = optimizer.iterations  # the optimizer's update counter (the step)
        self._micro_gradients = self._forward_backward
        if jit_compile:
            self._micro_gradients = tf.function(self._forward_backward, jit_compile=True)

    def __call__(self, batch) -> dict:
        # Train batches are always full (endless streams, remainders dropped), so
        # unlike eval there is no empty batch to pad, and padding would skew the
        # batch statistics of layers such as BatchNormalization.
        grads, sums = self.gradients(batch)
        self.apply(grads)
        return sums

    def gradients(self, batch) -> tuple[list, dict]:
        """The gradients of `variables` on this replica's `batch`, and the objective's sums."""
        x, y, weights = unpack(batch)
        if weights is not None:  # none: every example weighs 1, and the objective adds no op
            weights = _weights(weights, y)
        return _accumulated(self._micro_gradients, (x, y, weights), self.accumulation_steps)

    def apply(self, grads: list) -> None:
        """One optimizer update from this replica's `grads` (in replica context)."""
        optimizer, variables = self.optimizer, self.variables
        # Loss-scaled gradients are clipped at the scaled norm.
        norm = self.clip_global_norm * optimizer.scale_loss(tf.constant(1.0))
        if self.transfer is None or not self.transfer.summed_by_step:
            if self.clip_global_norm:
                grads = _clip_summed(grads, norm, tf.distribute.get_replica_context())
            optimizer.apply_gradients(zip(grads, variables))
            return
        grads = self.transfer.all_reduce(grads)
        if self.clip_global_norm:
            grads, _ = tf.clip_by_global_norm(grads, norm)
        with optim.summed_by_caller(optimizer):
            optimizer.apply_gradients(zip(grads, variables))

    def _forward_backward(self, x, y, weights) -> tuple:
        model, k = self.model, self.accumulation_steps
        with tf.GradientTape() as tape:
            outputs = model(compiled.model_inputs(model, x), training=True)
            loss, sums = self.objective.train_sums(
                model, x, y, outputs, weights, self.micro_global_batch
            )
            if k > 1:
                loss /= k  # the micro-batches' gradients add up to the mean of k steps
            scaled = self.optimizer.scale_loss(loss)  # the loss itself, unless float16 scaling
        return tape.gradient(scaled, model.trainable_variables), sums


class CustomTrainStep:
    """A user task's own `train_step`, which applies its own gradients: it has no halves.

    `custom_step(model, optimizer, features, labels, weights, replica_loss)`,
    where `replica_loss(outputs)` is the objective's `(loss share, sums)`, returns
    the sums. Nothing of ours comes between its gradients and its update, so a
    plugin that runs a step's halves apart refuses it at start-up.
    """

    def __init__(
        self,
        custom_step: Callable,
        model: keras.Model,
        optimizer,
        objective,
        batch: int,
        unroll: Unroll | None = None,
    ):
        # The task's own code, converted by AutoGraph as a `tf.function`'s would be
        # (towerflow's own functions are not: `strategies.tf_patches.own_code_unconverted`).
        self.custom_step, self.global_batch_size = tf.autograph.to_graph(custom_step), batch
        self.unroll = unroll  # as `TrainStep`'s
        self.model, self.optimizer, self.objective = model, optimizer, objective
        self.variables, self.iterations = model.trainable_variables, optimizer.iterations

    def __call__(self, batch) -> dict:
        x, y, weights = unpack(batch)
        weights = _weights(weights, y)
        return self.custom_step(
            self.model, self.optimizer, x, y, weights, self._replica_loss(x, y, weights)
        )

    def _replica_loss(self, x, y, weights) -> Callable:
        model, objective, batch = self.model, self.objective, self.global_batch_size
        return lambda outputs: objective.train_sums(model, x, y, outputs, weights, batch)


def check_custom_step(
    custom_step: Callable | None, config: ml_collections.ConfigDict, transfer: GradientTransfer
) -> None:
    """A task's own `train_step` applies its own gradients: nothing of ours can come between.

    Raises:
      UserError: `train.accumulation_steps` > 1, or a gradient transfer that the step
        would make (bfloat16, packs), with a task's own `train_step`.
    """
    if custom_step is None:
        return
    task = f"`task.name` '{config.task.name}', whose own `train_step` applies its gradients"
    k = config.train.accumulation_steps
    if k > 1:
        raise UserError(
            f"`train.accumulation_steps` ({k}) cannot split the steps of {task}; set "
            "`--config.train.accumulation_steps=1`, or accumulate in your `train_step`."
        )
    if transfer.summed_by_step:
        name = config.strategy.name
        raise UserError(
            f"`strategy.{name}` sums gradients {transfer.describe()}, which cannot reach the "
            f"steps of {task} (its optimizer sums them in float32, in one pack); set "
            f"`strategy.{name}.gradient_dtype` to float32 (and `bytes_per_pack` to 0)."
        )


def _accumulated(gradients: Callable, batch: tuple, k: int) -> tuple:
    """`gradients(*batch)` over `k` micro-batches of `batch`: gradients and sums added up.

    The micro-batches run one after another (each starts once the gradients
    before it are summed), so memory holds one micro-batch's activations.
    """
    if k == 1:
        return gradients(*batch)
    grads, sums = None, None
    for i in range(k):
        part = _micro_batch(batch, i, k)
        if grads is not None:
            with tf.control_dependencies(_tensors(grads)):
                part = tf.nest.map_structure(_identity, part, expand_composites=True)
        more, more_sums = gradients(*part)
        if grads is None:
            grads, sums = list(more), more_sums
            continue
        grads = [_add(a, b) for a, b in zip(grads, more)]
        sums = tf.nest.map_structure(tf.add, sums, more_sums)
    return grads, sums


def _micro_batch(batch, i: int, k: int):
    """Rows `[i * n/k, (i + 1) * n/k)` of every tensor of `batch` (n rows each); None stays."""

    def part(tensor):
        if tensor is None:  # no weights: every example weighs 1
            return None
        rows = tensor.shape[0]  # static where the pipeline batches with a fixed size
        if rows is None:
            ragged = isinstance(tensor, tf.RaggedTensor)
            rows = tensor.nrows(out_type=tf.int32) if ragged else tf.shape(tensor)[0]
        size = rows // k
        return tensor[i * size : (i + 1) * size]

    return tf.nest.map_structure(part, batch)


def _identity(tensor):
    return None if tensor is None else tf.identity(tensor)


def _add(a, b):
    """The sum of two gradients of one variable: dense, sparse (rows listed twice) or None."""
    if a is None:
        return b
    if isinstance(a, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
        )
    return a + b


def _tensors(grads: list) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(grads, expand_composites=True) if t is not None]


def _clip_summed(grads: list, clip_norm: float, replica) -> list:
    """Clips the gradient summed over replicas, returned as equal per-replica parts.

    The optimizer sums what every replica passes it; passing total/replicas from
    each replica makes that sum the clipped total.
    """
    total = replica.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    clipped, _ = tf.clip_by_global_norm(total, clip_norm)
    return [g / replica.num_replicas_in_sync for g in clipped]


def make_eval_step(model: keras.Model, objective) -> Callable:
    """Forward pass on one replica's batch; returns the objective's sums.

    The last batch of an eval pass is short, and a replica may get no examples
    at all. Some kernels return wrong shapes for an empty batch (TF's oneDNN
    `Conv2D` on CPU), so an empty batch gets one padding row of weight 0: the
    model always sees at least one example, and the sums count only real ones.
    """

    def step(batch) -> dict:
        x, y, weights = unpack(batch)
        examples = objectives.rows(y)
        real = tf.maximum(examples, 1)
        x, y, weights = tf.nest.map_structure(
            lambda t: _pad_to(t, real), (x, y, _weights(weights, y))
        )
        weights *= tf.cast(tf.range(real) < examples, weights.dtype)  # the padding weighs 0
        outputs = model(compiled.model_inputs(model, x), training=False)
        return objective.eval_sums(x, y, outputs, weights, examples)

    return step


def unpack(batch) -> tuple:
    """`(features, labels, weights)` from a 2- or 3-tuple; weights None if absent."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            "A dataset must yield `(features, labels)` or `(features, labels, sample_weights)`; "
            f"got {type(batch).__name__} of {len(tf.nest.flatten(batch))} tensors."
        )
    return (*batch, None) if len(batch) == 2 else tuple(batch)


def _weights(weights, labels) -> tf.Tensor:
    """Per-example weights as float32: the dataset's, or 1 for every example."""
    if weights is None:
        return objectives.unit_weights(labels)
    return tf.reshape(tf.cast(weights, tf.float32), [-1])


def _pad_to(tensor, rows: tf.Tensor):
    """`tensor` with zero rows appended up to `rows` (its static inner shape kept).

    A ragged tensor gets rows of one zero value each (an empty row would make
    e.g. a mean over its values NaN, and NaN times weight 0 is still NaN); a
    sparse one gets a taller dense shape (rows without values).
    """
    if isinstance(tensor, tf.RaggedTensor):
        splits_dtype = tensor.row_splits.dtype
        missing = tf.maximum(tf.cast(rows, splits_dtype) - tensor.nrows(splits_dtype), 0)
        inner = tensor.flat_values.shape[1:]
        zeros = tf.zeros([missing, *[1] * tensor.ragged_rank, *inner], tensor.dtype)
        padding = tf.RaggedTensor.from_tensor(
            zeros, ragged_rank=tensor.ragged_rank, row_splits_dtype=splits_dtype
        )
        return tf.concat([tensor, padding], axis=0)
    if isinstance(tensor, tf.SparseTensor):
        shape = tensor.dense_shape
        taller = tf.maximum(tf.cast(rows, shape.dtype), shape[0])
        return tf.SparseTensor(tensor.indices, tensor.values, tf.concat([[taller], shape[1:]], 0))
    tensor = tf.convert_to_tensor(tensor)
    missing = tf.maximum(rows - tf.shape(tensor, out_type=tf.int32)[0], 0)
    paddings = [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1)
    return tf.pad(tensor, paddings, constant_values=tf.zeros([], tensor.dtype))
