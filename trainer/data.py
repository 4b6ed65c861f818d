"""Input pipelines for `tf.distribute`: bundled digits, synthetic data, TFRecord and CSV files.

`get(config.data)` builds a `Dataset`: a `DataSpec` (one example's shape, the
class count, the split sizes) and two factories. `train_fn(global_batch_size,
seed, start_step)` and `eval_fn(global_batch_size)` return the
`dataset_fn(input_context)` that `Strategy.distribute_dataset` calls once per
input pipeline. Each yields `(x, y)` batches of the per-replica size, from
that pipeline's shard only::

    dataset = data.get(config.data)
    batches = strategy.distribute_dataset(dataset.train_fn(128, seed=0))

The train stream is endless, shuffled anew each epoch from `seed`, and the
same on every run: `start_step=k` begins exactly where step `k` of a run from
step 0 would be, so a restarted job sees the batches it would have seen. The
eval stream is one ordered pass in which every example counts once.

Sources come in two kinds that share the batching and sharding code:

- indexed (`digits`, `synthetic`): example `i` can be made directly, so each
  epoch is a stateless permutation of the indices (a full shuffle, no buffer)
  and resuming jumps straight to its position;
- files (`tfrecord`, `csv`): records are read in order and shuffled with a
  `data.shuffle_buffer`-sized buffer; resuming skips records before they are
  parsed. CSV files are parsed once at start-up, which finds a bad value's
  line and gives the split sizes.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np
import tensorflow as tf

from strategies.errors import UserError
from trainer import named

_DIGITS_SPLIT_SEED = 0  # fixes the digits train/eval split, whatever `config.seed` is
_SYNTHETIC_SEED = 1234  # fixes the synthetic examples and their teacher
_TEACHER_FEATURES = 64  # synthetic: the teacher sees at most this many pooled inputs
_CTR_SEED = 4321  # fixes the ctr examples, their hashing and the hidden click model
_FILES_READ_AT_ONCE = 8  # a fixed interleave width keeps record order machine-independent
_DTYPES = {"float32": tf.float32, "int64": tf.int64}

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
      input_shape: the shape of one example, e.g. (8, 8, 1).
      num_classes: classes of the label; 0 means regression.
      train_size: examples in the train split, or None if unknown (files).
      eval_size: examples in the eval split, or None if unknown (files).
    """

    input_shape: tuple[int, ...]
    num_classes: int
    train_size: int | None
    eval_size: int | None

    @property
    def task(self) -> str:
        """Either "classification" or "regression"."""
        return "classification" if self.num_classes > 0 else "regression"


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
        pipelines: pipeline `p` of `P` takes its batches `p, p + P, p + 2P, ...`.
        So a step sees the same examples with one pipeline feeding every replica
        (`mirrored`) as with one pipeline per worker (`multi_worker`), and the two
        train to the same weights. Batch `first` of this pipeline comes first;
        finding it costs nothing.
        """
        pipelines, pipeline = context.num_input_pipelines, context.input_pipeline_id
        last = tf.constant(self.size - 1, tf.int64)

        def indices(number: tf.Tensor) -> tf.Tensor:
            stream_batch = number * pipelines + pipeline
            positions = stream_batch * batch + tf.range(batch, dtype=tf.int64)
            epochs, zeros = positions // self.size, tf.zeros([batch], tf.int64)
            # A new permutation of the split for each (seed, epoch).
            # The raw op, because `index_shuffle` pads per-example seeds wrongly in TF 2.21.
            seeds = tf.stack([zeros + seed, epochs, zeros], axis=1)
            offsets = tf.raw_ops.RandomIndexShuffle(
                index=positions % self.size, seed=seeds, max_index=last, rounds=4
            )
            return self.begin + offsets

        return tf.data.Dataset.counter(first).map(indices)


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

        Batch `first` of the stream comes first; finding it reads (not parses) the
        records before it.
        """
        records = self.records(context, seed)
        records = records.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        return records.repeat().skip(first * batch).batch(batch, drop_remainder=True)


