"""One worker of an all-reduce timing: `python -m trainer.bench.allreduce OUT SHAPES REPS`.

Run on every member of a `multi_worker` `TF_CONFIG` cluster (the `gradients`
case starts them). Each times `REPS` cross-replica sums of tensors of
`SHAPES` (a JSON list of shapes: a model's gradients) through towerflow's
`multi_worker` plugin and `GradientTransfer.all_reduce`, as the train step
sums them, for every transfer of `TRANSFERS`; the chief writes the seconds
per all-reduce of each to the JSON file `OUT`.
"""

from __future__ import annotations

import json
import math
import sys
import time

TRANSFERS = {  # name: (gradient_dtype, bytes_per_pack)
    "float32": ("float32", 0),
    "float32_packs": ("float32", "auto"),
    "bfloat16": ("bfloat16", 0),
    "bfloat16_packs": ("bfloat16", "auto"),
}


def seconds_per_all_reduce(strategy, transfer, shapes: list[list[int]], reps: int) -> float:
    """Seconds one all-reduce of `shapes` takes with `transfer`; the median of 3 timings."""
    import tensorflow as tf

    gradients = [tf.random.normal(shape) / math.sqrt(max(shape)) for shape in shapes]

    def sums():
        total = tf.constant(0.0)
        for summed in transfer.all_reduce(gradients):
            total += tf.cast(tf.reshape(summed, [-1])[0], tf.float32)
        return total

    @tf.function
    def loop(n):
        total = tf.constant(0.0)
        for _ in tf.range(n):  # each sum waits for the one before (collectives are ordered)
            total += strategy.reduce("sum", strategy.call_for_each_replica(sums))
        return total

    loop(tf.constant(1)).numpy()  # traces, and starts the collective groups
    times = []
    for _ in range(3):
        start = time.perf_counter()
        loop(tf.constant(reps)).numpy()
        times.append((time.perf_counter() - start) / reps)
    return sorted(times)[1]


def main(out: str, shapes: str, reps: str) -> None:
    import ml_collections

    import strategies
    from strategies import transfer as transfer_lib

    strategy = strategies.get("multi_worker", ml_collections.ConfigDict())
    figures = {}
    for name, (dtype, pack) in TRANSFERS.items():
        options = ml_collections.ConfigDict({"gradient_dtype": dtype, "bytes_per_pack": pack})
        transfer = transfer_lib.from_options(options, "multi_worker")
        figures[name] = seconds_per_all_reduce(strategy, transfer, json.loads(shapes), int(reps))
    if strategy.membership.is_chief:
        with open(out, "w") as f:
            json.dump(figures, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
