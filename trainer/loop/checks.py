"""Config checks that run before anything is built or written.

`check_config` checks every field that needs nothing but the config, in one
pass at start-up, and returns what the build takes from them (`Checked`).
What needs more waits for it: the batch for the replica count
(`check_batch`), the steps for the data's size (`total_steps`), `model_dir`
(`check_model_dir`); a source checks its own files as it opens them.

Each failure is a `UserError` naming the field, the bad value, the rule and
the fix, so a mistake never reaches TensorFlow or `model_dir`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import ml_collections
import tensorflow as tf

import strategies
from towerflow import storage
from towerflow.errors import UserError
from towerflow.sections import at_least
from trainer import data
from trainer.data import service_client
from trainer.loop import component, optim, precision

# `train.steps=0` with `data.follow`: a step no run reaches (the loop ends at SIGTERM).
UNTIL_STOPPED = 2**62

# (field, smallest allowed value, what it means)
_MINIMUMS = (
    ("train.global_batch_size", 1, "examples per step over all replicas"),
    ("train.steps_per_loop", 0, "steps per tf.function call; 0 = auto"),
    ("train.steps_per_iteration", 0, "steps traced into each iteration of a loop; 0 = auto"),
    ("train.checkpoint_every", 0, "steps between checkpoints (0 = end only)"),
    ("train.max_checkpoints", 1, "checkpoints kept"),
    ("train.epochs", 0, "passes over the training data (0 = use train.steps)"),
    ("train.accumulation_steps", 1, "micro-batches per update; 1 = none"),
    ("eval.every", 0, "steps between evaluations (0 = end only)"),
    ("eval.global_batch_size", 1, "examples per eval step over all replicas"),
)


def _get(config: ml_collections.ConfigDict, dotted: str):
    value = config
    for key in dotted.split("."):
        value = value[key]
    return value


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the build takes from a config that `check_config` passed.

    Attributes:
      precision: `train.precision`, a known name.
      data: how every pipeline runs (`data.autotune`, its RAM budget, `data.sharding`).
    """

    precision: str
    data: data.base.Settings


def check_config(config: ml_collections.ConfigDict) -> Checked:
    """Checks every field of `config` that needs nothing else, in one pass.

    Raises:
      UserError: a float that is not finite, a value below its minimum, an
        unknown name (precision, optimizer, schedule, sharding, data service
        mode), or settings that exclude one another.
    """
    _check_scalars(config)
    optim.check(config.optimizer)
    service_client.check(config.data)
    # Each feature's own fields (`trainer.loop.component`), under the strategy's traits.
    component.check(config, strategies.plugin(config.strategy.name).traits)
    return Checked(precision.check(config.train.precision), data.settings(config.data))


def check_minimums(config: ml_collections.ConfigDict, minimums: tuple) -> None:
    """Each (field, smallest allowed value, what it means) of `minimums` holds.

    Raises:
      UserError: a field below its minimum, with the rule and an example.
    """
    for field, minimum, meaning in minimums:
        at_least(field, _get(config, field), minimum, meaning)


def _check_scalars(config: ml_collections.ConfigDict) -> None:
    """Numbers, sizes and counts, and the settings that exclude one another."""
    _check_finite(config)
    check_minimums(config, _MINIMUMS)
    full_every = config.train.get("full_checkpoint_every", 0)
    if full_every < 0:
        raise UserError(
            f"`train.full_checkpoint_every` ({full_every}) must be >= 0 (steps between full "
            "checkpoints; 0 = every one full); set e.g. "
            "`--config.train.full_checkpoint_every=1000`."
        )
    endless = config.train.steps == 0 and config.data.get("follow", False)
    if config.train.epochs == 0 and config.train.steps <= 0 and not endless:
        raise UserError(
            f"`train.steps` ({config.train.steps}) must be a positive integer; "
            "set e.g. `--config.train.steps=1000`, or `train.epochs`."
        )


def _check_finite(config: ml_collections.ConfigDict, prefix: str = "") -> None:
    """Every float of the config (in sections, tuples and lists too) must be finite.

    A NaN or infinite rate, norm or timeout is always a typo (`1e400` parses as
    inf) and would only show as a diverged run.
    """
    for key, value in config.items():
        field = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            _check_finite(value, f"{field}.")
            continue
        items = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise UserError(
                f"`{field}` ({value}) must be finite (a value beyond about 1.8e308 "
                f"reads as inf); give e.g. the value in configs/default.py with `--config.{field}`."
            )


