"""The `tables_quality` case: dynamic tables against hashing at equal bytes, on a drifting tail.

The stream (`STREAM`, `configs/ctr.py` on raw int64 ids): 2 fields and a list
of up to 3 ids of a third, each field's values drawn Zipf(1.1) over
`Sizes.quality_ids_per_field` ranks whose popular items drift (a new item
enters at rank 0 every 300 examples), 8-wide embeddings, Adam, batches of
256, `Sizes.quality_steps` steps on `one_device`, eval AUC on the examples
that follow the training ones (the future of the stream). One table holds
the ids of every field (the ctr model's).

For each share of the distinct ids the training split holds (counted first,
`distinct_ids`): a hashed table (`keras.layers.Hashing` + an embedding) of
that many rows, and a `DynamicEmbedding` (`lfu` eviction, `min_count` 1,
2 fallback rows read per id and a seen-filter of 2**18 bits a generation,
the defaults; `FALLBACK_SHARE` of its bytes past the fixed ones in fallback rows) fitted into
the same bytes (`fit`): rows, Adam's two slots, the row stamps, the index
(`trainer.layers.tables.ENTRY_BYTES` and `INFO_ENTRY_BYTES` per id held),
the seen-filter, the sketch (`min_count` > 1) and the fallback rows. At the
15% share, beside them, the policy one change at a time (`VARIANTS`): LRU,
`min_count` 2, no fallback rows, one or three fallback rows per id, no
seen-filter, one of 2**16 bits; and the same rows as the hashed table with own rows at a hashed
row's bytes (`free_index`: what own rows are worth if the index cost
nothing; not equal bytes). Every table runs `Sizes.quality_seeds` times
(seeds 0, 1, ...: the model's initial values, the data's order, the table's
initial rows, and which ids share a row: `model.table_seed` salts the hashed
table's `Hashing` and the fallback rows' hashes, 0 unsalted): a single run's
AUC moves by up to 0.01 with the seed, as much with which ids collide as with
the rest (the same table one row larger or smaller may gain or lose 0.01 by
collisions alone), so the figures are the runs' means and the gains the
means of paired differences.

Beside the AUC, what explains it (`reasons`), from the same run: the share
of eval lookups of ids the training split never holds (`distinct_ids`), and
the AUC without the seen-filter that gives them zeros; the AUC
with an index that cost nothing; the bytes of an own row against a hashed
row's, so how many own rows fit in the hashed table's bytes; how much hashed
AUC rises from the target share to every id holding a row (the most that
collisions cost there); and the AUC of the stream's hidden click model on
the eval examples (`oracle_auc`: the ceiling no table reaches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics

from trainer.bench.harness import note, result
from trainer.bench.sizes import Sizes, timing_only

SHARES = (0.05, 0.15, 0.5, 1.0)  # rows over distinct ids
TARGET_SHARE = 0.15  # where dynamic must win by `TARGET_GAIN`
TARGET_GAIN = 0.01
WIDTH = 8
FALLBACK_SHARE = 0.9  # of a dynamic table's bytes past its fixed ones, its fallback rows
MIN_COUNT = 1  # the default: LFU's admission keeps one-off ids in the fallback rows
SEEN_BITS = 2**18  # the layer's default (`tables.SEEN_BITS`): its seen-filter's generations
STREAM = {
    "data.ctr.id_space": "raw",
    "data.ctr.zipf_a": 1.1,
    "data.ctr.num_fields": 2,
    "data.ctr.multi_valued": 3,
    "data.ctr.drift_every": 300,
    "model.embedding_dim": WIDTH,
    "strategy.name": "one_device",
}


@dataclasses.dataclass(frozen=True)
class Table:
    """The table of one run: hashed of `rows` rows, or dynamic of capacity `rows` (`eviction`)."""

    rows: int
    eviction: str | None = None
    fallback: int = 0
    min_count: int = MIN_COUNT
    hashes: int = 2  # fallback rows an id reads (the layer's default, `tables.FALLBACK_HASHES`)
    seen_bits: int = SEEN_BITS  # bits per generation of its seen-filter


# (name, eviction, min_count, fallback share, fallback hashes, seen bits): the policies
# compared at `TARGET_SHARE`, one change at a time from the default.
VARIANTS = (
    ("lru", "lru", MIN_COUNT, FALLBACK_SHARE, 2, SEEN_BITS),
    ("lfu_min_count2", "lfu", 2, FALLBACK_SHARE, 2, SEEN_BITS),
    ("lfu_no_fallback", "lfu", MIN_COUNT, 0.0, 2, SEEN_BITS),
    ("lfu_one_hash", "lfu", MIN_COUNT, FALLBACK_SHARE, 1, SEEN_BITS),
    ("lfu_three_hashes", "lfu", MIN_COUNT, FALLBACK_SHARE, 3, SEEN_BITS),
    ("lfu_no_seen_filter", "lfu", MIN_COUNT, FALLBACK_SHARE, 2, 0),
    ("lfu_seen_filter_2e16", "lfu", MIN_COUNT, FALLBACK_SHARE, 2, 2**16),
)


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """The AUC per share, hashed and dynamic at equal bytes; the policies at 15%."""
    del reps  # `sizes.quality_seeds` runs each: a quality figure, not a timing
    distinct, unseen = distinct_ids(sizes)
    note(f"  distinct ids in the training split: {distinct}")
    note(f"  eval lookups of ids the training split never holds: {unseen:.1%}")
    oracle = oracle_auc(sizes)
    note(f"  the hidden click model's own AUC on the eval examples: {oracle:.4f}")
    samples, rows, gains, free_index = {}, [], {}, {}
    for share in SHARES:
        label = f"{round(share * 100)}pct"
        row, free_index[label] = _share(sizes, workdir, share, round(share * distinct), samples)
        rows.append(row)
        hashed, dynamic = samples[f"auc_hashed_{label}"], samples[f"auc_dynamic_{label}"]
        gains[label] = statistics.fmean(dynamic) - statistics.fmean(hashed)
    figures = {name: statistics.fmean(aucs) for name, aucs in samples.items()}
    table = [
        "| rows / distinct ids | hashed rows | hashed bytes | hashed AUC | dynamic rows + "
        "fallback | dynamic bytes | dynamic AUC | dynamic - hashed | per seed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    for line in table:
        note(line)
    target = f"{round(TARGET_SHARE * 100)}pct"
    reasons = explain(figures, target, oracle, free_index[target], unseen)
    for line in reasons:
        note(f"  {line}")
    ratios = {
        f"dynamic/hashed AUC at {label}": figures[f"auc_dynamic_{label}"]
        / figures[f"auc_hashed_{label}"]
        for label in gains
    }
    return result(
        "AUC",
        figures,
        ratios,
        samples,
        distinct_ids=distinct,
        unseen_eval_share=unseen,
        oracle_auc=oracle,
        auc_gain=gains,
        targets={
            "dynamic - hashed AUC at every share": ">= 0",
            f"dynamic - hashed AUC at {target}": f">= {TARGET_GAIN}",
        },
        met=min(gains.values()) >= 0 and gains[target] >= TARGET_GAIN,
        table=table,
        reasons=reasons,
        notes=[
            f"{sizes.quality_steps} steps of 256 on one_device; ids Zipf(1.1) over "
            f"{sizes.quality_ids_per_field} ranks a field, drifting every 300 examples",
            f"each AUC the mean of {sizes.quality_seeds} runs (seeds 0 .. "
            f"{sizes.quality_seeds - 1}: the model's initial values, the data's order, the "
            "table's initial rows, which ids share a row); per seed: the range of the paired "
            "differences",
            f"dynamic: eviction lfu, min_count {MIN_COUNT}, {FALLBACK_SHARE:.0%} of its bytes "
            f"in fallback rows read 2 at a time, a seen-filter of {SEEN_BITS} bits a generation; "
            "bytes as `describe()` counts them at the end (rows, Adam's slots, stamps, index)",
        ],
    )


def _share(
    sizes: Sizes, workdir: str, share: float, rows: int, samples: dict
) -> tuple[str, tuple[int, int]]:
    """Hashed of `rows` rows and dynamic at its bytes (each seed's AUC into `samples`).

    At the target share, also `_at_target`'s. Returns the row of the table and
    the (own rows, fallback rows) of the dynamic table with a free index.
    """
    label = f"{round(share * 100)}pct"
    rows = max(1, rows)
    hashed, hashed_bytes = measure(sizes, workdir, f"hashed_{label}", Table(rows))
    capacity, fallback = fit(hashed_bytes, FALLBACK_SHARE, MIN_COUNT)
    dynamic, dynamic_bytes = measure(
        sizes, workdir, f"dynamic_{label}", Table(capacity, "lfu", fallback)
    )
    samples.update({f"auc_hashed_{label}": hashed, f"auc_dynamic_{label}": dynamic})
    free_index = (rows - fallback, fallback)
    if share == TARGET_SHARE:
        samples.update(_at_target(sizes, workdir, label, free_index, hashed_bytes))
    paired = [d - h for d, h in zip(dynamic, hashed, strict=True)]
    row = (
        f"| {share:.0%} | {rows} | {hashed_bytes} | {statistics.fmean(hashed):.4f} | "
        f"{capacity} + {fallback} | {dynamic_bytes} | {statistics.fmean(dynamic):.4f} | "
        f"{statistics.fmean(paired):+.4f} | {min(paired):+.4f} .. {max(paired):+.4f} |"
    )
    return row, free_index


def _at_target(
    sizes: Sizes, workdir: str, label: str, free_index: tuple[int, int], hashed_bytes: int
) -> dict[str, list[float]]:
    """At the target share, each seed's AUC: own rows with a free index, and each policy.

    `free_index` is (own rows, fallback rows) making the hashed table's rows: own
    rows at a hashed row's bytes, what they are worth without the index (not equal
    bytes). The policies (`VARIANTS`) run at equal bytes.
    """
    own, fallback = free_index
    free, _ = measure(sizes, workdir, f"free_index_{label}", Table(own, "lfu", fallback))
    samples = {f"auc_free_index_{label}": free}
    for name, eviction, min_count, fallback_share, hashes, seen_bits in VARIANTS:
        capacity, fallback = fit(hashed_bytes, fallback_share, min_count, seen_bits)
        table = Table(capacity, eviction, fallback, min_count, hashes, seen_bits)
        samples[f"auc_{name}_{label}"], _ = measure(sizes, workdir, f"{name}_{label}", table)
    return samples


def config(sizes: Sizes, **fields):
    """`configs/ctr.py` on the drifting stream at this size, evaluated once at the end."""
    import configs.ctr

    config = configs.ctr.get_config()
    steps, batch = sizes.quality_steps, 256
    eval_examples = max(2000, steps * batch // 30)
    stream = {
        **STREAM,
        "data.ctr.ids_per_field": sizes.quality_ids_per_field,
        "data.ctr.num_examples": steps * batch + eval_examples,
        "data.eval_fraction": eval_examples / (steps * batch + eval_examples),
        "train.steps": steps,
        "train.global_batch_size": batch,
        "devices.logical_cpus": 1,
    }
    return timing_only(config, sizes, {**stream, **fields})


def distinct_ids(sizes: Sizes) -> tuple[int, float]:
    """The distinct ids of the training split, and the share of eval lookups of others.

    Padding left out: the eval examples' ids that no training example holds
    (new items, and tail ids), as a share of the eval examples' ids.
    """
    import numpy as np
    import tensorflow as tf

    from trainer import data

    batch = 4096  # the steps' examples, read in larger batches
    batches = -(-sizes.quality_steps * 256 // batch)
    source, context = data.get(config(sizes).data), tf.distribute.InputContext(1, 0, 1)
    stream = source.train_fn(batch, seed=0)(context).take(batches)
    ids = np.unique(np.concatenate([np.unique(x.numpy()) for x, *_ in stream]))
    evaluated = np.concatenate([x.numpy().ravel() for x, *_ in source.eval_fn(batch)(context)])
    evaluated = evaluated[evaluated != 0]  # 0: the list's padding
    unseen = float(np.mean(~np.isin(evaluated, ids)))
    return int(np.count_nonzero(ids)), unseen


def oracle_auc(sizes: Sizes) -> float:
    """The AUC of the hidden click model's own probabilities on the eval examples."""
    import keras
    import tensorflow as tf

    from trainer.data import ctr

    data = config(sizes).data
    examples = data.ctr.num_examples
    evaluated = round(data.eval_fraction * examples)
    indices = tf.range(examples - evaluated, examples, dtype=tf.int64)
    probabilities, labels = ctr.hidden_clicks(data.ctr, indices)
    auc = keras.metrics.AUC()
    auc.update_state(labels, probabilities)
    return float(auc.result())


