"""Input pipelines for `tf.distribute`: built-in sources and the user's own.

`get(config.data)` builds a `Dataset`: a `DataSpec` (one example's shape, the
class count, the split sizes) and two factories. `train_fn(global_batch_size,
seed, start_step)` and `eval_fn(global_batch_size)` return the
`dataset_fn(input_context)` that `Strategy.distribute_dataset` calls once per
input pipeline. Each yields batches of `(features, labels)` (or `(features,
labels, sample_weights)`) of the per-replica size, from that pipeline's shard
only; features are one tensor, or a dict of named tensors::

    dataset = data.get(config.data)
    batches = strategy.distribute_dataset(dataset.train_fn(128, seed=0))

The train stream is endless, shuffled anew each epoch from `seed`, and the
same on every run: `start_step=k` begins exactly where step `k` of a run from
step 0 would be, so a restarted job sees the batches it would have seen
(`start_batch=n` instead begins at per-replica batch `n` of the stream, for an
elastic run whose groups trained other numbers of replicas). The eval stream
is one ordered pass in which every example counts once.

Sources, one module each, behind that one interface (`base.Dataset`):

- indexed (`digits`, `synthetic`, `ctr`): example `i` can be made directly, so
  each epoch is a stateless permutation of the indices (a full shuffle, no
  buffer) and resuming jumps straight to its position;
- files (`tfrecord`, `csv`): records are read in order and shuffled with a
  `data.shuffle_buffer`-sized buffer; resuming skips records before they are
  parsed. `data.features` names the features to read, of mixed dtypes and
  shapes, and the defaults of missing values (`features.py`); a label of
  class names goes through `data.label_vocabulary` (`labels.py`). CSV files
  are parsed once at start-up, which finds a bad value's line and gives the
  split sizes; every TFRecord is looked at once too (its features' presence,
  its label);
- the user's own `dataset_fn` (`data.name=module.path:function`, `user.py`):
  resuming skips the batches already trained on, exact for a deterministic
  pipeline.
"""

from __future__ import annotations

import ml_collections

# Each source module registers itself on import.
from trainer.data import csv, ctr, digits, follow, synthetic, tfrecord, user  # noqa: F401
from trainer.data.base import (
    BUILDERS,
    SHARDING,
    Dataset,
    DataSpec,
    Settings,
    check,
    names,
    settings,
)
from trainer.data.base import with_settings as _with_settings

__all__ = ["SHARDING", "DataSpec", "Dataset", "check", "from_function", "get", "names"]


def get(config: ml_collections.ConfigDict, checked: Settings | None = None) -> Dataset:
    """Builds the dataset that `config` (the `data` part of a config) describes.

    `data.name` is a built-in source (`names()`) or the user's own input
    pipeline as "module.path:function" (see `trainer.data.user`). `checked` is
    `settings(config)`, where the caller already has it.

    Raises:
      UserError: an unknown name, a reference that does not resolve, or a bad
        value; the message names the field. An exception raised by the user's
        own code keeps its traceback.
    """
    checked = checked or settings(config)  # before any file is read
    if config.name in BUILDERS:
        dataset = BUILDERS[config.name](config)
    else:
        dataset = user.dataset(config, BUILDERS.lookup("data.name", config.name, user.EXPECTED))
    return follow.wrap(_with_settings(dataset, checked), config)


def from_function(
    config: ml_collections.ConfigDict,
    fn: user.PipelineFn,
    name: str,
    checked: Settings | None = None,
) -> Dataset:
    """The `Dataset` of a task's own `dataset_fn`, with the `data` config's settings.

    Args:
      config: the `data` part of a config (its memory budget, sharding and class count).
      fn: `fn(input_context, split, global_batch_size) -> tf.data.Dataset`.
      name: how messages name it: the task's `task.name`.
      checked: `settings(config)`, where the caller already has it.
    """
    checked = checked or settings(config)
    named = config.copy_and_resolve_references()
    named.name = name
    origin = f"`task.name` '{name}' `dataset_fn`"
    return follow.wrap(_with_settings(user.dataset(named, fn, origin), checked), config)
