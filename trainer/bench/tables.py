"""The `tables` case: dynamic embedding tables (`DynamicEmbedding`) against static ones.

Figures, measured side by side in one run:

1. `parameter_server` step time (local clusters of 2 workers and 2 ps,
   `configs/ctr.py`): `model.embedding=dynamic` against `hashed` (a static
   `ShardedEmbedding`) with as many rows (`model.capacity` = `model.vocab_size`),
   from the chief's clock marks over `Sizes.table_cluster_steps` steps,
   `Sizes.table_cluster_rounds` rounds of the two in turn; the ratio
   dynamic/hashed (target <= 1.3), the median of the rounds' ratios. Beside
   it, each task type's CPU milliseconds per step (the cluster's 5 processes
   share this machine's cores, so the step costs what they use together),
   and the ratio of their totals.
2. `mirrored` on 4 logical CPUs (`UPDATE_CPUS`, in a child process:
   `python -m trainer.bench.tables updates`): the ctr job with sparse updates
   (the optimizers of `trainer.loop.optim`) against dense ones
   (`optimizer.sparse_updates=False`: the table's gradient made dense, every
   row of every replica's copy updated); the speedup (target >= 5), and beside
   it the same under `one_device`.
3. Quality at equal memory (`mirrored`): eval AUC of a dynamic table admitting
   ids seen twice (`model.min_count=2`) against a hashed table of the same row
   count. On today's ctr source (no drifting long-tail id option yet), whose
   ids are permuted into the vocabulary without collisions.
4. Scale: `Sizes.table_ids` distinct ids inserted into a `DynamicEmbedding`
   split over 2 ps members (in-process `tf.distribute.Server`s on 127.0.0.1,
   in a child process: `python -m trainer.bench.tables scale`), with Adam's slots:
   bytes held per id, by the process's RSS growth and by the table's own
   figures (`describe()`), against `(dim + slots) x 4`; lookups per second
   per ps member.
5. Incremental against full checkpoints (`train.full_checkpoint_every`,
   `trainer.loop.deltas`): the ctr job with a dynamic table of
   `Sizes.incremental_rows` rows on the drifting long tail (`DRIFTING`), one
   `one_device` run; every I steps (each of `Sizes.checkpoint_intervals`) a
   full checkpoint and, at the same step, one of a `Checkpointer` with
   `full_every=2I` (full every 2I steps, a delta I steps later), each
   written synchronously and timed alone. At the deltas' steps: bytes on
   disk and seconds per save of each, their ratios, and the share of the
   rows held that the delta holds (touched in the I steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import socket
import sys
import tempfile
import time

from trainer.bench import clock, contenders
from trainer.bench.harness import (
    alternate,
    child,
    cluster_marks,
    medians,
    note,
    paired,
    result,
    tail,
)
from trainer.bench.sizes import LOGICAL_CPUS, Sizes, timing_only

EMBEDDINGS = ("hashed", "dynamic")
UPDATE_STRATEGIES = ("mirrored", "one_device")  # sparse against dense updates
UPDATE_CPUS = 4  # logical CPUs (so `mirrored` replicas) of the sparse/dense comparison
SPEEDUP = "mirrored sparse/dense speedup (target >= 5)"
SCALE_DIM = 32  # the ctr table's width


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """The five figures of the module docstring; ratios beside their targets."""
    samples = updates_run(sizes, reps, workdir)
    for _ in range(sizes.table_cluster_rounds):  # each round is two whole local clusters
        for kind in EMBEDDINGS:
            step_s, cpu = cluster_step_s(sizes, kind, workdir)
            samples.setdefault(f"ps_{kind}_step_s", []).append(step_s)
            for task_type, ms in cpu.items():
                samples.setdefault(f"ps_{kind}_{task_type}_cpu_ms", []).append(ms)
    figures = medians(samples)
    ratios = {
        "ps dynamic/hashed step time": _ratio(samples, "ps_dynamic_step_s", "ps_hashed_step_s"),
    }
    cpu = {k: v for k, v in samples.items() if k.endswith("_cpu_ms")}
    if cpu:  # a run too short to be sampled twice has none
        ratios["ps dynamic/hashed CPU per step"] = paired(
            cpu, lambda r: _total(r, "dynamic") / (_total(r, "hashed") or math.nan)
        )
    for strategy in UPDATE_STRATEGIES:
        name = SPEEDUP if strategy == "mirrored" else f"{strategy} sparse/dense speedup"
        ratios[name] = _ratio(
            samples, f"{strategy}_sparse_examples_s", f"{strategy}_dense_examples_s"
        )
    aucs = quality(sizes, workdir)
    figures.update(aucs)
    scale = scale_run(sizes, workdir)
    figures.update({k: scale[k] for k in ("bytes_per_id_rss", "bytes_per_id_tables")})
    figures["lookups_s_per_ps_member"] = scale["lookups_s_per_ps_member"]
    ratios["bytes per id (rss) / (dim + slots) x 4"] = scale["bytes_per_id_rss"] / scale["floor"]
    ratios["bytes per id (tables) / (dim + slots) x 4"] = (
        scale["bytes_per_id_tables"] / scale["floor"]
    )
    saves = incremental(sizes, workdir)
    samples.update(saves)
    _add_saves(saves, sizes.checkpoint_intervals, figures, ratios)
    return result(
        "s/step, examples/s, AUC, bytes, lookups/s",
        figures,
        ratios,
        samples,
        auc_dynamic_minus_hashed=aucs["auc_dynamic_min_count2"] - aucs["auc_hashed"],
        targets={
            "ps dynamic/hashed step time": "<= 1.3",
            SPEEDUP: ">= 5",
            "bytes per id / (dim + slots) x 4": "<= 1.5",
        },
        scale=scale,
        notes=[
            "quality: the drifting long tail of raw ids (`DRIFTING`: Zipf 1.2 over 1M values "
            "a field, a new id every 1,000 examples, lists of up to 4) into 20,000 rows",
            "bytes_per_id_rss: the RSS growth of the process holding the 2 in-process ps "
            "servers; bytes_per_id_tables: `DynamicEmbedding.describe()` (variables' bytes "
            "and the index's estimate, `trainer.layers.tables.ENTRY_BYTES`)",
            f"incremental: a table of {sizes.incremental_rows} rows (Adam) on the drifting "
            "long tail, one_device; each delta I steps after its full checkpoint, beside a "
            "full one of the same step; rows_touched_share: the delta's rows over the ids held",
        ],
    )


def _add_saves(saves: dict, intervals, figures: dict, ratios: dict) -> None:
    """The incremental and full checkpoints' medians into `figures`, their ratios into `ratios`."""
    for interval in intervals:
        for what in ("bytes", "save_s", "rows_touched_share"):
            names = [f"{kind}_{what}_every{interval}" for kind in ("full", "incremental")]
            figures.update(medians({n: saves[n] for n in names if n in saves}))
        for what in ("bytes", "save_s"):
            ratios[f"incremental/full {what} every {interval} steps"] = _ratio(
                saves, f"incremental_{what}_every{interval}", f"full_{what}_every{interval}"
            )


