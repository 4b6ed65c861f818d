"""The `table_lookups` case: a dynamic table's lookups outside training, and its training step.

A `DynamicEmbedding` of width `WIDTH` holding `Sizes.lookup_ids` ids, every
row written (as after training: each row's stamp is its id's, and the index
marks it written, `DynamicTable.mark_written`), looked up in
batches of `Sizes.lookup_batch` ids drawn uniformly from those held, one
call per batch:

- `eval_int64`, `eval_string`: `layer(ids, training=False)` in a
  `tf.function`, with int64 ids and with string ids (a table of its own);
- `export_int64`, `export_string`: the SavedModel that `trainer.loop.export`
  writes of a model of the table alone, loaded here (`tf.saved_model.load`),
  its `serving_default` signature called;
- `train_step_ms`: one training step of the int64 table alone (the lookup
  with admission, the gradient, `trainer.loop.optim`'s Adam update of the
  rows looked up), on ids it holds, the median of the wall clock; beside it
  `train_step_cpu_ms`, the mean CPU time of this process a step.

Lookups in ids/s of the wall clock, and beside each its ids per CPU second
of this process (`..._ids_per_cpu_s`: on a machine shared with other work,
less moved by it than the wall clock); beside them TensorFlow
Recommenders-Addons 0.8.1's table as recorded on the development machine
(`TFRA_IDS_S`, not run here: TFRA is not a dependency), and each figure's
ratio to its low end (target >= 1). Every repetition times each contender
once, in turn. The export's time is noted.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from trainer.bench.harness import alternate, medians, note, result
from trainer.bench.sizes import Sizes

WIDTH = 32  # the ctr table's width
# TFRA 0.8.1's `tfra.dynamic_embedding` table of 1M ids, batches of 4,096, recorded on the
# development machine (2 cores) side by side with towerflow, quiet (issue 43): ids/s.
TFRA_IDS_S = (2.71e6, 2.93e6)
PASSES = 64  # batches per timed pass
KINDS = ("int64", "string")


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """The figures of the module docstring, and each lookup's ratio to TFRA's recorded figure."""
    contenders: dict = {}
    cpu: dict[str, list[float]] = {}  # ids per CPU second of this process, beside each
    for kind in KINDS:
        layer, batches = held_table(kind, sizes.lookup_ids, sizes.lookup_batch)
        serve = exported(layer, kind, os.path.join(workdir, f"lookups-{kind}"))
        for name, call in ((f"eval_{kind}", _eval_fn(layer)), (f"export_{kind}", serve)):
            per_cpu_s = cpu.setdefault(f"{name}_ids_per_cpu_s", [])
            contenders[f"{name}_ids_s"] = _timed(call, batches, per_cpu_s)
        if kind == "int64":
            step = train_step(layer)
            contenders["train_step_ms"] = _step_ms(
                step, batches, cpu.setdefault("train_step_cpu_ms", [])
            )
        note(f"  {kind}: table of {int(layer.table.size())} ids, {len(batches)} batches")
    samples = alternate(contenders, reps)
    samples.update({name: values[-reps:] for name, values in cpu.items()})  # not the warm-ups
    figures = medians(samples)
    figures["tfra_0.8.1_recorded_ids_s_low"], figures["tfra_0.8.1_recorded_ids_s_high"] = TFRA_IDS_S
    ratios = {
        _ratio_name(name): figures[name] / TFRA_IDS_S[0]
        for name in figures
        if name.endswith(("_ids_s", "_ids_per_cpu_s")) and not name.startswith("tfra")
    }
    for name, values in samples.items():
        if name.endswith(("_ids_s", "_ids_per_cpu_s")):
            note(f"  {name}: " + ", ".join(f"{v / 1e6:.2f}M" for v in values))
        elif name.endswith("_ms"):
            note(f"  {name}: " + ", ".join(f"{v:.2f}" for v in values))
    return result(
        "ids/s, ms",
        figures,
        ratios,
        samples,
        targets={_ratio_name(f"{k}_int64_ids_s"): ">= 1" for k in ("eval", "export")},
        notes=[
            f"a table of {sizes.lookup_ids} ids, width {WIDTH}, batches of "
            f"{sizes.lookup_batch} ids drawn uniformly from those held; TFRA 0.8.1: "
            f"{TFRA_IDS_S[0] / 1e6:.2f}-{TFRA_IDS_S[1] / 1e6:.2f}M ids/s recorded, not run"
        ],
    )


def _ratio_name(figure: str) -> str:
    """The name of `figure`'s ratio to TFRA's: `eval_int64 / ...`, `eval_int64 per CPU s / ...`."""
    what = figure.removesuffix("_ids_s").replace("_ids_per_cpu_s", " per CPU s")
    return f"{what} / TFRA recorded (low end)"


def held_table(kind: str, ids: int, batch: int):
    """A `DynamicEmbedding` of `kind` ids holding `ids` ids with written rows; lookup batches."""
    import tensorflow as tf

    from trainer.layers import DynamicEmbedding, tables

    layer = DynamicEmbedding(WIDTH, key_dtype=kind, capacity=ids)
    layer.build()
    # Distinct 64-bit ids: i -> i x an odd constant is a bijection mod 2**64.
    numbers = (np.arange(1, ids + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(
        np.int64
    )
    keys = numbers if kind == "int64" else np.char.mod("id%d", numbers).astype(object)
    key64 = tables.key64(tf.constant(keys)).numpy()
    for start in range(0, ids, 1 << 17):
        layer.table.admit(tf.constant(key64[start : start + (1 << 17)]))
    slots, stamps = (t.numpy() for t in layer.table.find(tf.constant(key64)))
    row_stamps = layer.row_stamps.numpy()
    row_stamps[slots] = stamps  # every row written, as the optimizer leaves them: marked too
    layer.row_stamps.assign(row_stamps)
    layer.table.mark_written(tf.constant(slots), lambda at: tf.gather(layer.row_stamps, at))
    rng = np.random.default_rng(0)
    layer.rows.assign(rng.uniform(-0.05, 0.05, layer.rows.shape).astype(np.float32))
    batches = [tf.constant(keys[rng.integers(0, ids, batch)]) for _ in range(PASSES)]
    return layer, batches


def _eval_fn(layer):
    import tensorflow as tf

    spec = tf.TensorSpec([None], tf.string if layer.key_dtype == "string" else tf.int64)
    return tf.function(lambda ids: layer(ids, training=False), input_signature=[spec])


def exported(layer, kind: str, path: str):
    """The `serving_default` of the export of a model of `layer` alone, loaded."""
    import keras
    import tensorflow as tf

    from trainer.loop import export

    inputs = keras.Input(shape=(), dtype=kind, name="ids")
    tic = time.perf_counter()
    export.export(keras.Model(inputs, layer(inputs)), path, None, 0, raw_outputs=True)
    note(f"  export of the {kind} table: {time.perf_counter() - tic:.2f} s")
    signature = tf.saved_model.load(path).signatures["serving_default"]
    return lambda ids: signature(inputs=ids)


def train_step(layer):
    """One training step of `layer` alone: lookup, gradient, Adam's sparse update (traced)."""
    import tensorflow as tf

    import configs.default
    from trainer.loop import optim

    optimizer = optim.build(configs.default.get_config().optimizer, 1)  # Adam
    optimizer.build(layer.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    return step


def _timed(call, batches: list, per_cpu_s: list[float]) -> callable:
    """A contender of `alternate`: ids/s of `call` over every batch once (after one untimed).

    Also appends the ids per CPU second this process spent to `per_cpu_s`: on
    a shared machine, less moved by the other processes than the wall clock.
    """
    call(batches[0])
    ids = sum(int(b.shape[0]) for b in batches)

    def once() -> float:
        tic, cpu_tic = time.perf_counter(), time.process_time()
        for ids_batch in batches:
            call(ids_batch)
        per_cpu_s.append(ids / (time.process_time() - cpu_tic))
        return ids / (time.perf_counter() - tic)

    return once


def _step_ms(step, batches: list, cpu_ms: list[float]) -> callable:
    """A contender of `alternate`: the median ms of `step` over the batches.

    Also appends the mean CPU ms a step of this process to `cpu_ms`.
    """
    step(batches[0])

    def once() -> float:
        times, cpu_tic = [], time.process_time()
        for ids_batch in batches:
            tic = time.perf_counter()
            step(ids_batch).numpy()
            times.append(time.perf_counter() - tic)
        cpu_ms.append((time.process_time() - cpu_tic) / len(batches) * 1e3)
        return float(np.median(times)) * 1e3

    return once


if __name__ == "__main__":  # one quick pass here: python -m trainer.bench.table_lookups
    from trainer.bench.sizes import QUICK

    with tempfile.TemporaryDirectory() as scratch:
        print(run(QUICK, 1, scratch)["figures"])
