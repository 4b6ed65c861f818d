"""The built-in components' config, declared once: one dataclass per section (or part of one).

Each built-in component (`trainer.loop.features`) names its `Section` here;
`configs/default.py` builds those fields from them, so every default is
written here only, and the configuration reference reads the comments beside
the fields. At start-up each component's section is read through its
declaration (`towerflow.sections.Section.read`): the types, then the rules of
its `__post_init__`, each failure one line naming the field. Rules that need
another section or the strategy stay in the component's `check`.

This module imports no TensorFlow, so a config file may import it.
"""

from __future__ import annotations

import dataclasses

from towerflow.errors import UserError
from towerflow.sections import Section, at_least

ELASTIC_BATCHES = ("global", "per_replica")  # `cluster.elastic.batch`: what a re-form keeps
ELASTIC_LR_SCALINGS = ("linear", "none")  # `cluster.elastic.lr_scaling`, or "module:function"
_ELASTIC_COUNTS = (
    ("rendezvous_timeout", "seconds to wait for members below `min_workers`"),
    ("cooldown_s", "seconds out after a member's first failure"),
    ("max_restarts", "times a lost member is started again"),
)


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """`cluster.elastic`.

    Elastic `multi_worker` (docs/elastic.md): a lost worker makes the others save the step
    they all completed and re-form without it; one that returns is admitted at a block
    boundary. `python -m trainer.launch --workers=MIN:MAX` sets `min_workers` and `max_workers`.
    """

    min_workers: int = 1  # fewest workers the job trains with (>= 1)
    max_workers: int = 0  # most workers admitted; 0 = not elastic
    # Seconds the job waits, below `min_workers`, for members to come back; then it stops
    # with one line naming the missing ones (the state saved).
    rendezvous_timeout: float = 60.0
    # Times a lost member is started again (after a cool-down that doubles with each
    # failure, from `cooldown_s` seconds); then it stays out.
    max_restarts: int = 3
    cooldown_s: float = 5.0  # seconds out after a member's first failure
    # What a group of another size keeps: "global" (the global batch: each replica's batch
    # grows or shrinks, the same trajectory at every size) or "per_replica" (the per-replica
    # batch of the full group, `train.global_batch_size` over `max_workers` members' replicas:
    # the global batch is that times the replicas of the group, the learning rate scaled).
    batch: str = "global"
    # `batch=per_replica`: the learning rate of a group whose global batch differs from the full
    # group's: "linear" (`optimizer.learning_rate` x global batch / the full group's), "none",
    # or "module.path:function" of (reference_lr, reference_batch, global_batch) -> the rate.
    lr_scaling: str = "linear"

    def __post_init__(self):
        low, high = self.min_workers, self.max_workers
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
        for field, meaning in _ELASTIC_COUNTS:
            at_least(f"cluster.elastic.{field}", getattr(self, field), 0, meaning)
        if self.batch not in ELASTIC_BATCHES:
            raise UserError(
                f"`cluster.elastic.batch` '{self.batch}' must be one of "
                f"{', '.join(ELASTIC_BATCHES)} (what a group of another size keeps); set e.g. "
                "`--config.cluster.elastic.batch=per_replica`."
            )
        if self.lr_scaling not in ELASTIC_LR_SCALINGS and ":" not in self.lr_scaling:
            raise UserError(
                f"`cluster.elastic.lr_scaling` '{self.lr_scaling}' must be one of "
                f"{', '.join(ELASTIC_LR_SCALINGS)} or 'module.path:function' (of reference_lr, "
                "reference_batch, global_batch); set e.g. "
                "`--config.cluster.elastic.lr_scaling=linear`."
            )


