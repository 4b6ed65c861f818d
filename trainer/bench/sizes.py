"""The benchmark's sizes (full and `--quick`) and the configs its cases train."""

from __future__ import annotations

import dataclasses

import ml_collections

CASES = (
    "small_mlp",
    "dense_large",
    "input",
    "strategies",
    "startup",
    "checkpoint",
    "multi_host",
    "gradients",
    "stragglers",
    "data_service",
    "tables",
    "elastic",
    "tables_quality",
    "table_lookups",
    "retrieval",
    "online",
)
SINGLE_PROCESS = ("one_device", "mirrored", "central_storage")
LOGICAL_CPUS = 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model, data and run lengths of one benchmark size."""

    small_input: int = 64  # small_mlp: input features
    small_hidden: tuple[int, ...] = (512, 512)  # ~300k parameters
    small_batch: int = 128
    small_loops: int = 2  # timed towerflow loops per repetition
    large_input: int = 1024
    large_hidden: tuple[int, ...] = (2048, 2048, 2048, 2048)  # ~15M parameters
    large_batch: int = 512
    # Timed steps per repetition: 0.6 s in bfloat16, 1.5 s in float32. With 4 (0.3 s in
    # bfloat16, under one loop of `steps_per_loop=0`) a loop's fixed cost weighed 2%.
    large_steps: int = 8
    peak_n: int = 2048  # side of the square matmuls of the float32 peak
    examples: int = 100_000  # synthetic examples
    steps_per_loop: int = 0  # 0: the config's default
    ckpt_hidden: tuple[int, ...] = (2048, 2048, 2048)  # ~8.5M parameters: ~100 MB with Adam
    cluster_steps: int = 300  # steps of each local-cluster run
    loop1_steps: int = 41  # small_mlp with one step per loop: steps per repetition
    startup_reps: int = 3
    clusters: tuple[str, ...] = ("multi_worker", "parameter_server")  # local clusters timed
    host_links: tuple[str, ...] = ("raw", "10gbit", "1gbit")  # multi_host: `multi_host.LINKS`
    host_models: tuple[str, ...] = ("default", "dense")  # multi_host: the models timed
    host_steps: int = 2000  # multi_host: timed steps of the default model (of dense: below)
    host_dense_steps: int = 30
    # gradients: multi_worker on 2 local workers (one core each), the dense_large MLP.
    gradient_steps: int = 24  # timed steps of each run (k micro-batches: 1/k of them, >= 4)
    transfers: tuple[str, ...] = ("float32", "bfloat16", "float32_packs", "bfloat16_packs")
    accumulation: tuple[int, ...] = (1, 4, 16)  # micro-batches of large_batch / 2 per worker
    accuracy_steps: int = 1000  # the default digits job, float32 against bfloat16 transfer
    # stragglers: the digits job on 3 parameter_server workers, worker 2 sleeping before batches.
    straggler_s: float = 0.05  # its sleep per batch
    straggler_steps: int = 1000  # steps of each run (the default job's)
    straggler_loop: int = 100  # steps per loop, and between evaluations
    # The runs (`stragglers.RUNS`): sync k = 3 and 2, async staleness none and scale.
    straggler_runs: tuple[str, ...] = ("sync_k3", "sync_k2", "async_none", "async_scale")
    # data_service: steps of each trial of its 2-trial sweeps (the `busy` pipeline).
    service_sweep_steps: int = 300
    # tables: the ctr job (configs/ctr.py).
    table_examples: int = 1_000_000  # ctr examples (`data.ctr.num_examples`)
    table_cluster_rounds: int = 3  # rounds of the two ps clusters (hashed, dynamic), in turn
    table_cluster_steps: int = 1000  # timed steps of each (300 swung the ratio 1.2 to 1.6)
    table_mirrored_steps: int = 100  # timed steps of each mirrored run, sparse and dense
    table_steps: int = 600  # steps of each quality run (the ctr job's own)
    table_ids: int = 10_000_000  # distinct ids of the scale run, over 2 ps members
    # tables_quality: the drifting Zipf(1.1) stream, hashed against dynamic at equal bytes.
    quality_steps: int = 2400  # steps of 256 of each run
    quality_ids_per_field: int = 20_000  # ranks a field's values are drawn over
    # Runs of each table, seeded 0, 1, ...: one run's AUC moves by up to 0.01 with the seed.
    quality_seeds: int = 5
    # Full against incremental checkpoints: one run of this many steps, saving every
    # `checkpoint_intervals` steps, into a dynamic table of `incremental_rows` rows.
    incremental_steps: int = 400
    checkpoint_intervals: tuple[int, ...] = (10, 100)
    incremental_rows: int = 100_000
    # elastic: the digits job on an elastic group of 3 that loses one member at a step.
    elastic_steps: int = 1000  # steps of the job (the default job's)
    elastic_loop: int = 10  # steps per loop: the first step of the group of 2 is its first block
    elastic_kill_at: int = 200  # the chief's reported step at which member 2 gets SIGKILL
    # table_lookups: a dynamic table holding this many ids, looked up in batches of this many.
    lookup_ids: int = 1_000_000
    lookup_batch: int = 4096
    # online: examples/online.py's click job, followed against fixed, on files of this many.
    online_strategies: tuple[str, ...] = ("one_device", "multi_worker", "parameter_server")
    online_steps: int = 400  # timed steps of each run (of 128 records)
    online_loop: int = 20  # steps per loop: a parameter_server unit is 10 steps, within a file
    online_file_records: int = 2560  # 20 steps a file
    online_latency_files: int = 20  # files written one at a time, each timed to its export


FULL = Sizes()
QUICK = Sizes(
    small_input=16,
    small_hidden=(32,),
    small_batch=32,
    small_loops=2,
    large_input=64,
    large_hidden=(128, 128),
    large_batch=64,
    large_steps=4,
    peak_n=256,
    examples=2_000,
    steps_per_loop=10,
    ckpt_hidden=(64,),
    cluster_steps=20,
    loop1_steps=6,
    startup_reps=1,
    # One cluster runs the `strategies` case's cluster path; a parameter-server cluster's
    # three processes would add ~10 s to start and stop (its trainer has tests of its own).
    clusters=("multi_worker",),
    host_links=("1gbit",),
    host_models=("default",),
    host_steps=30,
    gradient_steps=4,
    transfers=("float32", "bfloat16"),
    accumulation=(1,),  # its path is the float32 run's, with another batch
    accuracy_steps=0,  # not run
    straggler_s=0.02,
    straggler_steps=20,
    straggler_loop=10,
    straggler_runs=("sync_k2",),  # one cluster; the others' paths: tests/test_ps_sync.py
    service_sweep_steps=10,
    table_examples=20_000,
    table_cluster_rounds=1,
    table_cluster_steps=20,
    table_mirrored_steps=10,
    table_steps=20,
    table_ids=10_000,
    quality_steps=100,
    quality_ids_per_field=2_000,
    quality_seeds=1,
    incremental_steps=30,
    checkpoint_intervals=(5, 10),
    incremental_rows=5_000,
    elastic_steps=200,
    elastic_loop=10,
    elastic_kill_at=50,
    lookup_ids=20_000,
    lookup_batch=512,
    online_strategies=("one_device",),  # the worker-lost run starts a parameter_server cluster
    online_steps=16,
    online_loop=8,
    online_file_records=512,
    online_latency_files=2,
)


def make_config(
    sizes: Sizes, strategy: str, hidden, input_size: int, batch: int, **fields
) -> ml_collections.ConfigDict:
    """The default config on synthetic data, a model and batch, a long run, no checkpoints or evals.

    Args:
      sizes: the benchmark's sizes (examples, loop length).
      strategy: the strategy's name.
      hidden: the MLP's hidden units.
      input_size: features per example.
      batch: the global batch size.
      **fields: more "a.b.c": value overrides.
    """
    import configs.default

    config = configs.default.get_config()
    config.strategy.name = strategy
    config.devices.logical_cpus = LOGICAL_CPUS
    config.data.name = "synthetic"
    config.data.synthetic.input_shape = (input_size,)
    config.data.synthetic.num_examples = sizes.examples
    config.model.hidden_units = tuple(hidden)
    # Dropout's seed state cannot be updated in a replica under central_storage (TF's
    # AggregatingVariable refuses it), so no contender uses dropout.
    config.model.dropout = 0.0
    config.train.global_batch_size = batch
    # The figures are a long run's (the contenders stop where they are timed): a run of
    # 50,000 steps or more traces a small step's loop unrolled (`strategies.unrolled`).
    config.train.steps = 1_000_000
    return timing_only(config, sizes, fields)


def timing_only(
    config: ml_collections.ConfigDict, sizes: Sizes, fields: dict
) -> ml_collections.ConfigDict:
    """`config` with no checkpoints, exports or evals, the sizes' loop length, then `fields`."""
    config.train.checkpoint_every = 0  # the `checkpoint` case measures saves
    config.train.export = False
    config.eval.every = 0
    if sizes.steps_per_loop:
        config.train.steps_per_loop = sizes.steps_per_loop
    config.update_from_flattened_dict(fields)
    return config


def small_config(sizes: Sizes, strategy: str, **fields) -> ml_collections.ConfigDict:
    """`make_config` of the small MLP (`small_mlp`, `input`, `strategies`)."""
    return make_config(
        sizes, strategy, sizes.small_hidden, sizes.small_input, sizes.small_batch, **fields
    )


def default_strategy() -> str:
    """The strategy the default config names."""
    import configs.default

    return configs.default.get_config().strategy.name


def case_strategy(case: str) -> str:
    """The strategy a case's process is set up for (logical CPUs, threads per op)."""
    # A table's lookups serve from one device, each op open to every core, as a server's.
    return "one_device" if case in ("dense_large", "table_lookups") else default_strategy()


def parameters(config: ml_collections.ConfigDict) -> int:
    """The parameter count of the model `config` builds."""
    from trainer import data
    from trainer.loop import models

    return models.build(config.model, data.get(config.data).spec).count_params()
