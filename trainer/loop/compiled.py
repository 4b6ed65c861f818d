"""The losses and metrics of a model the user `compile()`d, as towerflow computes them.

A model builder may return a model already compiled with `loss=`,
`loss_weights=` and `metrics=` (multi-output models and dict outputs
included); towerflow then trains with those, as `model.fit` would, under any
strategy. Two things differ from `fit`, both so that any number of replicas,
workers and partial batches add up exactly:

- The loss is Keras's own (`model.compute_loss`, with `model.losses`), scaled
  from the replica's batch to the global batch, so summing the replicas'
  gradients gives the gradient of the global batch's loss.
- Metrics are kept as sums: each step computes how much it would add to each
  metric's state (Keras's stateless metric API), the strategy sums those
  additions over replicas and steps, and the result is read once per loop.
  This is exact for every metric whose state is a sum (Keras's means, counts,
  accuracies, AUC and the confusion-matrix metrics; not e.g. a running max).
  `loss` is exact too; Keras's per-output loss trackers of a multi-output
  model (`<output>_loss`) count each replica's batch once, so they are exact
  when the batches are equal (training) and close on a short last eval batch.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from trainer.loop import objectives

_STATE = "metric_state/"  # sums keys of the metrics' state additions


def is_compiled(model: keras.Model) -> bool:
    """Whether the user compiled `model` with a loss."""
    return bool(getattr(model, "compiled", False)) and getattr(model, "loss", None) is not None


class CompiledObjective:
    """The loss and metrics of `model.compile(...)`.

    Args:
      model: the compiled model, built (its variables exist).
      features, labels: one small batch of real data; it builds the metrics'
        state (their variables are only a template: nothing is ever assigned).
      origin: names the model in messages, e.g. "`task.name` 'my.tasks:Task'".

    Raises:
      UserError: the model's named inputs are not the data's features, or a loss
        function returns one value for the whole batch instead of one per example.
    """

    name = "compiled"

    def __init__(self, model: keras.Model, features, labels, origin: str = "the model"):
        self.model = model
        _check_inputs(model, features, origin)
        outputs = model(model_inputs(model, features), training=False)
        _check_losses(model, labels, outputs, origin)
        with _scope(model, []):  # creates the metrics' variables, assigns nothing
            model.compute_loss(features, labels, outputs, training=False)
            model.compute_metrics(features, labels, outputs)
        self._state = list(model.metrics_variables)
        self._zeros = [np.zeros(v.shape, v.dtype) for v in self._state]

    def train_sums(self, model, features, labels, outputs, weights, global_batch_size: int):
        """This replica's share of the global batch's loss, and the step's sums.

        Keras's own share, as `fit` uses it: the mean over the replica's batch
        (regularisers included) divided by the replicas in sync, so the
        replicas' equal batches add up to the global batch's mean. `weights`
        None (a dataset that yields none) weighs every example 1.
        """
        if weights is None:
            weights = objectives.unit_weights(labels)
        return self._stateless(features, labels, outputs, weights, training=True)

    def eval_sums(self, features, labels, outputs, weights, examples) -> dict:
        """The eval step's sums (loss and metric state additions)."""
        return self._stateless(features, labels, outputs, weights, examples, training=False)[1]

    def _stateless(self, features, labels, outputs, weights, examples=None, training=True):
        zeros = [tf.zeros(v.shape, v.dtype) for v in self._state]
        with _scope(self.model, list(zip(self._state, zeros))) as scope:
            mean = self.model.compute_loss(
                features, labels, outputs, sample_weight=weights, training=training
            )
            self.model.compute_metrics(features, labels, outputs, sample_weight=weights)
        # Keras's mean divides the weighted sum by the rows (padding rows too) and by the
        # replicas, and adds the regularisers; they count once per real example here.
        rows = tf.cast(tf.size(weights), tf.float32)
        examples = rows if examples is None else tf.cast(examples, tf.float32)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        penalty = tf.add_n([tf.cast(x, tf.float32) for x in self.model.losses] or [0.0])
        sums = {
            "loss": (tf.cast(mean, tf.float32) * replicas - penalty) * rows + penalty * examples,
            "examples": examples,
        }
        # Keras's `metrics=` ignore sample weights, so the padding row of an empty
        # batch (see `steps.make_eval_step`) would count: such a batch adds nothing.
        real = examples > 0
        for i, (variable, zero) in enumerate(zip(self._state, zeros)):
            value = scope.get_current_value(variable)
            sums[f"{_STATE}{i}"] = zero if value is None else tf.where(real, value, zero)
        return mean, sums

    def metrics(self, sums: dict) -> dict[str, float]:
        """Keras's metric results from the summed state; `loss` and other sums per example."""
        state = [
            tf.constant(np.asarray(sums[f"{_STATE}{i}"]), v.dtype)
            for i, v in enumerate(self._state)
        ]
        with keras.StatelessScope(state_mapping=list(zip(self._state, state))):
            results = self.model.get_metrics_result()
        metrics = {name: float(value) for name, value in results.items() if np.ndim(value) == 0}
        examples = max(float(sums.get("examples", 0.0)), 1.0)
        metrics["loss"] = float(sums["loss"]) / examples
        for name, value in sums.items():  # a custom step's own sums: per-example means
            if name not in ("loss", "examples") and not name.startswith(_STATE):
                metrics[name] = float(value) / examples
        return metrics