_Split = _IndexedSplit | _FileSplit


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset's spec and the input pipelines of its two splits.

    Attributes:
      spec: shapes, classes and sizes, for building the model.
      train_split: where training examples come from.
      eval_split: where eval examples come from.
      layout: how records are read, for error messages.
      ram_budget_mb: tf.data autotuning's memory budget in MiB (0 = TF's default).
      sharding: how pipelines split the data (see `SHARDING`).
    """

    spec: DataSpec
    train_split: _Split
    eval_split: _Split
    layout: str
    ram_budget_mb: int = 0
    sharding: str = "auto"

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0
    ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
        """The endless, shuffled training stream, as a `dataset_fn` for `tf.distribute`.

        Args:
          global_batch_size: examples per step over all replicas.
          seed: fixes the shuffling; the same seed gives the same batches.
          start_step: begin with the batches of this step of a run from step 0.
            Each step takes one batch for each replica a pipeline feeds.

        Returns:
          `dataset_fn(input_context)`: full per-replica batches of this pipeline's shard.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            batch = context.get_per_replica_batch_size(global_batch_size)
            replicas_fed = max(1, context.num_replicas_in_sync // context.num_input_pipelines)
            split = self.train_split
            context = self._shared(context)
            batches = split.shuffled_batches(context, seed, batch, start_step * replicas_fed)
            return _decoded(batches, split.decode).with_options(self._options())

        return dataset_fn

    def eval_fn(
        self, global_batch_size: int
    ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
        """One ordered pass over the eval split, as a `dataset_fn` for `tf.distribute`.

        Args:
          global_batch_size: examples per step over all replicas.

        Returns:
          `dataset_fn(input_context)`: per-replica batches of this pipeline's shard,
          the last one short, so that every eval example counts exactly once.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            batch = context.get_per_replica_batch_size(global_batch_size)
            records = self.eval_split.records(self._shared(context)).batch(batch)
            return _decoded(records, self.eval_split.decode).with_options(self._options())

        return dataset_fn

    def _shared(self, context: tf.distribute.InputContext) -> tf.distribute.InputContext:
        """With `data.sharding=off` every pipeline reads all the data, as if it were alone."""
        if self.sharding != "off":
            return context
        return tf.distribute.InputContext(1, 0, context.num_replicas_in_sync)

    def _options(self) -> tf.data.Options:
        """tf.data autotunes parallelism and prefetch depths within the memory budget."""
        options = tf.data.Options()
        options.autotune.enabled = True
        if self.ram_budget_mb:
            options.autotune.ram_budget = self.ram_budget_mb << 20
        return options


def _shard(dataset: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    if context.num_input_pipelines == 1:
        return dataset
    return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)


def _decoded(batches: tf.data.Dataset, decode: Decode) -> tf.data.Dataset:
    """`(x, y)` from batches of records; decoding whole batches is the fast way."""
    batches = batches.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return batches.prefetch(tf.data.AUTOTUNE)


def check(dataset: Dataset) -> None:
    """Reads the first example of each split, so bad files fail before training starts.

    Raises:
      UserError: a split has no examples, or its first records do not match the spec.
    """
    context = tf.distribute.InputContext()
    for split in (dataset.train_split, dataset.eval_split):
        batches = _decoded(split.records(context).batch(1), split.decode)
        try:
            next(iter(batches))
        except StopIteration:
            raise UserError(
                f"{split.origin} holds no examples; give files with at least one record."
            ) from None
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
            raise UserError(
                f"Cannot read {split.origin} as {dataset.layout}: {_gist(error)}; "
                "make the spec match the files."
            ) from None


def _gist(error: tf.errors.OpError) -> str:
    """The first line of a TF error, without the names of the ops and iterators it went through."""
    line = error.message.strip().splitlines()[0]
    line = re.sub(r"^.*Iterator::\S+: |\{\{.*?\}\}", "", line)
    return " ".join(line.split()).rstrip(" .")


# --- the registry -------------------------------------------------------------

_BUILDERS = named.Registry("Dataset")  # name -> fn(config.data) -> Dataset
_register = _BUILDERS.register


def names() -> list[str]:
    """The known `data.name` values."""
    return _BUILDERS.names()


def get(config: ml_collections.ConfigDict) -> Dataset:
    """Builds the dataset that `config` (the `data` part of a config) describes.

    Raises:
      UserError: an unknown name or a bad value; the message names the field.
    """
    if config.name not in _BUILDERS:
        raise UserError(
            f"Unknown dataset `data.name` '{config.name}'; known: {', '.join(names())}."
        )
    budget = config.get("autotune_ram_budget_mb", 0)
    if budget < 0:
        raise UserError(
            f"`data.autotune_ram_budget_mb` ({budget}) must be >= 0 (0 = TF's default, "
            "half the RAM); set e.g. `--config.data.autotune_ram_budget_mb=2048`."
        )
    sharding = config.get("sharding", "auto")
    if sharding not in SHARDING:
        raise UserError(f"Unknown `data.sharding` '{sharding}'; known: {', '.join(SHARDING)}.")
    dataset = _BUILDERS[config.name](config)
    splits = {
        name: dataclasses.replace(getattr(dataset, name), sharding=sharding)
        for name in ("train_split", "eval_split")
        if isinstance(getattr(dataset, name), _FileSplit)
    }
    return dataclasses.replace(dataset, ram_budget_mb=budget, sharding=sharding, **splits)


# --- indexed sources ------------------------------------------------------------


@_register("digits")
def _digits(config: ml_collections.ConfigDict) -> Dataset:
    """The bundled UCI handwritten digits: 1,797 8x8 images in 0..1, 10 classes."""
    asset = importlib.resources.files("trainer") / "assets" / "digits.npz"
    with asset.open("rb") as f, np.load(f) as arrays:
        images, labels = arrays["images"], arrays["labels"]
    order = np.random.RandomState(_DIGITS_SPLIT_SEED).permutation(len(labels))
    x = tf.constant(images[order, :, :, None] / 16.0, tf.float32)
    y = tf.constant(labels[order], tf.int32)

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.gather(x, indices), tf.gather(y, indices)

    return _indexed(config, len(labels), (8, 8, 1), 10, decode, "the bundled `digits`")


@_register("synthetic")
def _synthetic(config: ml_collections.ConfigDict) -> Dataset:
    """Learnable data of any size; each example is made from its index alone.

    Inputs are uniform with mean 0 and variance 1 (as good as normal here), drawn
    by a hash of the index (see `_uniforms`). A fixed random linear teacher reads the sums of up
    to 64 contiguous blocks of the flattened input. The label is the argmax of
    its logits plus noise, or for regression its output plus noise.
    """
    options = config.synthetic
    num_examples = _positive("data.synthetic.num_examples", options.num_examples)
    shape = _shape("data.synthetic.input_shape", options.input_shape)
    classes = _num_classes("data.synthetic.num_classes", options.num_classes)
    if options.noise < 0:
        raise UserError(
            f"`data.synthetic.noise` ({options.noise}) must be >= 0; "
            "set e.g. `--config.data.synthetic.noise=0.1`."
        )
    size, heads = math.prod(shape), max(classes, 1)  # heads: logits, or one output
    features, blocks = _block_features(size)
    teacher = np.random.RandomState(_SYNTHETIC_SEED).normal(size=(blocks, heads))
    teacher = tf.constant(teacher / np.sqrt(blocks), tf.float32)
    bound = 3**0.5  # uniform on [-bound, bound] has variance 1

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        draws = _uniforms(indices, size + heads, _SYNTHETIC_SEED) * (2 * bound) - bound
        inputs, noise = draws[:, :size], draws[:, size:]
        outputs = tf.matmul(features(inputs), teacher) + options.noise * noise
        labels = tf.argmax(outputs, axis=-1, output_type=tf.int32) if classes else outputs[:, 0]
        return tf.reshape(inputs, [-1, *shape]), labels

    return _indexed(config, num_examples, shape, classes, decode, "`data.synthetic`")


def _uniforms(indices: tf.Tensor, count: int, seed: int) -> tf.Tensor:
    """`count` values uniform in [0, 1) for each of `indices`, made from the index alone.

    A counter-based hash (Wellons' "lowbias32") of (seed, index, position), in a
    few integer ops over the whole batch at once: some 20x faster than a
    stateless random op per example, so the input pipeline is never what a
    training step waits for.
    """
    indices = tf.cast(indices, tf.int64)
    low = tf.cast(tf.bitwise.bitwise_and(indices, 0xFFFFFFFF), tf.uint32)
    high = tf.cast(tf.bitwise.right_shift(indices, 32), tf.uint32)
    keys = _hash32(tf.bitwise.bitwise_xor(_hash32(low + tf.constant(seed, tf.uint32)), high))
    positions = tf.cast(tf.range(count), tf.uint32) * tf.constant(0x9E3779B9, tf.uint32)
    bits = _hash32(keys[:, None] + positions[None, :])
    return tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * (1.0 / (1 << 24))


def _hash32(x: tf.Tensor) -> tf.Tensor:
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, shift))
        x = x * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _block_features(size: int) -> tuple[Callable[[tf.Tensor], tf.Tensor], int]:
    """Sums over contiguous blocks of flat inputs, scaled to unit variance; and their count."""
    width = -(-size // _TEACHER_FEATURES)  # inputs per block, rounded up
    blocks = -(-size // width)
    padding = blocks * width - size  # less than `width`: only the last block is short
    counts = np.full(blocks, width)
    counts[-1] -= padding
    scale = tf.constant(1 / np.sqrt(counts), tf.float32)

    def features(flat: tf.Tensor) -> tf.Tensor:
        if padding:
            flat = tf.pad(flat, [[0, 0], [0, padding]])
        return tf.reduce_sum(tf.reshape(flat, [-1, blocks, width]), axis=2) * scale

    return features, blocks


@_register("ctr")
def _ctr(config: ml_collections.ConfigDict) -> Dataset:
    """Synthetic click-through logs: categorical ids in, click (1) or not (0) out.

    Each of `num_fields` fields takes one of `ids_per_field` values, drawn with a
    probability that falls as 1/rank (a few values are common, most rare, as in
    real logs); a fixed permutation hashes every (field, value) into one shared
    vocabulary of `vocab_size` ids. A hidden click model, one weight per id plus
    a bias, gives the click logit, and the label is a Bernoulli draw of its
    sigmoid. `x` holds the ids as float32 (exact below 2**24).
    """
    options = config.ctr
    num_examples = _positive("data.ctr.num_examples", options.num_examples)
    fields = _positive("data.ctr.num_fields", options.num_fields)
    per_field = _positive("data.ctr.ids_per_field", options.ids_per_field)
    vocab = _positive("data.ctr.vocab_size", options.vocab_size)
    if not fields * per_field <= vocab <= 2**24:
        raise UserError(
            f"`data.ctr.vocab_size` ({vocab}) must hold `num_fields` x `ids_per_field` "
            f"({fields * per_field}) ids and be at most 2**24 (exact as float32); "
            "set e.g. `--config.data.ctr.vocab_size=200000`."
        )
    hidden = np.random.RandomState(_CTR_SEED).normal(0.0, options.weight_scale, size=vocab)
    weights = tf.constant(hidden, tf.float32)
    field_index = tf.range(fields, dtype=tf.int64)

    def uniforms(index: tf.Tensor) -> tf.Tensor:
        seed = tf.stack([tf.constant(_CTR_SEED, tf.int64), index])
        return tf.random.stateless_uniform([fields + 1], seed)  # a value per field, a click

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        draws = tf.map_fn(uniforms, indices, fn_output_signature=tf.float32)
        # exp(u * ln n) - 1 for uniform u: rank r in [0, n) with probability ~ 1 / (r + 1).
        ranks = tf.cast(tf.exp(draws[:, :fields] * math.log(per_field)), tf.int64) - 1
        keys = tf.minimum(ranks, per_field - 1) * fields + field_index
        ids = tf.raw_ops.RandomIndexShuffle(
            index=tf.reshape(keys, [-1]),
            seed=tf.constant([_CTR_SEED, 0, 0], tf.int64),
            max_index=tf.constant(vocab - 1, tf.int64),
            rounds=4,
        )
        ids = tf.reshape(ids, [-1, fields])
        logits = tf.reduce_sum(tf.gather(weights, ids), axis=1) + options.bias
        labels = tf.cast(draws[:, fields] < tf.sigmoid(logits), tf.int32)
        return tf.cast(ids, tf.float32), labels

    return _indexed(config, num_examples, (fields,), 2, decode, "`data.ctr`")


def _indexed(
    config: ml_collections.ConfigDict,
    size: int,
    shape: tuple[int, ...],
    classes: int,
    decode: Decode,
    origin: str,
) -> Dataset:
    """A dataset whose last `data.eval_fraction` of the indices is the eval split."""
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
    spec = DataSpec(shape, classes, train_size, eval_size)
    train = _IndexedSplit(0, train_size, decode, f"the train split of {origin}")
    evaluation = _IndexedSplit(train_size, eval_size, decode, f"the eval split of {origin}")
    return Dataset(spec, train, evaluation, layout=f"{shape} inputs")


# --- file sources ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Feature:
    """One fixed-size TFRecord feature, from "name:dtype:shape"."""

    name: str
    dtype: tf.DType
    shape: tuple[int, ...]


@_register("tfrecord")
def _tfrecord(config: ml_collections.ConfigDict) -> Dataset:
    """`tf.train.Example` records with fixed-size features and a scalar label."""
    features = _parse_features(config.features)
    shape, classes = _file_spec(config)
    values = sum(math.prod(f.shape) for f in features)
    if values != math.prod(shape):
        raise UserError(
            f"`data.features` '{config.features}' holds {values} values but "
            f"`data.input_shape` {shape} needs {math.prod(shape)}; make them agree."
        )
    if config.label_dtype not in _DTYPES:
        raise UserError(
            f"Unknown `data.label_dtype` '{config.label_dtype}'; known: {', '.join(_DTYPES)} "
            "(int64 for classes, float32 for regression)."
        )
    schema = {f.name: tf.io.FixedLenFeature(f.shape, f.dtype) for f in features}
    schema[config.label] = tf.io.FixedLenFeature([], _DTYPES[config.label_dtype])

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        parsed = tf.io.parse_example(serialized, schema)
        flat = [
            tf.reshape(tf.cast(parsed[f.name], tf.float32), [-1, math.prod(f.shape)])
            for f in features
        ]
        x = tf.reshape(tf.concat(flat, axis=1), [-1, *shape])
        return x, _labels(parsed[config.label], classes)

    layout = (
        f"`tf.train.Example`s with `data.features` '{config.features}' and `data.label` "
        f"'{config.label}' ({config.label_dtype})"
    )
    files = _globs(config, "TFRecord")
    return _files(config, files, tf.data.TFRecordDataset, decode, shape, classes, layout)


@_register("csv")
def _csv(config: ml_collections.ConfigDict) -> Dataset:
    """CSV files with a header row and numeric columns: the label column and the features."""
    shape, classes = _file_spec(config)
    files = _globs(config, "CSV")
    first, *others = files["train_files"] + files["eval_files"]
    columns = _header(first)
    for path in others:
        if (header := _header(path)) != columns:
            raise UserError(
                f"CSV file '{path}' has columns {_listed(header)}, unlike '{first}' "
                f"({_listed(columns)}); give every file the same header."
            )
    if config.label not in columns:
        raise UserError(
            f"`data.label` '{config.label}' is not a column of '{first}'; its columns: "
            f"{_listed(columns)}; set `data.label` to the label column."
        )
    label = columns.index(config.label)
    inputs = [i for i in range(len(columns)) if i != label]
    if len(inputs) != math.prod(shape):
        raise UserError(
            f"'{first}' has {len(inputs)} feature columns besides `data.label` "
            f"'{config.label}', but `data.input_shape` {shape} needs {math.prod(shape)}; "
            "make them agree."
        )

    defaults = [[0.0]] * len(columns)

    def decode(lines: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        values = tf.io.decode_csv(lines, record_defaults=defaults)
        x = tf.reshape(tf.stack([values[i] for i in inputs], axis=1), [-1, *shape])
        return x, _labels(values[label], classes)

    def read(path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TextLineDataset(path).skip(1)  # the header

    # Every value is checked here, with the op training parses with, so a bad one
    # is named by its file and line instead of failing a shuffled batch mid-run.
    sizes = [sum(_csv_rows(p, columns) for p in files[f]) for f in ("train_files", "eval_files")]
    layout = f"numeric CSV with `data.label` column '{config.label}'"
    return _files(config, files, read, decode, shape, classes, layout, sizes)


_CSV_LINES_AT_ONCE = 1 << 16  # lines parsed in one op while checking a CSV file


def _csv_rows(path: str, columns: list[str]) -> int:
    """Parses every line of a CSV file as training will; returns how many rows it has.

    Raises:
      UserError: a line that does not parse; names the file, line, column and value.
    """
    defaults, rows = [[0.0]] * len(columns), 0
    for lines in tf.data.TextLineDataset(path).skip(1).batch(_CSV_LINES_AT_ONCE):
        try:
            tf.io.decode_csv(lines, record_defaults=defaults)
        except tf.errors.InvalidArgumentError:
            bad = _first_unparsed(lines, defaults)
            line = rows + bad + 2  # 1-based, after the header
            raise UserError(_csv_line_error(path, line, lines[bad : bad + 1], columns)) from None
        rows += int(lines.shape[0])
    return rows


def _first_unparsed(lines: tf.Tensor, defaults: list) -> int:
    """The index of the first line that fails to parse on its own (a bisection)."""
    begin, end = 0, int(lines.shape[0])  # the first bad line is in [begin, end)
    while end - begin > 1:
        middle = (begin + end) // 2
        try:
            tf.io.decode_csv(lines[begin:middle], record_defaults=defaults)
            begin = middle
        except tf.errors.InvalidArgumentError:
            end = middle
    return begin


def _csv_line_error(path: str, line: int, text: tf.Tensor, columns: list[str]) -> str:
    """One line naming what is wrong with line `line` of a CSV file."""
    try:
        tf.io.decode_csv(text, record_defaults=[[0.0]] * len(columns))
        reason = "does not parse"
    except tf.errors.InvalidArgumentError as error:
        reason = re.sub(r" \[Op:\w+\]$", "", _gist(error))
    field = re.match(r"Field (\d+) in record \d+ is not a valid float: (.*)$", reason)
    if field:
        index, value = int(field.group(1)), field.group(2)
        return (
            f"CSV file '{path}' line {line}, column `{columns[index]}` (column {index + 1}): "
            f"'{value}' is not a number; fix or remove that line."
        )
    fields = re.match(r"Expect (\d+) fields but have (\d+)", reason)
    if fields:
        return (
            f"CSV file '{path}' line {line} has {fields.group(2)} values, and the header "
            f"{fields.group(1)} columns; fix or remove that line."
        )
    reason = re.sub(r" in record \d+", "", reason)
    return f"CSV file '{path}' line {line} does not parse ({reason}); fix or remove that line."


def _files(
    config: ml_collections.ConfigDict,
    files: dict[str, list[str]],
    read: Callable[[tf.Tensor], tf.data.Dataset],
    decode: Decode,
    shape: tuple[int, ...],
    classes: int,
    layout: str,
    sizes: Sequence[int | None] = (None, None),
) -> Dataset:
    """A dataset read from the `files` of each split, of the `sizes` (train, eval) if known."""
    buffer = _positive("data.shuffle_buffer", config.shuffle_buffer)
    train, evaluation = (
        _FileSplit(tuple(files[field]), read, decode, f"`data.{field}` '{config[field]}'", buffer)
        for field in ("train_files", "eval_files")
    )
    return Dataset(DataSpec(shape, classes, *sizes), train, evaluation, layout)


def _globs(config: ml_collections.ConfigDict, kind: str) -> dict[str, list[str]]:
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
        if not files[field]:
            raise UserError(
                f"No files match `data.{field}` '{pattern}'; give a glob that matches your "
                f"{kind} files."
            )
    return files


def _header(path: str) -> list[str]:
    with tf.io.gfile.GFile(path) as f:
        return [name.strip() for name in f.readline().strip().split(",")]


def _listed(names: list[str], most: int = 12) -> str:
    """`names` for a one-line message: the first `most`, then how many in all."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


def _file_spec(config: ml_collections.ConfigDict) -> tuple[tuple[int, ...], int]:
    return (
        _shape("data.input_shape", config.input_shape),
        _num_classes("data.num_classes", config.num_classes),
    )


def _parse_features(text: str) -> list[_Feature]:
    """Parses "name:dtype:shape[,name:dtype:shape...]", shapes like 64 or 8x8x1."""
    features = []
    for item in text.split(","):
        name, dtype, dims = (item.strip().split(":") + ["", "", ""])[:3]
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = ()
        if not name or dtype not in _DTYPES or not shape or min(shape) < 1:
            raise UserError(
                f"`data.features` '{text}' is not 'name:dtype:shape' with dtype "
                f"{' or '.join(_DTYPES)} and a shape like 64 or 8x8x1; "
                "e.g. `--config.data.features=x:float32:8x8x1`."
            )
        features.append(_Feature(name, _DTYPES[dtype], shape))
    return features


# --- shared checks and conversions -------------------------------------------------


def _labels(labels: tf.Tensor, classes: int) -> tf.Tensor:
    return tf.cast(labels, tf.int32 if classes else tf.float32)


def _shape(field: str, value: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(value) if isinstance(value, (tuple, list)) else ()
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise UserError(
            f"`{field}` ({value!r}) must be a tuple of positive ints, the shape of one "
            f"example; set e.g. `--config.{field}='(8, 8, 1)'`."
        )
    return shape


def _num_classes(field: str, value: int) -> int:
    if value < 0 or value == 1:
        raise UserError(
            f"`{field}` ({value}) must be 0 (regression) or at least 2 classes; "
            f"set e.g. `--config.{field}=10`."
        )
    return value


def _positive(field: str, value: int) -> int:
    if value < 1:
        raise UserError(f"`{field}` ({value}) must be >= 1; set e.g. `--config.{field}=1000`.")
    return value
