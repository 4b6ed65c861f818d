"""Config checks that run before anything is built or written.

Each failure is a `UserError` naming the field, the bad value, the rule and
the fix, so a mistake never reaches TensorFlow or `model_dir`.
"""

from __future__ import annotations

import os

import ml_collections

from strategies.errors import UserError

# (field, smallest allowed value, what it means)
_MINIMUMS = (
    ("train.global_batch_size", 1, "examples per step over all replicas"),
    ("train.steps_per_loop", 0, "steps per tf.function call; 0 = auto"),
    ("train.checkpoint_every", 0, "steps between checkpoints (0 = end only)"),
    ("train.max_checkpoints", 1, "checkpoints kept"),
    ("train.epochs", 0, "passes over the training data (0 = use train.steps)"),
    ("eval.every", 0, "steps between evaluations (0 = end only)"),
    ("eval.global_batch_size", 1, "examples per eval step over all replicas"),
)


def _get(config: ml_collections.ConfigDict, dotted: str):
    value = config
    for key in dotted.split("."):
        value = value[key]
    return value


def check_config(config: ml_collections.ConfigDict) -> None:
    """Checks sizes and counts in `config`.

    Raises:
      UserError: a value below its minimum.
    """
    for field, minimum, meaning in _MINIMUMS:
        value = _get(config, field)
        if value < minimum:
            raise UserError(
                f"`{field}` ({value}) must be >= {minimum} ({meaning}); "
                f"set e.g. `--config.{field}={max(minimum, 1)}`."
            )
    if config.train.epochs == 0 and config.train.steps <= 0:
        raise UserError(
            f"`train.steps` ({config.train.steps}) must be a positive integer; "
            "set e.g. `--config.train.steps=1000`, or `train.epochs`."
        )


def check_batch(config: ml_collections.ConfigDict, strategy) -> None:
    """The global batches must split evenly over the strategy's replicas."""
    replicas = strategy.num_replicas_in_sync
    for field in ("train.global_batch_size", "eval.global_batch_size"):
        batch = _get(config, field)
        if batch % replicas:
            lower = max(replicas, batch - batch % replicas)
            raise UserError(
                f"`{field}` ({batch}) must be divisible by the {replicas} replicas of "
                f"`{strategy.name}`; use {lower} or {lower + replicas}."
            )


def total_steps(config: ml_collections.ConfigDict, spec) -> int:
    """`train.steps`, or `train.epochs` passes over the training data when set."""
    if config.train.epochs == 0:
        return config.train.steps
    if not spec.train_size:
        raise UserError(
            f"`train.epochs` ({config.train.epochs}) needs a dataset of known size, and "
            f"`{config.data.name}` has none; set `train.steps` and `train.epochs=0`."
        )
    return max(1, config.train.epochs * spec.train_size // config.train.global_batch_size)


def check_model_dir(model_dir: str) -> None:
    """`model_dir` must be a directory we can create or write.

    Raises:
      UserError: it is a file, or it (or its parent) is not writable.
    """
    if not model_dir:
        raise UserError("`--model_dir` is empty; give a directory, e.g. `--model_dir=runs/x`.")
    if os.path.exists(model_dir):
        if not os.path.isdir(model_dir):
            raise UserError(
                f"`--model_dir` '{model_dir}' is a file, not a directory; give a directory."
            )
        target = model_dir
    else:
        target = _existing_parent(model_dir)
        if not os.path.isdir(target):
            raise UserError(
                f"`--model_dir` '{model_dir}' cannot be created: '{target}' is a file; "
                "give a path under a directory."
            )
    if not os.access(target, os.W_OK | os.X_OK):
        raise UserError(
            f"`--model_dir` '{model_dir}' is not writable ('{target}' denies writes); "
            "give a directory you can write to."
        )


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