def _total(figures: dict[str, float], kind: str) -> float:
    """The CPU ms per step of every task type of the `kind` table's cluster."""
    return sum(v for k, v in figures.items() if k.startswith(f"ps_{kind}_"))


def _ratio(samples: dict[str, list[float]], top: str, bottom: str) -> float:
    """`top` over `bottom`, paired over the rounds that ran both."""
    return paired({k: samples[k] for k in (top, bottom)}, lambda r: r[top] / r[bottom])


def ctr_config(sizes: Sizes, strategy: str, logical_cpus: int = LOGICAL_CPUS, **fields):
    """`configs/ctr.py` at this size: no checkpoints, exports or evals."""
    import configs.ctr

    config = configs.ctr.get_config()
    config.strategy.name = strategy
    config.devices.logical_cpus = logical_cpus
    config.data.ctr.num_examples = sizes.table_examples
    return timing_only(config, sizes, fields)


def updates_run(sizes: Sizes, reps: int, workdir: str) -> dict[str, list[float]]:
    """`mirrored_updates` in a child process split into `UPDATE_CPUS` logical CPUs."""
    sizes_json = json.dumps(dataclasses.asdict(sizes))
    samples = _child_json("updates", [sizes_json, str(reps)], workdir)
    for strategy in UPDATE_STRATEGIES:
        sparse, dense = (samples[f"{strategy}_{k}_examples_s"] for k in ("sparse", "dense"))
        speedups = ", ".join(f"{a / b:.2f}" for a, b in zip(sparse, dense))
        note(f"  {strategy} sparse/dense speedup of each repetition: {speedups}")
    return samples