def row_bytes() -> tuple[int, int]:
    """The bytes of a hashed row and of an own row of a dynamic table (`fit`'s accounting)."""
    from trainer.layers import tables

    hashed = WIDTH * 4 * 3  # the row and Adam's two slots
    return hashed, hashed + 8 + tables.ENTRY_BYTES + tables.INFO_ENTRY_BYTES


def explain(
    figures: dict, target: str, oracle: float, free_index: tuple[int, int], unseen: float
) -> list[str]:
    """What the run's own figures say about dynamic against hashed (`reasons`)."""
    hashed_row, own_row = row_bytes()
    collisions = figures["auc_hashed_100pct"] - figures[f"auc_hashed_{target}"]
    own, fallback = free_index
    return [
        f"{unseen:.1%} of the eval lookups are of ids the training split never holds: a "
        "hashed table gives them rows other ids trained; the dynamic table's seen-filter "
        f"gives them zeros (without it, {figures[f'auc_lfu_no_seen_filter_{target}']:.4f} "
        f"at {target})",
        f"with an index that cost nothing ({own} own rows + {fallback} fallback rows, the "
        f"hashed table's {own + fallback} rows): AUC {figures[f'auc_free_index_{target}']:.4f} "
        f"against hashed {figures[f'auc_hashed_{target}']:.4f} at {target}",
        f"an own row costs {own_row} bytes (row, Adam's slots, stamp, index) against a hashed "
        f"row's {hashed_row}: in the same bytes, {hashed_row / own_row:.2f} own rows per "
        "hashed row",
        f"hashed AUC with a row per id minus at {target}: {collisions:+.4f}, the most that "
        f"collisions cost at {target} on this stream",
        f"the hidden click model's own AUC on the eval examples: {oracle:.4f} (the ceiling)",
    ]


