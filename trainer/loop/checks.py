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

from towerflow import storage
from towerflow.errors import UserError
from trainer import data
from trainer.data import service_client
from trainer.layers import tables
from trainer.loop import optim, precision

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
    ("export.every_steps", 0, "steps between exports while training; 0 = not by steps"),
    ("export.every_secs", 0, "seconds between exports while training; 0 = not by time"),
    ("export.keep", 0, "export versions kept; 0 = all"),
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
    return Checked(precision.check(config.train.precision), data.settings(config.data))


def _check_scalars(config: ml_collections.ConfigDict) -> None:
    """Numbers, sizes and counts, and the settings that exclude one another."""
    _check_finite(config)
    for field, minimum, meaning in _MINIMUMS:
        value = _get(config, field)
        if value < minimum:
            raise UserError(
                f"`{field}` ({value}) must be >= {minimum} ({meaning}); "
                f"set e.g. `--config.{field}={max(minimum, 1)}`."
            )
    full_every = config.train.get("full_checkpoint_every", 0)
    if full_every < 0:
        raise UserError(
            f"`train.full_checkpoint_every` ({full_every}) must be >= 0 (steps between full "
            "checkpoints; 0 = every one full); set e.g. "
            "`--config.train.full_checkpoint_every=1000`."
        )
    _check_profile_steps(tuple(config.train.profile_steps))
    if config.data.get("follow", False) and config.data.get("service", ""):
        raise UserError(
            f"`data.follow` reads its files in the trainer, and `data.service` is "
            f"'{config.data.service}'; set `--config.data.service=''`."
        )
    if config.data.get("follow", False) and config.train.epochs:
        raise UserError(
            f"`train.epochs` ({config.train.epochs}) counts passes over fixed data, and "
            "`data.follow` trains on files as they arrive; set `--config.train.epochs=0` and "
            "`train.steps` (0: until stopped)."
        )
    _check_elastic(config)
    _check_dynamic_table(config.model)
    endless = config.train.steps == 0 and config.data.get("follow", False)
    if config.train.epochs == 0 and config.train.steps <= 0 and not endless:
        raise UserError(
            f"`train.steps` ({config.train.steps}) must be a positive integer; "
            "set e.g. `--config.train.steps=1000`, or `train.epochs`."
        )


ELASTIC_STRATEGIES = ("multi_worker",)  # whose group re-forms at another size
ELASTIC_BATCHES = ("global", "per_replica")  # `cluster.elastic.batch`: what a re-form keeps
ELASTIC_LR_SCALINGS = ("linear", "none")  # `cluster.elastic.lr_scaling`, or "module:function"


def _check_elastic(config: ml_collections.ConfigDict) -> None:
    """`cluster.elastic`: 1 <= min_workers <= max_workers, under a strategy that can re-form."""
    elastic = (config.get("cluster") or {}).get("elastic")
    if not elastic:
        return
    low, high = elastic.min_workers, elastic.max_workers
    if low < 1:
        raise UserError(
            f"`cluster.elastic.min_workers` ({low}) must be at least 1 (the fewest workers "
            "that train); set e.g. `--config.cluster.elastic.min_workers=2`."
        )
    if high and high < low:
        raise UserError(
            f"`cluster.elastic.max_workers` ({high}) must be 0 (not elastic) or at least "
            f"`min_workers` ({low}); set e.g. `--config.cluster.elastic.max_workers={low}`."
        )
    if high and config.strategy.name not in ELASTIC_STRATEGIES:
        raise UserError(
            f"elastic training (`cluster.elastic.max_workers` {high}) needs "
            f"`--strategy=multi_worker`, and `{config.strategy.name}` cannot re-form its group at "
            "another size (docs/elastic.md); use `multi_worker`, or set "
            "`--config.cluster.elastic.max_workers=0`."
        )
    for field in ("rendezvous_timeout", "cooldown_s", "max_restarts"):
        if elastic[field] < 0:
            raise UserError(
                f"`cluster.elastic.{field}` ({elastic[field]}) must be >= 0; use e.g. the "
                "value in configs/default.py."
            )
    if elastic.get("batch", "global") not in ELASTIC_BATCHES:
        raise UserError(
            f"`cluster.elastic.batch` '{elastic.batch}' must be one of "
            f"{', '.join(ELASTIC_BATCHES)} (what a group of another size keeps); set e.g. "
            "`--config.cluster.elastic.batch=per_replica`."
        )
    if high and elastic.get("batch") == "per_replica" and config.train.epochs:
        raise UserError(
            f"`train.epochs` ({config.train.epochs}) would give each group size of "
            "`cluster.elastic.batch=per_replica` another number of steps (its global batch "
            "follows the group); set `--config.train.steps` and `--config.train.epochs=0`."
        )
    scaling = elastic.get("lr_scaling", "linear")
    if scaling not in ELASTIC_LR_SCALINGS and ":" not in scaling:
        raise UserError(
            f"`cluster.elastic.lr_scaling` '{scaling}' must be one of "
            f"{', '.join(ELASTIC_LR_SCALINGS)} or 'module.path:function' (of reference_lr, "
            "reference_batch, global_batch); set e.g. "
            "`--config.cluster.elastic.lr_scaling=linear`."
        )


