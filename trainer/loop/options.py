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


EMBEDDINGS = ("hashed", "dynamic")  # `model.embedding`: the ctr model's table kinds
EVICTIONS = ("lfu", "lru", "")  # `model.eviction`; "" = none: a full table refuses new ids
FALLBACK_COMBINERS = ("mean", "sum")  # `model.fallback_combiner`


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """`model`: the embedding table of the built-in `ctr` model (configs/ctr.py).

    hashed: a `ShardedEmbedding` of `model.vocab_size` rows; dynamic: a `DynamicEmbedding`
    (`trainer.layers`), a row per admitted raw id (docs/recommendation.md). The dynamic
    table's defaults are `DynamicEmbedding`'s own, but `capacity` (0: `model.vocab_size`).
    """

    # hashed: a `ShardedEmbedding` of `vocab_size` rows; dynamic: a `DynamicEmbedding` (a row
    # per admitted raw id, `trainer.layers.tables`) with the options below.
    embedding: str = "hashed"
    capacity: int = 0  # dynamic: most rows held (0: `vocab_size`); evicts when full
    min_count: int = 1  # dynamic: lookups an id needs before it gets its own row
    ttl_steps: int = 0  # dynamic: free rows (and forget counts) of ids unseen this long; 0: keep
    # Keys which raw ids share a row (hashed: Keras's `Hashing` salted by it, 0: unsalted;
    # dynamic: its fallback rows) and each id's initial row (dynamic); a resume keeps it.
    table_seed: int = 0
    # dynamic: the table's own optimizer, e.g. "adagrad" or "ftrl" (`optimizer.name`'s names;
    # "": the model's `optimizer.name`), and its peak learning rate on the model's schedule
    # (0: `optimizer.learning_rate`); the dense layers keep `optimizer`.
    table_optimizer: str = ""
    table_learning_rate: float = 0.0  # dynamic: the table's own peak learning rate (see above)
    # dynamic: which id a full table evicts: lfu (lowest count, halved every 500 steps unseen),
    # lru (least recently seen), or "" (none: a full table refuses new ids).
    eviction: str = "lfu"
    # dynamic: rows of a trained hashed fallback table that ids without a row read (the
    # fallback_combiner, mean or sum, of rows hash_k(id) % fallback_rows, k < fallback_hashes;
    # counted in the table's bytes); 0: one shared default row.
    fallback_rows: int = 0
    fallback_hashes: int = 2  # dynamic: the fallback rows (hashes) an id without a row reads
    fallback_combiner: str = "mean"  # dynamic: how an id's fallback rows combine: mean | sum
    # dynamic, min_count > 1: the counts of ids not admitted yet live in a count-min sketch of
    # sketch_depth rows of sketch_width int32 cells (no memory per id; docs/tables.md: its bound).
    sketch_width: int = 8192
    sketch_depth: int = 2  # dynamic, min_count > 1: rows of the count-min sketch (see above)
    # dynamic, fallback_rows > 0: outside training, ids without a row that the table has not
    # seen in training lately read zeros (not fallback rows other ids trained); which ids it saw
    # is a Bloom filter of two generations of seen_bits bits (in the table's bytes); 0: none.
    seen_bits: int = 2**18

    def __post_init__(self):
        _one_of("model.embedding", self.embedding, EMBEDDINGS, "a table kind", "dynamic")
        _one_of("model.eviction", self.eviction, EVICTIONS, "an eviction policy", "lfu")
        _one_of(
            "model.fallback_combiner",
            self.fallback_combiner,
            FALLBACK_COMBINERS,
            "a way to combine fallback rows",
            "mean",
        )
        for field, minimum, example, meaning in _TABLE_COUNTS:
            at_least(f"model.{field}", getattr(self, field), minimum, meaning, example)


# `TableOptions`' counts: (field, minimum, an example, what it means).
_TABLE_COUNTS = (
    ("capacity", 0, 100_000, "the most rows a dynamic table holds; 0: `model.vocab_size`"),
    ("min_count", 1, 2, "the lookups an id needs before it gets its own row"),
    ("ttl_steps", 0, 10_000, "steps unseen before an id's row is freed; 0: kept"),
    ("fallback_rows", 0, 1000, "hashed rows for ids without a row; 0: one shared default row"),
    ("fallback_hashes", 1, 2, "the fallback rows an id without a row reads"),
    ("sketch_width", 1, 8192, "the count-min sketch of ids not admitted yet"),
    ("sketch_depth", 1, 2, "the count-min sketch of ids not admitted yet"),
    ("seen_bits", 0, 2**18, "the bits of each generation of the table's seen-filter; 0: none"),
)


def _one_of(field: str, value: str, known: tuple[str, ...], what: str, example: str) -> None:
    """A declaration's rule: `value` of `field` is one of `known`."""
    if value not in known:
        listed = ", ".join(repr(k) if not k else k for k in known)
        raise UserError(
            f"`{field}` '{value}' is not {what}; use one of {listed}, e.g. "
            f"`--config.{field}={example}`."
        )


# The built-in components' names (`trainer.loop.features`) -> where their fields sit.
BUILTIN = {
    "follow": Section("data", FollowOptions, shared=True),
    "elastic": Section("cluster.elastic", ElasticOptions),
    "exports": Section("export", ExportOptions),
    "profile": Section("train", ProfileOptions, shared=True),
    "warm_start": Section("train", WarmStartOptions, shared=True),
    "progressive": Section("eval", ProgressiveOptions, shared=True),
}
# The `tables` component's: fields of the built-in ctr model, which configs/ctr.py adds
# (the default config, of an MLP, has none; a config without them reads their defaults).
TABLES = Section("model", TableOptions, shared=True)
