"""What every data source shares: spec, the two kinds of split, batching, sharding, registry.

A source module registers a builder `fn(config.data) -> Dataset` with
`@register("name")`; it describes its splits (`indexed_dataset` for examples
made from their index, `file_dataset` for records read from files) and the
`Dataset` here turns them into per-replica batches for `tf.distribute`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Protocol

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError
from towerflow.registry import Registry

_FILES_READ_AT_ONCE = 8  # a fixed interleave width keeps record order machine-independent

Decode = Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]

# How input pipelines (one per worker) split the data, `data.sharding`:
SHARDING = {
    "auto": "files when there are enough of them for every pipeline, else records",
    "file": "each pipeline reads its own files",
    "data": "each pipeline reads every file and keeps its share of the examples",
    "off": "every pipeline reads all the data",
}


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about the data.

    Attributes:
      input_shape: the shape of one example, e.g. (8, 8, 1); None when the
        features are several named tensors (a dict) or of no fixed shape.
      num_classes: classes of the label; 0 means regression.
      train_size: examples in the train split, or None if unknown (files).
      eval_size: examples in the eval split, or None if unknown (files).
      class_names: the classes' names in index order, where the labels are
        names (`data.label_vocabulary`); () otherwise.
      dtype: the dtype of the features where they are one tensor ("float32",
        or "int64" / "string" for raw ids).
    """

    input_shape: tuple[int, ...] | None
    num_classes: int
    train_size: int | None
    eval_size: int | None
    class_names: tuple[str, ...] = ()
    dtype: str = "float32"

    @property
    def task(self) -> str:
        """Either "classification" or "regression"."""
        return "classification" if self.num_classes > 0 else "regression"


DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


class Dataset(Protocol):
    """What every source gives the loop: the data's spec and its two input pipelines.

    `train_fn` and `eval_fn` return the `dataset_fn(input_context)` that
    `Strategy.distribute_dataset` calls once per input pipeline; each yields
    per-replica batches of `(features, labels)` or `(features, labels,
    sample_weights)` from that pipeline's shard only.
    """

    spec: DataSpec
    notes: tuple[str, ...]  # what start-up found worth telling (e.g. rows dropped)

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The endless training stream; `start_step=k` begins with the batches of step `k`.

        `start_batch`, where given, is the position instead: the per-replica batches
        of the stream trained before, for a run whose steps had other replica counts
        (elastic `cluster.elastic.batch=per_replica`).
        """
        ...

    def eval_fn(self, global_batch_size: int) -> DatasetFn:
        """One pass over the eval split, in which every example counts once."""
        ...

    def check(self) -> None:
        """Reads the first batch of each split; raises UserError if it is not what it must be."""
        ...


@dataclasses.dataclass(frozen=True)
class TrainStreamWrapper:
    """A `Dataset` that changes only `inner`'s training stream (where or how it is read).

    Subclasses add their fields and define `train_fn`; the spec, the eval pass
    and the check are `inner`'s.
    """

    inner: Dataset

    @property
    def spec(self) -> DataSpec:
        """The inner source's spec."""
        return self.inner.spec

    @property
    def notes(self) -> tuple[str, ...]:
        """The inner source's start-up notes."""
        return self.inner.notes

    @property
    def settings(self) -> Settings:
        """The inner source's pipeline settings, for the stream this wrapper makes."""
        return getattr(self.inner, "settings", Settings())

    def eval_fn(self, global_batch_size: int) -> DatasetFn:
        """The inner source's eval pass, unchanged."""
        return self.inner.eval_fn(global_batch_size)

    def check(self) -> None:
        """The inner source's check."""
        self.inner.check()


