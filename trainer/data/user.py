"""The user's own input pipeline: `--config.data.name=module.path:function`.

The function is the `tf.distribute` `dataset_fn` with the split and the global
batch size added::

    def dataset_fn(input_context, split, global_batch_size) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        files = tf.data.Dataset.list_files(f"/data/{split}-*", shuffle=False)
        files = files.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        records = files.interleave(tf.data.TFRecordDataset).map(parse)
        if split == "train":
            records = records.shuffle(10_000, seed=0)
        return records.batch(batch, drop_remainder=split == "train")

Its parameters are passed by name when they carry these names (in any order,
e.g. `def dataset(split, input_context, global_batch_size)`), else in this
order (see `towerflow.calls`). `split` is "train" or "eval". It yields batches
of `(features, labels)` or `(features, labels, sample_weights)`, features a
tensor, a tuple or a dict of named tensors, batched to the per-replica size and sharded by
`input_pipeline_id` (each pipeline reads its own part). towerflow makes of it
the same `Dataset` the built-in sources give:

- train: the function's stream repeated without end (`Dataset.repeat`), so
  its end is the start of the next epoch;
- eval: one pass of the function's stream, which must end.

Resume: a run restarted at step `k` skips the batches steps 0, ..., k-1 took
from each pipeline (k times the replicas it feeds), reading them without
training on them. The restarted run sees exactly the batches the
uninterrupted one would have seen when the pipeline is
deterministic: shuffles seeded (`shuffle(..., seed=...)`), no
`deterministic=False` maps, and files listed in a fixed order. The skipped
batches are read again, so resuming costs the time it takes to read them.

The spec: `input_shape` is one example's shape when the features are one
tensor of known shape (else None: the model builder reads its inputs from the
data), `num_classes` is `data.num_classes`, and the split sizes are unknown.
The config's `seed` does not reach the function: it seeds its own shuffles.
`data.sharding=off` hands it a context of one pipeline, so it reads everything.

Files: a function with a parameter named `files` gets the files to read, a
1-D string tensor: those of `data.train_files` (train) or `data.eval_files`
(eval), in name order. With `data.follow=true` the train split calls it once
per file as the files arrive (`files` holds that one file, the context is one
pipeline's) and takes its examples one by one (`Dataset.unbatch`), so a
follower batches them across files and keeps its position in examples,
exactly as for `csv` and `tfrecord` (`trainer.data.follow`). Its train split
then reads `files` in order, unshuffled, and keeps every example (no
`drop_remainder=True`, which would drop the end of each file).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import ml_collections
import tensorflow as tf

from towerflow import calls
from towerflow.errors import UserError
from trainer.data.base import (
    DatasetFn,
    DataSpec,
    Settings,
    check_classes,
    listed,
    ready,
    stream_position,
)

SIGNATURE = calls.Signature(
    "dataset_fn", ("input_context", "split", "global_batch_size"), "tf.data.Dataset"
)
FILES_SIGNATURE = calls.Signature(
    "dataset_fn", ("input_context", "split", "global_batch_size", "files"), "tf.data.Dataset"
)
EXPECTED = f"a function {SIGNATURE}"
_FILE_BATCH = 256  # the global batch of the calls that read one followed file (unbatched)
_PROBE_BATCH = 2  # the global batch of the calls made to read the structure at start-up
_TENSORS = (tf.TensorSpec, tf.RaggedTensorSpec, tf.SparseTensorSpec)
_STRUCTURE = (
    "batches of `(features, labels)` or `(features, labels, sample_weights)`, each a "
    "tensor, a tuple or a dict of tensors"
)

PipelineFn = Callable[[tf.distribute.InputContext, str, int], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class PipelineDataset:
    """The `Dataset` of a user's `dataset_fn(input_context, split, global_batch_size)`.

    Attributes:
      spec: shapes and classes, for building the model; sizes unknown.
      fn: the user's function.
      name: its `data.name`, for messages.
      settings: the memory budget; `data.sharding=off` gives the function a
        context of one pipeline (other values: the context as it is).
      files: each split's files, where the function takes `files`; else None.
    """

    spec: DataSpec
    fn: PipelineFn
    name: str
    settings: Settings = Settings()
    notes: tuple[str, ...] = ()
    files: dict[str, tuple[str, ...]] | None = None

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The function's train stream, endless, from the batches of step `start_step`.

        Args:
          global_batch_size: examples per step over all replicas.
          seed: unused; the user's pipeline seeds its own shuffles.
          start_step: skip the batches that steps 0, ..., start_step - 1 took.
          start_batch: skip this pipeline's share of these per-replica batches
            instead (steps of other replica counts: `base.stream_position`).
        """
        del seed

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            position = stream_position(start_step, context, start_batch)
            first = position // context.num_input_pipelines
            batches = self._call(self.settings.context(context), "train", global_batch_size)
            return self.settings.apply(batches.repeat().skip(first))

        return dataset_fn

    def eval_fn(self, global_batch_size: int) -> DatasetFn:
        """One pass of the function's eval stream."""

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            batches = self._call(self.settings.context(context), "eval", global_batch_size)
            return self.settings.apply(batches)

        return dataset_fn

    def check(self) -> None:
        """Reads the first batch of each split: both yield batches, and eval ends.

        An exception the user's code raises keeps its own traceback.

        Raises:
          UserError: a split yields nothing, yields the wrong structure, or eval never ends.
        """
        for split in ("train", "eval"):
            batches = self._call(tf.distribute.InputContext(), split, _PROBE_BATCH)
            if split == "eval" and batches.cardinality() == tf.data.INFINITE_CARDINALITY:
                raise UserError(
                    f"`data.name` '{self.name}' gives an endless 'eval' split; evaluation is "
                    "one pass: leave `repeat()` out of the eval pipeline."
                )
            if next(iter(batches), None) is None:
                raise UserError(
                    f"`data.name` '{self.name}' yielded no batches for the '{split}' split; "
                    "give it data (and no `drop_remainder=True` with fewer examples than a batch)."
                )

    def read_file(self, name: tf.Tensor) -> tf.data.Dataset:
        """The examples of one training file, one by one: the function given that file.

        For `data.follow` (`trainer.data.follow`), where the function takes `files`.
        """
        files = tf.reshape(name, [1])
        one = tf.distribute.InputContext()
        return self._call(one, "train", _FILE_BATCH, files).unbatch()

    def _call(
        self,
        context: tf.distribute.InputContext,
        split: str,
        global_batch_size: int,
        files: tf.Tensor | None = None,
    ) -> tf.data.Dataset:
        """The user's dataset for `split`, checked to be a tf.data.Dataset of batches.

        `files` (where the function takes them) defaults to all of the split's.
        """
        args = (context, split, global_batch_size)
        if self.files is not None:
            if files is None:
                files = tf.constant(self.files[split], tf.string, shape=[len(self.files[split])])
            args += (files,)
        dataset = self.fn(*args)
        _check_structure(self.name, split, dataset)
        return dataset