def mirrored_updates(sizes: Sizes, reps: int, workdir: str) -> dict[str, list[float]]:
    """examples/s of the ctr job, sparse against dense updates, in turn.

    Under `mirrored` (the figure asked for) and, beside it, `one_device`; in
    a process split into `UPDATE_CPUS` logical CPUs (`updates_run`).
    """
    runs = {}
    for strategy in UPDATE_STRATEGIES:
        for name, sparse in (("sparse", True), ("dense", False)):
            fields = {"optimizer.sparse_updates": sparse}
            config = ctr_config(sizes, strategy, UPDATE_CPUS, **fields)
            model_dir = os.path.join(workdir, f"tables-{strategy}-{name}")
            loop = config.train.steps_per_loop
            steps = loop * max(1, sizes.table_mirrored_steps // loop)
            runs[f"{strategy}_{name}_examples_s"] = contenders.towerflow(
                config, contenders.plugin(strategy), model_dir, steps + loop
            )
    return alternate(runs, reps)


def cluster_step_s(sizes: Sizes, embedding: str, workdir: str) -> tuple[float, dict]:
    """Seconds per step of the ctr job on 2 workers and 2 ps with `embedding`.

    And each task type's CPU milliseconds per step (`harness.cluster_cpu_ms`,
    the members of a type summed): on cores the cluster's processes share, the
    step costs what they use together.
    """
    config = ctr_config(sizes, "parameter_server")
    overrides = {
        "model.embedding": embedding,
        "model.capacity": config.model.vocab_size,  # as many rows as the hashed table
        "data.ctr.num_examples": sizes.table_examples,
    }
    model_dir = tempfile.mkdtemp(prefix=f"tables-ps-{embedding}-", dir=workdir)
    args = ["--config=configs/ctr.py", "--mode=train"]
    steps, loop = sizes.table_cluster_steps, config.train.steps_per_loop
    cpu: dict[str, float] = {}
    marks = cluster_marks(["--workers=2", "--ps=2"], args, overrides, model_dir, steps, loop, cpu)
    step_s = 1.0 / clock.rate(marks, 1.0, until=steps)
    used = ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(cpu.items()))
    note(f"  parameter_server {embedding}: {step_s * 1e3:.1f} ms/step; CPU ms/step: {used}")
    return step_s, cpu


# The drifting long tail of raw ids (docs/recommendation.md): 20,000 rows for
# ids of 1M values per field, so a hashed table's rows are shared by many ids.
DRIFTING = {
    "data.ctr.id_space": "raw",
    "data.ctr.zipf_a": 1.2,
    "data.ctr.ids_per_field": 1_000_000,
    "data.ctr.drift_every": 1000,
    "data.ctr.multi_valued": 4,
    "data.ctr.vocab_size": 20_000,
}


