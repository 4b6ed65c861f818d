"""Click-through prediction with a sharded embedding table, on parameter servers.

    python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server \\
        --config=configs/ctr.py

Synthetic click logs (`data.ctr`: 8 categorical fields hashed into one
vocabulary of 200,000 ids, clicks drawn from a hidden logistic model, 35%
clicks) train a 200,000 x 32 embedding table (25.6 MB) split into 2 shards,
one on each ps member, under a small MLP; 2 workers step asynchronously. 600
steps of 256 take about 75 s on 2 CPU cores, start-up included, and reach
eval AUC 0.82 and accuracy 0.77 on 20,000 held-out examples (always "no
click" scores 0.65; the hidden model itself about 0.86 AUC). The same config
runs under other strategies (`--strategy=mirrored`: one unsharded table,
about 42 s, each step updating only the rows it looked up: on 4 logical CPUs
8 to 10 ms a step against 60 to 79 ms with `optimizer.sparse_updates=False`,
which updates every row of every replica's copy, 5.9 to 9.3 times faster on
2 cores shared at load 4 to 4.5; `python -m trainer.bench --cases=tables`).

`--config.model.embedding=dynamic` trains a `DynamicEmbedding` instead (a row
per admitted id, no vocabulary size; `model.capacity`, `model.min_count`,
`model.ttl_steps`): under `mirrored`, eval AUC 0.81 in 600 steps, at about
0.85 times the hashed table's steps/s (docs/recommendation.md).
Under `parameter_server` its table is split by id over the ps members (2
workers and 2 ps: eval AUC 0.74 in 100 steps). Either table's checkpoints
restore under any number of ps members and any strategy (`--mode=eval` on one
device from a cluster's `model_dir`; docs/recommendation.md).

`--config.data.ctr.id_space=raw` makes the ids raw int64 (or, with
`data.ctr.id_dtype=string`, strings) over the 64-bit space, with a Zipf
(`data.ctr.zipf_a`) long tail, drift (`data.ctr.drift_every`) and a
multi-valued list (`data.ctr.multi_valued`): the hashed table then hashes
them into `vocab_size` rows and collides, the dynamic one admits. At 20,000
rows, 600 steps on `one_device`: eval AUC 0.654 hashed, 0.686 dynamic with
`min_count=2` (docs/recommendation.md).
"""

import importlib.util
import pathlib

import ml_collections

# The default loaded from the file beside this one, not by `import configs`: a user's
# own `configs` package may come first on `sys.path`.
_spec = importlib.util.spec_from_file_location(
    "towerflow_configs_default", pathlib.Path(__file__).with_name("default.py")
)
default = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(default)


def get_config() -> ml_collections.ConfigDict:
    """The default config with the ctr data, model and sharding."""
    c = default.get_config()
    c.strategy.name = "parameter_server"
    c.strategy.parameter_server.partitioner = "fixed"  # split the table ...
    c.strategy.parameter_server.num_shards = 2  # ... in two, one shard per ps member

    c.data.name = "ctr"
    c.data.eval_fraction = 0.02  # 20,000 held-out examples

    c.model.name = "ctr"
    # Rows of the table: follows `data.ctr.vocab_size` unless overridden.
    c.model.vocab_size = c.data.ctr.get_ref("vocab_size")
    c.model.embedding_dim = 32  # width of each id's embedding
    # The last columns that are one list of ids (raw ids): follows `data.ctr.multi_valued`.
    c.model.multi_valued = c.data.ctr.get_ref("multi_valued")
    # hashed: a `ShardedEmbedding` of `vocab_size` rows; dynamic: a `DynamicEmbedding` (a row
    # per admitted raw id, `trainer.layers.tables`) with the options below.
    c.model.embedding = "hashed"
    c.model.capacity = 0  # dynamic: most rows held (0: `vocab_size`); evicts when full
    c.model.min_count = 1  # dynamic: lookups an id needs before it gets its own row
    c.model.ttl_steps = 0  # dynamic: free rows (and forget counts) of ids unseen this long; 0: keep
    # Keys which raw ids share a row (hashed: Keras's `Hashing` salted by it, 0: unsalted;
    # dynamic: its fallback rows) and each id's initial row (dynamic); a resume keeps it.
    c.model.table_seed = 0
    # dynamic: the table's own optimizer, e.g. "adagrad" or "ftrl" (`optimizer.name`'s names;
    # "": the model's `optimizer.name`), and its peak learning rate on the model's schedule
    # (0: `optimizer.learning_rate`); the dense layers keep `optimizer`.
    c.model.table_optimizer = ""
    c.model.table_learning_rate = 0.0
    # dynamic: which id a full table evicts: lfu (lowest count, halved every 500 steps unseen),
    # lru (least recently seen), or "" (none: a full table refuses new ids).
    c.model.eviction = "lfu"
    # dynamic: rows of a trained hashed fallback table that ids without a row read (the
    # fallback_combiner, mean or sum, of rows hash_k(id) % fallback_rows, k < fallback_hashes;
    # counted in the table's bytes); 0: one shared default row.
    c.model.fallback_rows = 0
    c.model.fallback_hashes = 2
    c.model.fallback_combiner = "mean"
    # dynamic, min_count > 1: the counts of ids not admitted yet live in a count-min sketch of
    # sketch_depth rows of sketch_width int32 cells (no memory per id; docs/tables.md: its bound).
    c.model.sketch_width = 8192
    c.model.sketch_depth = 2
    # dynamic, fallback_rows > 0: outside training, ids without a row that the table has not
    # seen in training lately read zeros (not fallback rows other ids trained); which ids it saw
    # is a Bloom filter of two generations of seen_bits bits (in the table's bytes); 0: none.
    c.model.seen_bits = 2**18
    c.model.hidden_units = (64, 32)
    c.model.dropout = 0.0

    c.train.steps = 600
    c.train.global_batch_size = 256
    c.train.checkpoint_every = 300
    c.eval.every = 0
    c.eval.global_batch_size = 1024
    c.optimizer.learning_rate = 3e-3
    return c
