"""The contenders that train: towerflow, Keras `fit` and the bare loop (the floor).

Each returns a `TimedRun`: one timed repetition, returning examples/s.
"""

from __future__ import annotations

import contextlib
import os
import time

import ml_collections

from trainer.bench import clock
from trainer.bench.harness import TimedRun, paired, timed


def towerflow(
    config: ml_collections.ConfigDict, strategy, model_dir: str, steps: int, service=None
) -> TimedRun:
    """`train.run` for `steps` more steps; examples/s over whole loops after the first.

    The first loop (untimed) is `train.steps_per_loop` steps, or one under
    auto, as the bare loop's. A `Clock` action notes when each block is done.
    One more step runs after the timed ones, untimed: the end-of-run
    checkpoint comes after it. The trainer's printed lines go nowhere (stdout
    holds the benchmark's table).
    With a `service` (`trainer.data.service_client.Service`) the input runs on it.
    `run.input_wait_ms` gets, for each repetition, the milliseconds a timed
    step waited for its input (the trainer's `input_wait_ms`), where the
    trainer measures it.
    """
    from trainer.loop import actions, train

    job = train.build(config, model_dir, strategy, service)
    batch = config.train.global_batch_size

    first = config.train.steps_per_loop or 1  # the untimed loop, as the bare loop's

    def run() -> float:
        start = int(job.optimizer.iterations.numpy())
        end = start + steps
        job.total_steps = end + 1
        blocks = clock.Clock()
        waits: list[tuple[int, float]] = []  # (steps, ms per step) of each block
        # Blocks end after the untimed first loop and at `end`, whatever the loop length
        # (blocks end where an action is due; auto's length is the job's, kept across runs).
        timed_end = actions.Action(
            lambda output: None, every=end, at_steps=(start + first,), name="end of timing"
        )
        waited = actions.Action(
            lambda output: waits.append((output.steps, output.metrics.get("input_wait_ms", 0.0))),
            name="input wait",
        )
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            train.run(job, "train", extra_actions=[blocks.action(), waited, timed_end])
        if job.feature("input_wait") is not None:
            # The blocks `rate` times: after the first, up to `end`.
            timed = waits[1 : len([m for m in blocks.marks if m[0] <= end])]
            run.input_wait_ms.append(
                sum(n * ms for n, ms in timed) / max(1, sum(n for n, _ in timed))
            )
        return clock.rate(blocks.marks, batch, until=end)

    run.self_warming = True
    run.input_wait_ms = []
    return run


def model_and_optimizer(config: ml_collections.ConfigDict, spec, strategy, fused: bool = True):
    """The model and optimizer towerflow builds; `fused=False` gives Keras's own optimizer."""
    from trainer.loop import models, optim, precision

    with strategy.scope(), precision.policy(config.train.precision):
        model = models.build(config.model, spec)
        optimizer = optim.build(config.optimizer, config.train.steps, fused)
    return model, optimizer


def bare_loop(config: ml_collections.ConfigDict, strategy, dataset, steps: int) -> TimedRun:
    """The floor: `strategy.run` of a minimal step, `steps` times in one `tf.function`.

    Each repetition starts a new input pipeline and leaves its first loop out
    of the timing, as `towerflow` (each `train.run` starts one) and Keras `fit`
    do: a pipeline that has run for a while steps faster than a new one (2-4%
    on `small_mlp` after one loop of 100 steps, none after four), so a pipeline kept
    across repetitions would time only the floor at its best.
    """
    import tensorflow as tf

    model, optimizer = model_and_optimizer(config, dataset.spec, strategy)
    batch = config.train.global_batch_size
    with strategy.scope():
        optimizer.build(model.trainable_variables)

    def step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            logits = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)) / batch
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def loop(iterator, n):
        for _ in tf.range(n):
            strategy.tf_strategy.run(step, args=(next(iterator),))
        return tf.convert_to_tensor(optimizer.iterations)

    first = tf.constant(config.train.steps_per_loop or 1, tf.int64)  # towerflow's untimed loop
    n = tf.constant(steps, tf.int64)

    def run() -> float:
        iterator = iter(strategy.distribute_dataset(dataset.train_fn(batch, config.seed)))
        loop(iterator, first).numpy()
        return steps * batch / timed(lambda: loop(iterator, n).numpy())

    run.self_warming = True
    return run


def keras_fit(
    config: ml_collections.ConfigDict, strategy, dataset, steps: int, steps_per_execution: int
) -> TimedRun:
    """Keras `model.fit` under the same strategy; examples/s between executions after the first.

    With Keras's own optimizer class (same kind, schedule and results), as a
    `fit` user has it.
    """
    import keras
    import tensorflow as tf

    model, optimizer = model_and_optimizer(config, dataset.spec, strategy, fused=False)
    with strategy.scope():
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    batch = config.train.global_batch_size
    data = dataset.train_fn(batch, config.seed)(tf.distribute.InputContext())
    steps += steps_per_execution  # the first execution is not timed

    class Executions(keras.callbacks.Callback):
        """Notes when each execution of `fit` ends: `(batch index, time)` marks, as `Clock`'s."""

        def __init__(self):
            super().__init__()
            self.marks: list[clock.Mark] = []

        def on_train_batch_end(self, batch, logs=None):
            self.marks.append((batch, time.perf_counter()))

    def run() -> float:
        executions = Executions()
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[executions])
        return clock.rate(executions.marks, batch)

    run.self_warming = True
    return run


def training(
    config: ml_collections.ConfigDict, strategy, workdir: str, loops: int, prefix: str = ""
) -> dict[str, TimedRun]:
    """towerflow, keras_fit at 1 and at towerflow's loop length, and bare_loop."""
    from trainer import data

    dataset = data.get(config.data)
    per_loop = config.train.steps_per_loop or 1
    steps = per_loop * loops
    model_dir = os.path.join(workdir, f"{prefix}{strategy.name}-{config.train.precision}")
    return {
        f"{prefix}towerflow": towerflow(config, strategy, model_dir, steps + per_loop),
        f"{prefix}keras_fit_spe1": keras_fit(config, strategy, dataset, steps, 1),
        f"{prefix}keras_fit_spe{per_loop}": keras_fit(config, strategy, dataset, steps, per_loop),
        f"{prefix}bare_loop": bare_loop(config, strategy, dataset, steps),
    }


def training_ratios(samples: dict[str, list[float]], prefix: str = "") -> dict[str, float]:
    """towerflow over the bare loop and over each Keras `fit` (and the best of them), paired."""
    ours = f"{prefix}towerflow"
    keras = [k for k in samples if k.startswith(f"{prefix}keras_fit_spe")]
    ratios = {f"{ours}/bare_loop": paired(samples, lambda r: r[ours] / r[f"{prefix}bare_loop"])}
    if keras:  # Keras may have failed to run at all (see `failed`)
        best = paired(samples, lambda r: r[ours] / max(r[k] for k in keras))
        ratios[f"{ours}/keras_fit_best"] = best
    for k in keras:
        ratios[f"{ours}/{k.removeprefix(prefix)}"] = paired(samples, lambda r, k=k: r[ours] / r[k])
    return ratios


def plugin(name: str):
    """The strategy plugin `name`, built with its default options."""
    import strategies

    return strategies.get(name)
