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

# Each source module registers itself on import.
from trainer.data import csv, ctr, digits, synthetic, tfrecord  # noqa: F401
from trainer.data.base import SHARDING, Dataset, DataSpec, check, get, names

__all__ = ["SHARDING", "DataSpec", "Dataset", "check", "get", "names"]
