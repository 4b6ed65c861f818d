"""The `dense_large` case: a compute-bound MLP under one_device, as utilisation of the matmul peak.

Model FLOP/s (6 x parameters x examples/s) over the float32 matmul peak
measured alongside; also under `mixed_bfloat16`, and for the matmuls of a
step alone at the model's shapes (the most any loop could reach).
"""

from __future__ import annotations

import math
import os

from trainer.bench import contenders
from trainer.bench.harness import TimedRun, alternate, medians, paired, result, timed
from trainer.bench.sizes import Sizes, make_config, parameters


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Utilisation of the float32 matmul peak by towerflow, Keras `fit` and the bare loop."""
    fields = {"train.steps_per_loop": 0}  # auto: about a second, 5 steps (float32) or 10 here
    large = (sizes.large_hidden, sizes.large_input, sizes.large_batch)
    config = make_config(sizes, "one_device", *large, **fields)
    bf16 = make_config(
        sizes, "one_device", *large, **fields, **{"train.precision": "mixed_bfloat16"}
    )
    from trainer import data

    strategy = contenders.plugin("one_device")
    dataset = data.get(config.data)
    steps = sizes.large_steps
    model_dir = os.path.join(workdir, "dense_large")
    classes = config.data.synthetic.num_classes
    widths = [sizes.large_input, *sizes.large_hidden, classes]
    flops_per_example = 6 * parameters(config)
    runs = {
        "towerflow": contenders.towerflow(config, strategy, model_dir, steps + 1),
        "keras_fit_spe1": contenders.keras_fit(config, strategy, dataset, steps, 1),
        f"keras_fit_spe{steps}": contenders.keras_fit(config, strategy, dataset, steps, steps),
        "bare_loop": contenders.bare_loop(config, strategy, dataset, steps),
        "towerflow_mixed_bfloat16": contenders.towerflow(
            bf16, strategy, model_dir + "-bf16", steps + 1
        ),
        "bare_loop_mixed_bfloat16": contenders.bare_loop(bf16, strategy, dataset, steps),
        "matmul_peak": matmul_peak(sizes.peak_n, max(2, int(2e10 / (2 * sizes.peak_n**3)))),
        "model_matmuls": model_matmuls(widths, sizes.large_batch, steps),
    }
    failed: dict[str, str] = {}
    samples = alternate(runs, reps, failed)
    # The matmuls of a step alone, at the model's shapes: the most any loop could reach.
    samples["model_matmuls_only"] = samples.pop("model_matmuls")
    rates = medians(samples)
    peak = rates.pop("matmul_peak")
    figures = {
        name: paired(samples, lambda r, name=name: r[name] * flops_per_example / r["matmul_peak"])
        for name in rates
    }
    ratios = contenders.training_ratios(samples)
    ratios["towerflow_mixed_bfloat16/bare_loop_mixed_bfloat16"] = paired(
        samples, lambda r: r["towerflow_mixed_bfloat16"] / r["bare_loop_mixed_bfloat16"]
    )
    return result(
        "utilisation of the float32 matmul peak",
        figures,
        ratios,
        samples,
        failed=failed,
        examples_per_sec=rates,
        matmul_peak_gflops=peak / 1e9,
        parameters=parameters(config),
        strategy="one_device",
        steps_per_loop="auto",
    )


def matmul_peak(n: int, matmuls: int) -> TimedRun:
    """float32 FLOP/s of chained `n` x `n` matmuls in a `tf.function` loop."""
    import tensorflow as tf

    a = tf.random.normal([n, n])
    b = tf.random.normal([n, n]) / math.sqrt(n)  # keeps the chained products bounded

    @tf.function
    def loop(a, k):
        for _ in tf.range(k):
            a = tf.matmul(a, b)
        return a[0, 0]

    k = tf.constant(matmuls)
    return lambda: 2 * n**3 * matmuls / timed(lambda: loop(a, k).numpy())


def model_matmuls(widths: list[int], batch: int, steps: int) -> TimedRun:
    """Examples/s of just the matmuls of an MLP's training steps, at its shapes.

    Per layer of `widths[i] -> widths[i + 1]`: the forward product, and the two
    of the backward pass (into the inputs and into the kernel): the 6 x batch x
    in x out FLOPs the model FLOP count assumes. No training loop can beat it.
    """
    import tensorflow as tf

    pairs = list(zip(widths[:-1], widths[1:]))
    kernels = [tf.random.normal([i, o]) / math.sqrt(i) for i, o in pairs]
    inputs = [tf.random.normal([batch, i]) for i, _ in pairs]
    grads = [tf.random.normal([batch, o]) for _, o in pairs]

    @tf.function
    def loop(k):
        total = tf.constant(0.0)
        for _ in tf.range(k):
            for x, w, dy in zip(inputs, kernels, grads):
                y = tf.matmul(x + total, w)
                dx = tf.matmul(dy, w, transpose_b=True)
                dw = tf.matmul(x, dy, transpose_a=True)
                total += (y[0, 0] + dx[0, 0] + dw[0, 0]) * 1e-30
        return total

    k = tf.constant(steps)
    return lambda: batch * steps / timed(lambda: loop(k).numpy())