def fit(
    budget: int, fallback_share: float, min_count: int = 1, seen_bits: int = SEEN_BITS
) -> tuple[int, int]:
    """(capacity, fallback rows) of a dynamic table of `budget` bytes at its fullest.

    Its fixed bytes first: the spare row, the seen-filter (two generations of
    `seen_bits` bits) and, with `min_count` > 1, the count-min sketch. Of the
    rest, `fallback_share` in fallback rows (a row and Adam's two slots), and
    the remainder in rows of its own: a row, Adam's slots, a stamp, and the
    index's two entries per id held.
    """
    from trainer.layers import tables

    hashed_row, own_row = row_bytes()
    sketch = tables.SKETCH_DEPTH * tables.SKETCH_WIDTH * 4 if min_count > 1 else 0
    seen = 2 * -(-seen_bits // 64) * 8
    rest = budget - (hashed_row + 8) - sketch - seen
    fallback = max(0, int(fallback_share * rest) // hashed_row)
    capacity = max(1, (rest - fallback * hashed_row) // own_row)
    return capacity, fallback


def measure(sizes: Sizes, workdir: str, name: str, table: Table) -> tuple[list[float], int]:
    """The eval AUC of each seed's run of the ctr job with `table`, and its bytes (the most)."""
    runs = [
        train_auc(sizes, workdir, f"{name}_seed{seed}", table, seed)
        for seed in range(sizes.quality_seeds)
    ]
    return [auc for auc, _ in runs], max(size for _, size in runs)


def train_auc(sizes: Sizes, workdir: str, name: str, table: Table, seed: int) -> tuple[float, int]:
    """Eval AUC and bytes of the ctr job with `table`, seeded by `seed`.

    Bytes: the rows and Adam's slots of a hashed table; `describe()`'s
    `bytes_held` of a dynamic one (its index as it ends).
    """
    from trainer import layers
    from trainer.loop import train

    fields = {"seed": seed, "model.table_seed": seed}
    if table.eviction is None:
        fields.update({"model.embedding": "hashed", "model.vocab_size": table.rows})
    else:
        fields.update({"model.embedding": "dynamic", "model.capacity": table.rows})
        fields.update({"model.eviction": table.eviction, "model.fallback_rows": table.fallback})
        fields.update({"model.min_count": table.min_count, "model.fallback_hashes": table.hashes})
        fields["model.seen_bits"] = table.seen_bits
    job = train.build(config(sizes, **fields), os.path.join(workdir, f"quality-{name}"))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        results = train.run(job, "train_and_eval")
    auc = float(results["eval"]["auc"])
    if table.eviction is None:
        size = table.rows * row_bytes()[0]
    else:
        size = sum(part["bytes_held"] for part in layers.table_figures(job.model)["embedding"])
    what = f"hashed, {table.rows} rows" if table.eviction is None else str(table)
    note(f"  {name}: {what}, bytes {size}: AUC {auc:.4f}")
    return auc, size