def dataset(config: ml_collections.ConfigDict, fn: PipelineFn, origin: str = "") -> PipelineDataset:
    """The `Dataset` of the user's `fn`, named by `data.name`.

    Calls `fn` once (train split, a context of one pipeline) to read the
    structure of its batches; iterates nothing. `fn` takes its parameters by
    name or in order (`towerflow.calls`).

    Raises:
      UserError: `data.num_classes` is not a class count, `fn` cannot be called
        as `SIGNATURE`, or it returns no tf.data.Dataset of batches of
        `(features, labels[, sample_weights])`.
    """
    classes = check_classes("data.num_classes", config.num_classes)
    files = _files(config) if takes_files(fn) else None
    signature = SIGNATURE if files is None else FILES_SIGNATURE
    fn = calls.adapt(fn, signature, origin or f"`data.name` '{config.name}'")
    found = PipelineDataset(DataSpec(None, classes, None, None), fn, config.name, files=files)
    batches = found._call(tf.distribute.InputContext(), "train", _PROBE_BATCH)
    features = batches.element_spec[0]
    shape = None
    if isinstance(features, tf.TensorSpec) and features.shape[1:].is_fully_defined():
        shape = tuple(features.shape[1:])
    return dataclasses.replace(found, spec=DataSpec(shape, classes, None, None))


def takes_files(fn: Callable) -> bool:
    """Whether the user's `dataset_fn` has a parameter named `files` (the files to read)."""
    try:
        return "files" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def _files(config: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]]:
    """Each split's files in name order (`data.train_files`, `data.eval_files`).

    Raises:
      UserError: `data.follow` with no ready file of `data.train_files` at start-up.
    """
    follow = config.get("follow", False)
    found = {}
    for split, field in (("train", "train_files"), ("eval", "eval_files")):
        pattern = config.get(field, "")
        paths = sorted(tf.io.gfile.glob(pattern)) if pattern else []
        if split == "train" and follow:
            paths = [path for path in paths if ready(path)]
            if not paths:
                raise UserError(
                    f"No file matches `data.train_files` '{pattern}', and `data.follow` with a "
                    "`dataset_fn` that takes `files` needs one at start-up (the model's inputs "
                    "come from it); give the glob, write the first file, then start."
                )
        found[split] = tuple(paths)
    return found


def _check_structure(name: str, split: str, dataset: object) -> None:
    """Raises UserError unless `dataset` is a tf.data.Dataset of the batches a task takes."""
    if not isinstance(dataset, tf.data.Dataset):
        raise UserError(
            f"`data.name` '{name}' returned {type(dataset).__name__} for the '{split}' split, "
            f"not a tf.data.Dataset; return a dataset of {_STRUCTURE}."
        )
    element = dataset.element_spec
    parts = element if isinstance(element, tuple) and len(element) in (2, 3) else None
    if parts is None or not all(_is_tensors(part) for part in parts):
        raise UserError(
            f"`data.name` '{name}' yielded {describe(element)} for the '{split}' split; "
            f"it must yield {_STRUCTURE}."
        )


def _is_tensors(spec: object) -> bool:
    """A tensor, or a tuple or dict of them (nested as deep as the user likes)."""
    if isinstance(spec, _TENSORS):
        return True
    if isinstance(spec, dict):
        return all(isinstance(key, str) and _is_tensors(v) for key, v in spec.items())
    return isinstance(spec, tuple) and all(_is_tensors(v) for v in spec)


def describe(spec: object) -> str:
    """One line for what a dataset yields, e.g. `{x: float32[?, 3], y: int64[?]}`."""
    if isinstance(spec, _TENSORS):
        kind = {tf.RaggedTensorSpec: "ragged ", tf.SparseTensorSpec: "sparse "}.get(type(spec), "")
        if spec.shape.rank is None:
            return f"{kind}{spec.dtype.name}[...]"
        dims = ", ".join("?" if d is None else str(d) for d in spec.shape.as_list())
        return f"{kind}{spec.dtype.name}[{dims}]"
    if isinstance(spec, dict):
        return "{" + listed([f"{key}: {describe(v)}" for key, v in spec.items()]) + "}"
    if isinstance(spec, tuple):
        return "(" + listed([describe(v) for v in spec]) + (",)" if len(spec) == 1 else ")")
    return type(spec).__name__