def _check_dynamic_table(model: ml_collections.ConfigDict) -> None:
    """The dynamic table's options of the built-in ctr model (`model.embedding=dynamic`)."""
    if model.get("embedding") != "dynamic":
        return
    eviction = model.get("eviction", "lfu")
    if eviction not in ("lfu", "lru", ""):
        raise UserError(
            f"`model.eviction` '{eviction}' is not an eviction policy; use one of lfu, lru "
            "or '' (none: a full table refuses new ids), e.g. `--config.model.eviction=lfu`."
        )
    fallback = model.get("fallback_rows", 0)
    if fallback < 0:
        raise UserError(
            f"`model.fallback_rows` ({fallback}) must be >= 0 (hashed rows for ids without "
            "a row; 0: one shared default row); set e.g. `--config.model.fallback_rows=1000`."
        )
    hashes = model.get("fallback_hashes", 2)
    if hashes < 1:
        raise UserError(
            f"`model.fallback_hashes` ({hashes}) must be >= 1 (the fallback rows an id without "
            "a row reads); set e.g. `--config.model.fallback_hashes=2`."
        )
    combiner = model.get("fallback_combiner", tables.FALLBACK_COMBINER)
    if combiner not in tables.FALLBACK_COMBINERS:
        raise UserError(
            f"`model.fallback_combiner` '{combiner}' is not a way to combine fallback rows; use "
            f"{' or '.join(tables.FALLBACK_COMBINERS)}, e.g. "
            f"`--config.model.fallback_combiner={tables.FALLBACK_COMBINER}`."
        )
    for field, example in (("sketch_width", 8192), ("sketch_depth", 2)):
        value = model.get(field, example)
        if value < 1:
            raise UserError(
                f"`model.{field}` ({value}) must be >= 1 (the count-min sketch of ids not "
                f"admitted yet); set e.g. `--config.model.{field}={example}`."
            )
    seen = model.get("seen_bits", tables.SEEN_BITS)
    if seen < 0:
        raise UserError(
            f"`model.seen_bits` ({seen}) must be >= 0 (the bits of each generation of the "
            "table's seen-filter; 0: none); set e.g. "
            f"`--config.model.seen_bits={tables.SEEN_BITS}`."
        )


def _check_profile_steps(steps: tuple) -> None:
    if not steps:
        return
    if (
        len(steps) != 2
        or not all(isinstance(s, int) for s in steps)
        or not 0 <= steps[0] < steps[1]
    ):
        raise UserError(
            f"`train.profile_steps` ({steps}) must be (start, stop), the steps to profile, "
            "with 0 <= start < stop; e.g. `--config.train.profile_steps=(200,205)`, or () "
            "for none."
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