def check_batch(config: ml_collections.ConfigDict, strategy) -> None:
    """The global batches must split evenly over the strategy's replicas (and micro-batches)."""
    replicas = strategy.num_replicas_in_sync
    for field in ("train.global_batch_size", "eval.global_batch_size"):
        batch = _get(config, field)
        if batch % replicas:
            lower = max(replicas, batch - batch % replicas)
            raise UserError(
                f"`{field}` ({batch}) must be divisible by the {replicas} replicas of "
                f"`{strategy.name}`; use {lower} or {lower + replicas}."
            )
    micro = config.train.accumulation_steps
    parts, batch = replicas * micro, config.train.global_batch_size
    if batch % parts:
        lower = max(parts, batch - batch % parts)
        raise UserError(
            f"`train.global_batch_size` ({batch}) must be divisible by `train.accumulation_steps` "
            f"({micro}) x the {replicas} replica(s) of `{strategy.name}` ({parts}), so every "
            f"micro-batch is whole; use {lower} or {lower + parts}."
        )


def total_steps(config: ml_collections.ConfigDict, spec) -> int:
    """`train.steps`, or `train.epochs` passes over the training data when set.

    Also checks that the global batches fit the data (see `check_batch_fits`), as
    this is where the data's spec is first known.

    Raises:
      UserError: a batch that does not fit, or `train.epochs` for data of unknown size.
    """
    check_batch_fits(config, spec)
    if config.train.epochs == 0:
        return config.train.steps or UNTIL_STOPPED
    if not spec.train_size:
        raise UserError(
            f"`train.epochs` ({config.train.epochs}) needs a dataset of known size, and "
            f"`{config.data.name}` has none; set `train.steps` and `train.epochs=0`."
        )
    return max(1, config.train.epochs * spec.train_size // config.train.global_batch_size)


def check_batch_fits(config: ml_collections.ConfigDict, spec) -> None:
    """A global batch must fit in the training split (when its size is known) and in memory.

    Raises:
      UserError: `train.global_batch_size` exceeds the training split, or a global
        batch's inputs alone would take over a quarter of this machine's memory.
    """
    batch = config.train.global_batch_size
    if spec.train_size and batch > spec.train_size:
        raise UserError(
            f"`train.global_batch_size` ({batch}) is larger than the training split of "
            f"`{config.data.name}` ({spec.train_size} examples); use at most {spec.train_size}, "
            f"e.g. `--config.train.global_batch_size={min(128, spec.train_size)}`."
        )
    if spec.input_shape is None:
        return  # named features or a user's pipeline: no one shape to size a batch by
    memory = _memory_bytes()
    for field in ("train.global_batch_size", "eval.global_batch_size"):
        size = _get(config, field)
        batch_bytes = size * math.prod(spec.input_shape) * 4  # float32 inputs
        if memory and batch_bytes > memory // 4:
            fits = max(1, memory // 4 // (math.prod(spec.input_shape) * 4))
            raise UserError(
                f"`{field}` ({size}) needs {batch_bytes / 2**30:.1f} GiB for one batch's "
                f"inputs alone, over a quarter of this machine's {memory / 2**30:.1f} GiB; "
                f"use a batch well under {fits}."
            )


def _memory_bytes() -> int:
    """This machine's physical memory in bytes, or 0 where it is not known."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def check_model_dir(model_dir: str) -> None:
    """`model_dir` must be a directory we can create or write, locally or on a remote file system.

    A remote `model_dir` (a bucket, `scheme://...`) is checked through
    `tf.io.gfile` for what it is (a file, or under one); whether it may be
    written shows only when the lock is written (`trainer.loop.lock.take`), as
    object stores have no permission bits to read.

    Raises:
      UserError: it is a file, or it (or its parent) is not writable, or
        TensorFlow has no file system for its scheme.
    """
    if not model_dir:
        raise UserError("`--model_dir` is empty; give a directory, e.g. `--model_dir=runs/x`.")
    storage.check_scheme(model_dir, "--model_dir")
    if tf.io.gfile.exists(model_dir):
        if not tf.io.gfile.isdir(model_dir):
            raise UserError(
                f"`--model_dir` '{model_dir}' is a file, not a directory; give a directory."
            )
        target = model_dir
    else:
        target = _existing_parent(model_dir)
        if target is not None and not tf.io.gfile.isdir(target):
            raise UserError(
                f"`--model_dir` '{model_dir}' cannot be created: '{target}' is a file; "
                "give a path under a directory."
            )
    if storage.is_local(model_dir) and not os.access(target, os.W_OK | os.X_OK):
        raise UserError(
            f"`--model_dir` '{model_dir}' is not writable ('{target}' denies writes); "
            "give a directory you can write to."
        )


def _existing_parent(path: str) -> str | None:
    """The nearest existing directory (or file) above `path`; None past a bucket's root."""
    while path is not None and not tf.io.gfile.exists(path):
        path = storage.parent(path)
    return path