@dataclasses.dataclass(frozen=True)
class FollowOptions:
    """`data`: training on the files of `train_files` as they keep arriving (docs/online.md).

    tfrecord / csv only. Each record once, files in arrival order; which are done is in
    every checkpoint.
    """

    # tfrecord / csv: train on the files of `train_files` as they keep arriving (docs/online.md):
    # each record once, files in arrival order (modification time, then name) whatever their
    # names, unshuffled; which files are done is saved in every checkpoint. A file counts once
    # its base name starts with neither "." nor "_" (write it so, then rename it into place).
    # With `train.steps=0` training goes on until stopped (SIGTERM saves and exits). Under
    # one_device, mirrored or multi_worker (every worker reads every file, keeps its share of
    # each global batch); parameter_server is refused.
    follow: bool = False
    follow_poll_secs: float = 1.0  # data.follow: seconds between looks for new files
    # data.follow: seconds (>= 0) a remainder short of a global batch waits for more records
    # before it trains as one step padded with records of weight 0 (0: at once)
    follow_max_wait_secs: float = 60.0
    # data.follow: files (> 0) the checkpoint names as trained beyond its watermark; a file that
    # lands older (by modification time) than the last this many trained is refused in one line
    follow_horizon_files: int = 10_000
    # data.follow: a file that marks its directory complete, e.g. "_SUCCESS" as Spark and Hive
    # write last: files count only once it lands ("" = no marker; needs a wildcard directory)
    follow_marker: str = ""


@dataclasses.dataclass(frozen=True)
class WarmStartOptions:
    """`train`: a new run started from another run's variables (docs/online.md)."""

    # Start a new run from another run's variables (docs/online.md): its `model_dir` (newest
    # checkpoint) or one checkpoint; only when this model_dir has no checkpoint (a resume wins).
    warm_start: str = ""
    # A regular expression of the variable names loaded (e.g. "embedding": the tables); "" = all.
    warm_start_include: str = ""


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """`train`: a TensorBoard profile of chosen steps."""

    # (start, stop): a TensorBoard profile of these steps on the chief, into model_dir/train
    # (the Profile tab; `pip install "towerflow[profile]"`), e.g. (200, 205); () = none.
    profile_steps: tuple[int, ...] = ()

    def __post_init__(self):
        steps = self.profile_steps
        if steps and (len(steps) != 2 or not 0 <= steps[0] < steps[1]):
            raise UserError(
                f"`train.profile_steps` ({steps}) must be (start, stop), the steps to profile, "
                "with 0 <= start < stop; e.g. `--config.train.profile_steps=(200,205)`, or () "
                "for none."
            )


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """`export`.

    SavedModels written while training, for a server that follows the newest (docs/online.md):
    each goes to model_dir/export/<step>/ (TF Serving's layout), written under a hidden name
    and renamed into place when complete; the end-of-training export (`train.export`) is then
    a version too. Both `every_steps` and `every_secs` 0: only that end-of-training export, at
    model_dir/export itself.
    """

    every_steps: int = 0  # steps between exports (0 = not by steps)
    every_secs: float = 0.0  # seconds between exports, checked after each block (0 = not by time)
    keep: int = 5  # newest versions kept in model_dir/export (0 = all)

    def __post_init__(self):
        at_least("export.every_steps", self.every_steps, 0, "steps between exports; 0 = none")
        at_least("export.every_secs", self.every_secs, 0, "seconds between exports; 0 = none")
        at_least("export.keep", self.keep, 0, "export versions kept; 0 = all")


@dataclasses.dataclass(frozen=True)
class ProgressiveOptions:
    """`eval`: progressive validation of the followed stream (docs/progressive.md)."""

    # Score each batch of `data.follow` before it trains on it (test, then train): the
    # `progressive_*` metrics of each block (docs/progressive.md).
    progressive: bool = False
    # eval.progressive: the examples its metrics cover, rounded up to whole global batches.
    window_examples: int = 100_000


# The built-in components' names (`trainer.loop.features`) -> where their fields sit.
BUILTIN = {
    "follow": Section("data", FollowOptions, shared=True),
    "elastic": Section("cluster.elastic", ElasticOptions),
    "exports": Section("export", ExportOptions),
    "profile": Section("train", ProfileOptions, shared=True),
    "warm_start": Section("train", WarmStartOptions, shared=True),
    "progressive": Section("eval", ProgressiveOptions, shared=True),
}