def quality(sizes: Sizes, workdir: str) -> dict[str, float]:
    """Eval AUC under `mirrored`: hashed against dynamic (`min_count=2`) of as many rows."""
    from trainer.loop import train

    aucs = {}
    runs = {"auc_hashed": {}, "auc_dynamic_min_count2": {"model.embedding": "dynamic"}}
    for name, fields in runs.items():
        config = ctr_config(
            sizes, "mirrored", **fields, **DRIFTING, **{"train.steps": sizes.table_steps}
        )
        if fields:
            config.model.capacity = config.model.vocab_size  # the same row count
            config.model.min_count = 2
        job = train.build(config, os.path.join(workdir, f"tables-{name}"))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            results = train.run(job, "train_and_eval")
        aucs[name] = float(results["eval"]["auc"])
        note(f"  {name}: {aucs[name]:.4f}")
    return aucs


def incremental(sizes: Sizes, workdir: str) -> dict[str, list[float]]:
    """Full against incremental checkpoints, side by side in one run (item 5 above)."""
    from trainer import layers
    from trainer.loop import controller, deltas, train
    from trainer.loop.checkpoints import Checkpointer

    fields = {"model.embedding": "dynamic", "model.capacity": sizes.incremental_rows}
    fields["train.steps"] = sizes.incremental_steps
    config = ctr_config(sizes, "one_device", **DRIFTING, **fields)
    job = train.build(config, os.path.join(workdir, "tables-incremental"))
    samples: dict[str, list[float]] = {}

    def saves(interval: int) -> controller.Action:
        pair = {
            kind: Checkpointer(
                os.path.join(workdir, f"tables-{kind}-every{interval}"),
                True,
                2,
                full_every=full_every,
                **train.checkpointed(job),
            )
            for kind, full_every in (("full", 0), ("incremental", 2 * interval))
        }

        def save(output: controller.Output) -> None:
            figures = {}
            for kind, checkpointer in pair.items():
                tic = time.perf_counter()
                path = checkpointer.save(output.step)
                figures[f"{kind}_save_s"] = time.perf_counter() - tic
                figures[f"{kind}_bytes"] = sum(
                    os.path.getsize(name) for name in glob.glob(path + ".*")
                )
            if deltas.base_step(path) is None:  # a full one: nothing to set beside
                return
            parts = [p for ps in layers.table_figures(job.model).values() for p in ps]
            held = sum(part["ids_held"] for part in parts)
            figures["incremental_rows_touched_share"] = deltas.changed_rows(path) / held
            for name, value in figures.items():
                samples.setdefault(f"{name}_every{interval}", []).append(value)
            note(f"  step {output.step}, every {interval}: {figures}")

        return controller.Action(save, every=interval, name=f"saves every {interval}")

    actions = [saves(interval) for interval in sizes.checkpoint_intervals]
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        train.run(job, "train", actions)
    return samples


def scale_run(sizes: Sizes, workdir: str) -> dict:
    """`scale` in a child process (its ps servers and RSS are its own)."""
    figures = _child_json("scale", [str(sizes.table_ids)], workdir)
    note(f"  scale: {figures}")
    return figures


def _child_json(run: str, arguments: list[str], workdir: str):
    """What `python -m trainer.bench.tables RUN ARGUMENTS... JSON` writes to JSON."""
    path = os.path.join(workdir, f"tables-{run}.json")
    log = path + ".log"
    command = [sys.executable, "-m", "trainer.bench.tables", run, *arguments, path]
    with child(command, log) as process:
        process.wait()
    if process.returncode:
        raise RuntimeError(f"the {run} run exited with {process.returncode}: {tail(log)}")
    with open(path) as f:
        return json.load(f)


_SERVERS: list = []  # an in-process cluster's servers, held: they serve until the process ends