def _scope(model: keras.Model, mapping: list) -> keras.StatelessScope:
    """A stateless scope in which the model's variables read as they are.

    Keras reads a variable that a stateless scope does not map as missing
    (regularisers fail), so every model variable maps to its current value;
    read inside a gradient tape, that value is still differentiable.
    """
    own = [(v, tf.convert_to_tensor(v.value)) for v in model.variables]
    return keras.StatelessScope(state_mapping=own + mapping)


def takes_named_inputs(model: keras.Model) -> bool:
    """Whether `model` takes a dict of named inputs (a functional model built on such a dict)."""
    try:  # a `Sequential` model not yet called has `inputs` but no `input`
        return bool(getattr(model, "inputs", None)) and isinstance(model.input, dict)
    except AttributeError:
        return False


def model_inputs(model: keras.Model, features):
    """`features` as `model` takes them: a dict cut to the model's named inputs.

    The data may carry features the model does not use (more CSV columns, an id
    kept for analysis); Keras refuses a dict with keys its functional model lacks.
    """
    if not isinstance(features, dict) or not takes_named_inputs(model):
        return features
    return {name: features[name] for name in model.input if name in features}


def _check_inputs(model: keras.Model, features, origin: str) -> None:
    """A model with named inputs must find each of them among the data's features."""
    from towerflow.errors import UserError

    if not takes_named_inputs(model):
        return
    wanted = sorted(model.input)
    if not isinstance(features, dict):
        raise UserError(
            f"{origin}: the model takes named inputs ({_names(wanted)}), and the data yields "
            f"one {type(features).__name__}; yield the features as a dict by those names."
        )
    missing = [name for name in wanted if name not in features]
    if missing:
        raise UserError(
            f"{origin}: the model's inputs {_names(missing)} are not among the data's features "
            f"({_names(sorted(features))}); make the names agree."
        )


def _check_losses(model: keras.Model, labels, outputs, origin: str) -> None:
    """Each plain loss function must give one value per example, as Keras's losses do."""
    from towerflow.errors import UserError

    losses = model.loss if isinstance(model.loss, dict | list | tuple) else [model.loss]
    if isinstance(losses, dict):
        pairs = [(fn, labels[k], outputs[k]) for k, fn in losses.items() if k in outputs]
    elif len(losses) == 1:
        pairs = [(losses[0], labels, outputs)]
    else:
        pairs = list(zip(losses, tf.nest.flatten(labels), tf.nest.flatten(outputs)))
    for fn, y, out in pairs:
        if not callable(fn) or isinstance(fn, keras.losses.Loss):
            continue  # a Keras loss (or its name) gives one value per example
        value = tf.convert_to_tensor(fn(y, out))
        rows = tf.nest.flatten(y)[0].shape[0]
        if value.shape.rank == 0 or value.shape[0] != rows:
            raise UserError(
                f"{origin}: the loss `{getattr(fn, '__name__', fn)}` returned shape "
                f"{tuple(value.shape)} for a batch of {rows}; it must return one loss per "
                f"example (shape ({rows},)): leave the mean over the batch to towerflow."
            )


def _names(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)
