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

import trainer.loop.options as loop_options

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
    # The table: hashed or dynamic, and the dynamic table's options (`model.embedding`,
    # `model.capacity`, ...), declared in trainer/loop/options.py (`TableOptions`).
    c.model.update(loop_options.TABLES.defaults())
    c.model.hidden_units = (64, 32)
    c.model.dropout = 0.0

    c.train.steps = 600
    c.train.global_batch_size = 256
    c.train.checkpoint_every = 300
    c.eval.every = 0
    c.eval.global_batch_size = 1024
    c.optimizer.learning_rate = 3e-3
    return c