@dataclasses.dataclass(frozen=True)
class Settings:
    """How any source's pipelines run: `data.autotune`, its RAM budget and `data.sharding`.

    Attributes:
      autotune: whether tf.data's autotuning model runs (a RAM budget turns it on).
      ram_budget_mb: tf.data autotuning's memory budget in MiB (0 = TF's default).
      sharding: how pipelines split the data (see `SHARDING`).
    """

    autotune: bool = False
    ram_budget_mb: int = 0
    sharding: str = "auto"

    def context(self, context: tf.distribute.InputContext) -> tf.distribute.InputContext:
        """With `data.sharding=off` every pipeline reads all the data, as if it were alone."""
        if self.sharding != "off":
            return context
        return tf.distribute.InputContext(1, 0, context.num_replicas_in_sync)

    def apply(self, pipeline: tf.data.Dataset) -> tf.data.Dataset:
        """`pipeline` with tf.data's autotuning model only when asked for.

        An autotuning choice the pipeline makes itself (a user's `with_options`)
        stands. Without the model, `AUTOTUNE` maps and interleaves run a
        parallelism sized to the machine's cores and prefetch buffers grow as they
        run dry (TensorFlow's own fallbacks). With it, a pipeline that lived a
        minute may take up to a minute to delete: the model's thread can miss its
        wake-up (TensorFlow sets "cancelled" only after running the callbacks that
        notify it) and sleeps out its period, which doubles up to 60 s, while the
        deleting thread holds Python's lock (docs/troubleshooting.md).
        """
        options = tf.data.Options()
        if pipeline.options().autotune.enabled is None:
            options.autotune.enabled = self.autotune or self.ram_budget_mb > 0
        if self.ram_budget_mb:
            options.autotune.ram_budget = self.ram_budget_mb << 20
        return pipeline.with_options(options)


@dataclasses.dataclass(frozen=True)
class _IndexedSplit:
    """Examples `begin, ..., begin + size - 1` of a source that can make any example.

    In the eval pass pipeline `p` of `P` owns the examples at offsets `p, p + P,
    p + 2P, ...` (what `Dataset.shard(P, p)` keeps); in training it takes every
    `P`-th batch of one shared stream (see `shuffled_batches`).
    """

    begin: int
    size: int
    decode: Decode  # a batch of indices -> (x, y)
    origin: str  # names the split in errors

    def records(self, context: tf.distribute.InputContext) -> tf.data.Dataset:
        """This pipeline's indices, in order, once."""
        return _shard(tf.data.Dataset.range(self.begin, self.begin + self.size), context)

    def shuffled_batches(
        self, context: tf.distribute.InputContext, seed: int, batch: int, first: int
    ) -> tf.data.Dataset:
        """This pipeline's batches of indices, endlessly, a new permutation each epoch.

        There is one stream of batches for the whole split, whatever the number of
        pipelines: from batch `first` of the stream, pipeline `p` of `P` takes
        `first + p, first + p + P, first + p + 2P, ...`. So a step sees the same
        examples with one pipeline feeding every replica (`mirrored`) as with one
        pipeline per worker (`multi_worker`), and the two train to the same
        weights; finding batch `first` costs nothing.
        """
        pipelines, pipeline = context.num_input_pipelines, context.input_pipeline_id
        last = tf.constant(self.size - 1, tf.int64)

        def indices(number: tf.Tensor) -> tf.Tensor:
            stream_batch = first + number * pipelines + pipeline
            positions = stream_batch * batch + tf.range(batch, dtype=tf.int64)
            epochs, zeros = positions // self.size, tf.zeros([batch], tf.int64)
            # A new permutation of the split for each (seed, epoch).
            # The raw op, because `index_shuffle` pads per-example seeds wrongly in TF 2.21.
            seeds = tf.stack([zeros + seed, epochs, zeros], axis=1)
            offsets = tf.raw_ops.RandomIndexShuffle(
                index=positions % self.size, seed=seeds, max_index=last, rounds=4
            )
            return self.begin + offsets

        return tf.data.Dataset.counter().map(indices)


