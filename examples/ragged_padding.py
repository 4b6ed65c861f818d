"""What padding ragged ids costs: CPU time per step, ragged against padded, by strategy.

    python -m examples.ragged_padding --rounds=3 --steps=200

Tag lists of 1 to `WIDTH` ids an example (Zipf over 10,000 ids) go into a
`DynamicEmbedding(16, combiner="mean", mask_id=0)` under two dense layers
(Adam, batch 256), either ragged or padded to `WIDTH` with the mask id.
Each case (`one_device`, `mirrored` over 4 logical CPUs; ragged, padded) runs
in its own process, cases in turn for `--rounds` rounds; it prints each
case's median CPU and wall milliseconds per step (after 20 untimed steps).
`docs/tables-keras.md` holds the figures and why `multi_worker` needs padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

WIDTH = 8  # the longest list, and the padded width
BATCH = 256
CASES = [(s, p) for s in ("one_device", "mirrored") for p in (False, True)]


def _examples(n: int, seed: int):
    """`n` tag lists (a `tf.RaggedTensor`) and whether each example was clicked."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, WIDTH + 1, n)
    ids = (rng.zipf(1.2, lengths.sum()) % 10_000 + 1).astype(np.int64)
    score = np.random.default_rng(99).normal(size=10_001)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    clicks = (np.add.reduceat(score[ids], starts) / lengths > 0).astype(np.int64)
    return tf.RaggedTensor.from_row_lengths(ids, lengths), clicks


def _dataset(padded: bool):
    """`dataset_fn(input_context)` of the tag lists, batched per replica, padded or not."""
    import tensorflow as tf

    def dataset_fn(input_context):
        tags, clicks = _examples(20_000, seed=0)
        data = tf.data.Dataset.from_tensor_slices((tags, clicks))
        data = data.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        data = data.repeat().shuffle(4096, seed=1)
        data = data.batch(input_context.get_per_replica_batch_size(BATCH), drop_remainder=True)
        if padded:
            data = data.map(lambda t, y: (t.to_tensor(0, shape=[None, WIDTH]), y))
        return data.prefetch(2)

    return dataset_fn


def _model(padded: bool):
    import keras

    from trainer.layers import DynamicEmbedding

    tags = keras.Input((WIDTH,) if padded else (None,), dtype="int64", ragged=not padded)
    vectors = DynamicEmbedding(16, combiner="mean", mask_id=0, capacity=20_000)(tags)
    hidden = keras.layers.Dense(16, activation="relu")(vectors)
    return keras.Model(tags, keras.layers.Dense(2)(hidden))


def time_case(strategy_name: str, padded: bool, steps: int) -> dict[str, float]:
    """CPU and wall milliseconds per step of one case, in this process."""
    from strategies import devices

    devices.configure(logical_cpus=4)
    import tensorflow as tf

    from trainer.loop import optim

    if strategy_name == "one_device":
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    else:  # as towerflow's `mirrored` on CPUs: reduced on one device, not by collectives
        cpus = [f"/cpu:{i}" for i in range(4)]
        strategy = tf.distribute.MirroredStrategy(cpus, tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model, optimizer = _model(padded), optim.Adam(1e-3)
        optimizer.build(model.trainable_variables)

    def step(tags, clicks):
        with tf.GradientTape() as tape:
            logits = model(tags, training=True)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(clicks, logits)
            loss = tf.reduce_sum(losses) / BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def run(iterator, n):
        for _ in tf.range(n):
            strategy.run(step, args=next(iterator))

    iterator = iter(strategy.distribute_datasets_from_function(_dataset(padded)))
    run(iterator, tf.constant(20))  # traces, and fills the table
    cpu, wall = time.process_time(), time.perf_counter()
    run(iterator, tf.constant(steps))
    return {
        "cpu_ms": 1000 * (time.process_time() - cpu) / steps,
        "wall_ms": 1000 * (time.perf_counter() - wall) / steps,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Runs every case `--rounds` times, each in a process; prints and returns the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a process of its own
    args = parser.parse_args(argv)
    if args.case:
        strategy, padded = args.case.split(":")
        print(json.dumps(time_case(strategy, padded == "padded", args.steps)))
        return {}
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for strategy, padded in CASES:
            case = f"{strategy}:{'padded' if padded else 'ragged'}"
            command = [sys.executable, "-m", "examples.ragged_padding", f"--steps={args.steps}"]
            done = subprocess.run([*command, f"--case={case}"], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            runs.setdefault(case, []).append(json.loads(done.stdout.splitlines()[-1]))
    medians = {}
    for case, timed in runs.items():
        medians[case] = {k: statistics.median(r[k] for r in timed) for k in ("cpu_ms", "wall_ms")}
        figures = medians[case]
        print(
            f"{case}: CPU {figures['cpu_ms']:.2f} ms/step, wall {figures['wall_ms']:.2f} ms/step "
            f"(medians of {len(timed)})"
        )
    return medians


if __name__ == "__main__":
    main()