def _in_process_ps():
    """TF's `ParameterServerStrategy` over a worker and 2 ps members in this process."""
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(
        {"chief": [_address()], "worker": [_address()], "ps": [_address(), _address()]}
    )
    _SERVERS.extend(
        tf.distribute.Server(cluster, job_name=job, task_index=index)
        for job, index in (("worker", 0), ("ps", 0), ("ps", 1))
    )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc", task_type="chief", task_id=0
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def scale(ids: int, batch: int = 1 << 17) -> dict:
    """`ids` distinct ids into a `DynamicEmbedding` over 2 in-process ps members; its figures.

    Bytes per id: the RSS growth from before the table was built to after
    every id was inserted, over the ids; and `describe()`'s bytes held. The
    floor is `(dim + slots) x 4`: the row and Adam's two slots, float32.
    Lookups: eval lookups of every id, in batches of `batch`, over 2 ps members.
    """
    import numpy as np
    import tensorflow as tf

    import configs.default
    from trainer import layers
    from trainer.layers import tables
    from trainer.loop import optim

    strategy = _in_process_ps()

    def table(capacity: int):
        with strategy.scope():  # TF's own strategy: a part per ps member (`sharding.current`)
            layer = layers.DynamicEmbedding(SCALE_DIM, capacity=capacity)
            layer.build()
            optimizer = optim.build(configs.default.get_config().optimizer, 1)  # Adam
            optimizer.build(layer.trainable_variables)
        layer(tf.constant([0, 1], tf.int64), training=False)  # traced once
        return layer, optimizer

    table(16)  # a first table pays the one-time costs (code, tracing) outside the RSS growth
    before = _rss()
    # Room for the uneven split by id hash (a part over its half would evict).
    layer, optimizer = table(ids + 8 * math.isqrt(ids) + 64)
    slots = sum(part.optimizer_slots for part in layer.parts[:1]) * SCALE_DIM
    # Distinct 64-bit ids: i -> i x an odd constant is a bijection mod 2**64.
    keys = (np.arange(1, ids + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
    tic = time.perf_counter()
    for start in range(0, ids, batch):
        chunk = tf.constant(keys[start : start + batch])
        owners = tables.part_of(chunk, len(layer.parts))
        for part in layer.parts:
            part.table.admit(tf.boolean_mask(chunk, tf.equal(owners, part.index)))
    insert_s = time.perf_counter() - tic
    grown = _rss() - before
    described = layer.describe()
    held = described["ids_held"]
    if held != ids:
        raise RuntimeError(f"the table holds {held} of {ids} ids")
    tic = time.perf_counter()
    for start in range(0, ids, batch):
        layer(tf.constant(keys[start : start + batch]), training=False)
    lookup_s = time.perf_counter() - tic
    return {
        "ids": ids,
        "dim": SCALE_DIM,
        "slots": slots,
        "floor": (SCALE_DIM + slots) * 4,
        "bytes_per_id_rss": grown / ids,
        "bytes_per_id_tables": described["bytes_held"] / ids,
        "insert_s": insert_s,
        "lookups_s_per_ps_member": ids / lookup_s / len(layer.parts),
        "parts": [{k: p[k] for k in ("device", "ids_held")} for p in described["parts"]],
    }


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rss() -> int:
    with open("/proc/self/status") as f:
        line = next(li for li in f if li.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _updates_child(sizes: str, reps: int) -> dict[str, list[float]]:
    """`mirrored_updates` here, split into `UPDATE_CPUS` logical CPUs; `sizes`: as JSON."""
    from strategies import devices

    devices.configure(UPDATE_CPUS, replicas=UPDATE_CPUS)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sizes).items()}
    with tempfile.TemporaryDirectory(prefix="tables-updates-") as workdir:
        return mirrored_updates(Sizes(**fields), reps, workdir)


if __name__ == "__main__":
    # `scale_run`'s child: python -m trainer.bench.tables scale IDS JSON
    # `updates_run`'s child: python -m trainer.bench.tables updates SIZES REPS JSON
    if sys.argv[1] == "scale":
        figures = scale(int(sys.argv[2]))
    else:
        figures = _updates_child(sys.argv[2], int(sys.argv[3]))
    with open(sys.argv[-1], "w") as out:
        json.dump(figures, out)