@dataclasses.dataclass(frozen=True)
class _FileSplit:
    """The records of some files; pipelines share files, or records if files are too few."""

    files: tuple[str, ...]
    read: Callable[[tf.Tensor], tf.data.Dataset]  # one file name -> its records
    decode: Decode  # a batch of records -> (x, y)
    origin: str
    shuffle_buffer: int
    sharding: str = "auto"  # see SHARDING

    def records(
        self, context: tf.distribute.InputContext, seed: int | None = None
    ) -> tf.data.Dataset:
        """This pipeline's records, once; in file order, or file order shuffled by `seed`."""
        files = tf.data.Dataset.from_tensor_slices(list(self.files))
        if seed is not None:
            files = files.shuffle(len(self.files), seed=seed, reshuffle_each_iteration=True)
        pipelines = context.num_input_pipelines
        if self.sharding == "file" and len(self.files) < pipelines:
            raise UserError(
                f"`data.sharding` 'file' needs at least one file per input pipeline, and "
                f"{self.origin} has {len(self.files)} for {pipelines}; use 'auto' or 'data'."
            )
        by_file = self.sharding == "file" or (
            self.sharding == "auto" and len(self.files) >= pipelines
        )
        if by_file:
            files = _shard(files, context)
        records = files.interleave(
            self.read,
            cycle_length=min(len(self.files), _FILES_READ_AT_ONCE),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        return records if by_file else _shard(records, context)

    def shuffled_batches(
        self, context: tf.distribute.InputContext, seed: int, batch: int, first: int
    ) -> tf.data.Dataset:
        """This pipeline's records in batches, endlessly, reshuffled each epoch.

        Each pipeline reads a share of its own: from batch `first` of all of them,
        this one skips its part, `first / P` batches; finding it reads (not parses)
        the records before it.
        """
        records = self.records(context, seed)
        records = records.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        skip = first // context.num_input_pipelines * batch
        return records.repeat().skip(skip).batch(batch, drop_remainder=True)


_Split = _IndexedSplit | _FileSplit


@dataclasses.dataclass(frozen=True)
class SplitDataset:
    """A built-in source's `Dataset`: the spec and the records of its two splits.

    Attributes:
      spec: shapes, classes and sizes, for building the model.
      train_split: where training examples come from.
      eval_split: where eval examples come from.
      layout: how records are read, for error messages.
      settings: the memory budget and the sharding.
      notes: what start-up found worth telling (e.g. rows dropped), one line each.
    """

    spec: DataSpec
    train_split: _Split
    eval_split: _Split
    layout: str
    settings: Settings = Settings()
    notes: tuple[str, ...] = ()

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The endless, shuffled training stream, as a `dataset_fn` for `tf.distribute`.

        Args:
          global_batch_size: examples per step over all replicas.
          seed: fixes the shuffling; the same seed gives the same batches.
          start_step: begin with the batches of this step of a run from step 0.
            Each step takes one batch for each replica.
          start_batch: begin with this per-replica batch of the stream instead
            (a run whose steps had other replica counts; see `stream_position`).

        Returns:
          `dataset_fn(input_context)`: full per-replica batches of this pipeline's shard.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            batch = context.get_per_replica_batch_size(global_batch_size)
            first = stream_position(start_step, context, start_batch)
            split = self.train_split
            batches = split.shuffled_batches(self.settings.context(context), seed, batch, first)
            return self.settings.apply(_decoded(batches, split.decode))

        return dataset_fn

    def eval_fn(self, global_batch_size: int) -> DatasetFn:
        """One ordered pass over the eval split, as a `dataset_fn` for `tf.distribute`.

        Args:
          global_batch_size: examples per step over all replicas.

        Returns:
          `dataset_fn(input_context)`: per-replica batches of this pipeline's shard,
          the last one short, so that every eval example counts exactly once.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            batch = context.get_per_replica_batch_size(global_batch_size)
            records = self.eval_split.records(self.settings.context(context))
            batches = _decoded(records.batch(batch), self.eval_split.decode)
            return self.settings.apply(batches)

        return dataset_fn

    def check(self) -> None:
        """Reads the first example of each split, so bad files fail before training starts.

        Raises:
          UserError: a split has no examples, or its first records do not match the spec.
        """
        context = tf.distribute.InputContext()
        for split in (self.train_split, self.eval_split):
            batches = self.settings.apply(_decoded(split.records(context).batch(1), split.decode))
            try:
                next(iter(batches))
            except StopIteration:
                raise UserError(
                    f"{split.origin} holds no examples; give files with at least one record."
                ) from None
            except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
                raise UserError(
                    f"Cannot read {split.origin} as {self.layout}: {gist(error)}; "
                    "make the spec match the files."
                ) from None


def file_split(dataset: Dataset) -> _FileSplit | None:
    """The training split of a source that reads files (`file_dataset`), else None."""
    split = getattr(dataset, "train_split", None)
    return split if isinstance(split, _FileSplit) else None


def batches_before(step: int, context: tf.distribute.InputContext) -> int:
    """How many batches this pipeline gave steps 0, ..., `step` - 1: one per replica it feeds."""
    return step * max(1, context.num_replicas_in_sync // context.num_input_pipelines)


def stream_position(
    step: int, context: tf.distribute.InputContext, start_batch: int | None = None
) -> int:
    """The per-replica batches of the whole stream (every pipeline's) before this run's first.

    `start_batch` where the run says so (elastic `per_replica`: earlier groups
    trained other counts per step), else `step` steps of this run's replicas.
    """
    if start_batch is not None:
        return start_batch
    return batches_before(step, context) * context.num_input_pipelines


def _shard(dataset: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    if context.num_input_pipelines == 1:
        return dataset
    return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)


def _decoded(batches: tf.data.Dataset, decode: Decode) -> tf.data.Dataset:
    """`(x, y)` from batches of records; decoding whole batches is the fast way."""
    batches = batches.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return batches.prefetch(tf.data.AUTOTUNE)


def check(dataset: Dataset) -> None:
    """Reads the first batch of each split of `dataset`, so bad data fails before training.

    Raises:
      UserError: a split has no examples, or what it yields is not what the spec says.
    """
    dataset.check()


def gist(error: tf.errors.OpError) -> str:
    """The first line of a TF error, without the names of the ops and iterators it went through."""
    line = error.message.strip().splitlines()[0]
    line = re.sub(r"^.*Iterator::\S+: |\{\{.*?\}\}", "", line)
    return " ".join(line.split()).rstrip(" .")


# --- the registry -------------------------------------------------------------

BUILDERS = Registry("Dataset")  # name -> fn(config.data) -> Dataset
register = BUILDERS.register


def names() -> list[str]:
    """The built-in `data.name` values."""
    return BUILDERS.names()


def settings(config: ml_collections.ConfigDict) -> Settings:
    """`data.autotune`, `data.autotune_ram_budget_mb` and `data.sharding`, checked.

    Raises:
      UserError: a negative budget or an unknown sharding.
    """
    budget = config.get("autotune_ram_budget_mb", 0)
    if budget < 0:
        raise UserError(
            f"`data.autotune_ram_budget_mb` ({budget}) must be >= 0 (0 = TF's default, "
            "half the RAM); set e.g. `--config.data.autotune_ram_budget_mb=2048`."
        )
    sharding = config.get("sharding", "auto")
    if sharding not in SHARDING:
        raise UserError(f"Unknown `data.sharding` '{sharding}'; known: {', '.join(SHARDING)}.")
    return Settings(bool(config.get("autotune", False)), budget, sharding)


def with_settings(dataset: Dataset, settings: Settings) -> Dataset:
    """`dataset` (a dataclass with a `settings` field) run with `settings`."""
    splits = {
        name: dataclasses.replace(getattr(dataset, name), sharding=settings.sharding)
        for name in ("train_split", "eval_split")
        if isinstance(getattr(dataset, name, None), _FileSplit)
    }
    return dataclasses.replace(dataset, settings=settings, **splits)


# --- built-in sources: indexed or files -----------------------------------------------


def indexed_dataset(
    config: ml_collections.ConfigDict,
    size: int,
    shape: tuple[int, ...],
    classes: int,
    decode: Decode,
    origin: str,
    dtype: str = "float32",
) -> Dataset:
    """A dataset whose last `data.eval_fraction` of the indices is the eval split.

    `decode` makes a batch of examples from their indices: features of `shape`
    and `dtype`, and labels.
    """
    fraction = config.eval_fraction
    if not 0 < fraction < 1:
        raise UserError(
            f"`data.eval_fraction` ({fraction}) must be between 0 and 1 (exclusive); "
            "set e.g. `--config.data.eval_fraction=0.2`."
        )
    # Round up, so 0.2 of 1,797 holds out 360; `round` first absorbs float error.
    eval_size = math.ceil(round(fraction * size, 9))
    train_size = size - eval_size
    if train_size < 1:
        raise UserError(
            f"{origin} has {size} examples, so `data.eval_fraction` ({fraction}) leaves none "
            "for training; use more examples or a smaller fraction."
        )
    spec = DataSpec(shape, classes, train_size, eval_size, dtype=dtype)
    train = _IndexedSplit(0, train_size, decode, f"the train split of {origin}")
    evaluation = _IndexedSplit(train_size, eval_size, decode, f"the eval split of {origin}")
    return SplitDataset(spec, train, evaluation, layout=f"{shape} inputs")


def file_dataset(
    config: ml_collections.ConfigDict,
    files: dict[str, list[str]],
    read: Callable[[tf.Tensor], tf.data.Dataset],
    decode: Decode,
    shape: tuple[int, ...],
    classes: int,
    layout: str,
    sizes: Sequence[int | None] = (None, None),
    class_names: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
) -> Dataset:
    """A dataset read from the `files` of each split, of the `sizes` (train, eval) if known.

    `class_names` name the classes of string labels; `notes` are told at start-up.
    """
    buffer = check_positive("data.shuffle_buffer", config.shuffle_buffer)
    train, evaluation = (
        _FileSplit(tuple(files[field]), read, decode, f"`data.{field}` '{config[field]}'", buffer)
        for field in ("train_files", "eval_files")
    )
    spec = DataSpec(shape, classes, *sizes, class_names=class_names)
    return SplitDataset(spec, train, evaluation, layout, notes=notes)


def glob_files(config: ml_collections.ConfigDict, kind: str) -> dict[str, list[str]]:
    """The sorted files of `data.train_files` and `data.eval_files`."""
    files = {}
    for field in ("train_files", "eval_files"):
        pattern = config[field]
        if not pattern:
            raise UserError(
                f"`data.{field}` is empty; give a glob of your {kind} files, "
                f"e.g. `--config.data.{field}='/data/{field[:-6]}-*'`."
            )
        files[field] = sorted(tf.io.gfile.glob(pattern))
        if field == "train_files" and config.get("follow", False):
            files[field] = [path for path in files[field] if ready(path)]
        if not files[field] and field == "train_files" and config.get("follow", False):
            raise UserError(
                f"No files match `data.train_files` '{pattern}', and `data.follow` needs one "
                "at start-up (the model's inputs come from it); write the first file, then start."
            )
        if not files[field]:
            raise UserError(
                f"No files match `data.{field}` '{pattern}'; give a glob that matches your "
                f"{kind} files."
            )
    return files


def ready(path: str) -> bool:
    """Whether a file of `data.follow` is complete: its name starts with neither `.` nor `_`."""
    return not os.path.basename(path.rstrip("/")).startswith((".", "_"))


def listed(names: list[str], most: int = 12) -> str:
    """`names` for a one-line message: the first `most`, then how many in all."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


# --- shared checks and conversions -------------------------------------------------


def as_labels(labels: tf.Tensor, classes: int) -> tf.Tensor:
    """Labels as the tasks take them: int32 classes, or float32 for regression."""
    return tf.cast(labels, tf.int32 if classes else tf.float32)


def check_shape(field: str, value: Sequence[int]) -> tuple[int, ...]:
    """`value` as the shape of one example; raises UserError naming `field` if it is none."""
    shape = tuple(value) if isinstance(value, (tuple, list)) else ()
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise UserError(
            f"`{field}` ({value!r}) must be a tuple of positive ints, the shape of one "
            f"example; set e.g. `--config.{field}='(8, 8, 1)'`."
        )
    return shape


def check_classes(field: str, value: int) -> int:
    """`value` as a class count: 0 (regression) or at least 2; else UserError naming `field`."""
    if value < 0 or value == 1:
        raise UserError(
            f"`{field}` ({value}) must be 0 (regression) or at least 2 classes; "
            f"set e.g. `--config.{field}=10`."
        )
    return value


def check_positive(field: str, value: int) -> int:
    """`value` if it is at least 1; else UserError naming `field`."""
    if value < 1:
        raise UserError(f"`{field}` ({value}) must be >= 1; set e.g. `--config.{field}=1000`.")
    return value
