"""`python -m trainer.bench`: how fast towerflow trains, next to Keras `fit` and a bare loop.

    python -m trainer.bench                        # every case at full size (~20-30 min, 2 cores)
    python -m trainer.bench --quick                # every case, tiny sizes: a smoke test
    python -m trainer.bench --cases=small_mlp,input --json=bench.json

Contenders train the same model on the same data, global batch and strategy:

- `towerflow`: `trainer.train.run` as a user runs it (default config values,
  including `train.steps_per_loop`), timed over whole loops: from one
  progress line to the next, so each loop's summaries, metrics and progress
  line count. Checkpoints and evals are off here (the `checkpoint` case
  measures saves).
- `keras_fit_spe<k>`: Keras `model.fit` under the same `tf.distribute` strategy,
  with `steps_per_execution` 1 and the `steps_per_loop` towerflow uses, and
  Keras's own optimizer class (same kind, schedule and results; towerflow's
  runs each variable's update as one fused kernel).
- `bare_loop`: the floor: `strategy.run` of a minimal step in a `tf.range`
  loop inside one `tf.function`, with towerflow's optimizer; nothing else.

Each case runs in its own process, set up as the trainer sets up the case's
strategy (threads per op: see `devices.intra_op_threads`); every contender
of the case runs with that setup.

Every contender warms up once (tracing, pipeline start; towerflow and Keras
instead leave their first loop out of every timing), then all run in turn
(A B C A B C ...) `--reps` times, so load from other processes hits them
alike. Figures are medians; ratios are medians of the ratios within each
round (paired), which load that comes and goes disturbs less. Cases:

1. `small_mlp`: an overhead-bound MLP (~300k parameters), examples/s.
2. `dense_large`: a compute-bound MLP (~15M parameters, batch 512) under
   `one_device`: model FLOP/s (6 x parameters x examples/s) over the float32
   matmul peak measured alongside (utilisation); also under `mixed_bfloat16`.
3. `input`: the synthetic and TFRecord pipelines alone (examples/s) against
   what training on them consumes, and the time a step waits for its batch.
4. `strategies`: `small_mlp` under one_device, mirrored and central_storage (2
   logical CPUs), and as local clusters (`trainer.launch`) under multi_worker
   and parameter_server, relative to one_device.
5. `startup`: seconds from process start to the first finished step of
   `python -m trainer`, next to `import tensorflow` alone and to the floor
   (import, build a model, compile and run one step).
6. `checkpoint`: how long a save of a ~100 MB checkpoint blocks training,
   synchronous against asynchronous, and how long a restore takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags  # noqa: E402

from trainer import cli  # noqa: E402

CASES = ("small_mlp", "dense_large", "input", "strategies", "startup", "checkpoint")
SINGLE_PROCESS = ("one_device", "mirrored", "central_storage")
LOGICAL_CPUS = 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_QUICK = flags.DEFINE_bool("quick", False, "Tiny sizes and one repetition: a smoke test.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
_CASES = flags.DEFINE_list("cases", list(CASES), f"Cases to run, of: {', '.join(CASES)}.")
_REPS = flags.DEFINE_integer("reps", None, "Timed repetitions per contender (default 5, quick 1).")
_IN_PROCESS = flags.DEFINE_bool(
    "in_process",
    False,
    "Run the cases in this process, not each in its own (set up for the first).",
)

Run = Callable[[], float]  # one timed repetition -> a rate (examples/s, or FLOP/s)


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
    large_steps: int = 4  # timed steps per repetition
    peak_n: int = 2048  # side of the square matmuls of the float32 peak
    examples: int = 100_000  # synthetic examples
    steps_per_loop: int = 0  # 0: the config's default
    ckpt_hidden: tuple[int, ...] = (2048, 2048, 2048)  # ~8.5M parameters: ~100 MB with Adam
    cluster_steps: int = 300  # steps of each local-cluster run
    loop1_steps: int = 41  # small_mlp with one step per loop: steps per repetition
    startup_reps: int = 3
    clusters: tuple[str, ...] = ("multi_worker", "parameter_server")  # local clusters timed


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
    # One cluster runs `_cluster_rate`'s path; a parameter-server cluster's three
    # processes would add ~10 s to start and stop (its trainer has tests of its own).
    clusters=("multi_worker",),
)


# --- timing ------------------------------------------------------------------------


def alternate(
    contenders: dict[str, Run], reps: int, failed: dict[str, str] | None = None
) -> dict[str, list[float]]:
    """Runs the contenders in turn `reps` times (A B C A B C ...); their rates.

    Each first warms up once, unless it is `self_warming` (it leaves its own
    first loop out of every timing). A contender that fails is left out, with
    the reason in `failed` (Keras `fit` cannot run some configurations at all).
    """
    contenders = dict(contenders)
    samples: dict[str, list[float]] = {name: [] for name in contenders}

    def attempt(name: str) -> float | None:
        try:
            return contenders[name]()
        except Exception as e:
            if failed is None:
                raise
            failed[name] = _first_line(e)
            _note(f"  {name} failed, left out: {failed[name]}")
            del contenders[name], samples[name]
            return None

    for name in list(contenders):
        if not getattr(contenders[name], "self_warming", False):
            _note(f"  warm-up {name}")
            attempt(name)
    for rep in range(reps):
        for name in list(contenders):
            rate = attempt(name)
            if rate is not None:
                samples[name].append(rate)
                _note(f"  rep {rep + 1}/{reps} {name}: {rate:.4g}")
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def paired(samples: dict[str, list[float]], fn: Callable[[dict[str, float]], float]) -> float:
    """The median over rounds of `fn(that round's figures)`.

    Contenders of one round ran back to back, so a ratio within a round is
    less disturbed by load that comes and goes than a ratio of medians.
    """
    rounds = max(len(v) for v in samples.values())  # some figures run fewer rounds (clusters)
    return statistics.median(
        fn({k: v[i] for k, v in samples.items() if i < len(v)}) for i in range(rounds)
    )


_PROGRESS = re.compile(r"(?:\[\S+\] )?train \| step: (\d+)")


class ProgressClock(io.TextIOBase):
    """A stdout that notes when each `train | step: N` progress line arrives."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []  # (perf_counter, step)

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.mark(line)
        return len(text)

    def mark(self, line: str) -> None:
        if match := _PROGRESS.match(line.strip()):
            self.marks.append((time.perf_counter(), int(match.group(1))))

    def rate(self, per_step: float) -> float:
        """`per_step` x steps per second, from the first progress line to the last."""
        if len(self.marks) < 2:
            raise RuntimeError(f"need two progress lines to time loops, got {len(self.marks)}")
        (t0, s0), (t1, s1) = self.marks[0], self.marks[-1]
        return (s1 - s0) * per_step / (t1 - t0)


def _timed(fn: Callable[[], object]) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


# --- contenders ---------------------------------------------------------------------


def _config(sizes: Sizes, strategy: str, hidden, input_size: int, batch: int, **fields):
    """The default config on synthetic data, with a model and batch, and no checkpoints or evals."""
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
    config.train.checkpoint_every = 0  # the `checkpoint` case measures saves
    config.train.export = False
    config.eval.every = 0
    if sizes.steps_per_loop:
        config.train.steps_per_loop = sizes.steps_per_loop
    for dotted, value in fields.items():
        *path, leaf = dotted.split(".")
        section = config
        for key in path:
            section = section[key]
        section[leaf] = value
    return config


def towerflow(config, strategy, model_dir: str, steps: int) -> Run:
    """`train.run` for `steps` more steps; examples/s over whole loops after the first."""
    from trainer import train

    job = train.build(config, model_dir, strategy)
    batch = config.train.global_batch_size

    def run() -> float:
        job.total_steps = int(job.optimizer.iterations.numpy()) + steps
        clock = ProgressClock()
        with contextlib.redirect_stdout(clock):
            train.run(job, "train")
        return clock.rate(batch)

    run.self_warming = True
    return run


def _model_and_optimizer(config, spec, strategy, fused: bool = True):
    """The model and optimizer towerflow builds; `fused=False` gives Keras's own optimizer."""
    from trainer import models, optim, precision

    with strategy.scope(), precision.policy(config.train.precision):
        model = models.build(config.model, spec)
        optimizer = optim.build(config.optimizer, config.train.steps, fused)
    return model, optimizer


def bare_loop(config, strategy, dataset, steps: int) -> Run:
    """The floor: `strategy.run` of a minimal step, `steps` times in one `tf.function`."""
    import tensorflow as tf

    model, optimizer = _model_and_optimizer(config, dataset.spec, strategy)
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

    iterator = iter(strategy.distribute_dataset(dataset.train_fn(batch, config.seed)))
    n = tf.constant(steps, tf.int64)
    return lambda: steps * batch / _timed(lambda: loop(iterator, n).numpy())


def keras_fit(config, strategy, dataset, steps: int, steps_per_execution: int) -> Run:
    """Keras `model.fit` under the same strategy; examples/s between executions after the first.

    With Keras's own optimizer class (same kind, schedule and results), as a
    `fit` user has it.
    """
    import keras
    import tensorflow as tf

    model, optimizer = _model_and_optimizer(config, dataset.spec, strategy, fused=False)
    with strategy.scope():
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    batch = config.train.global_batch_size
    data = dataset.train_fn(batch, config.seed)(tf.distribute.InputContext())
    steps += steps_per_execution  # the first execution is not timed

    class Clock(keras.callbacks.Callback):
        """Notes when each execution of `fit` ends."""

        def __init__(self):
            super().__init__()
            self.progress = ProgressClock()

        def on_train_batch_end(self, batch, logs=None):
            self.progress.marks.append((time.perf_counter(), batch))

    def run() -> float:
        clock = Clock()
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[clock])
        return clock.progress.rate(batch)

    run.self_warming = True
    return run


def matmul_peak(n: int, matmuls: int) -> Run:
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
    return lambda: 2 * n**3 * matmuls / _timed(lambda: loop(a, k).numpy())


def model_matmuls(widths: list[int], batch: int, steps: int) -> Run:
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
    return lambda: batch * steps / _timed(lambda: loop(k).numpy())


def pipeline(strategy, dataset_fn, batch: int, batches: int) -> Run:
    """Examples/s of an input pipeline alone, distributed as the trainer reads it."""
    import tensorflow as tf

    iterator = iter(strategy.distribute_dataset(dataset_fn))
    # TF's own method, which autograph leaves alone: converting the plugin's
    # wrapper once failed here after other cases had run in the same process.
    local_results = strategy.tf_strategy.experimental_local_results

    @tf.function
    def loop(iterator, n):
        total = tf.constant(0.0)
        for _ in tf.range(n):
            x, _ = next(iterator)
            total += tf.add_n([tf.reshape(v, [-1])[0] for v in local_results(x)])
        return total

    n = tf.constant(batches, tf.int64)
    return lambda: batches * batch / _timed(lambda: loop(iterator, n).numpy())


def input_wait(config, strategy, dataset, steps: int) -> Run:
    """Mean microseconds a towerflow step waits for its batch, timed inside the loop.

    The clock starts once the previous step has updated the variables and
    stops once the next batch is there, on every replica.
    """
    import tensorflow as tf

    from trainer import steps as steps_lib
    from trainer import tasks

    model, optimizer = _model_and_optimizer(config, dataset.spec, strategy)
    batch = config.train.global_batch_size
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    task = tasks.for_spec(dataset.spec.num_classes)
    train_step = steps_lib.make_train_step(model, optimizer, task, batch)

    def step(inputs):
        train_step(inputs)
        # Read after their updates (program order), so the next clock starts once all are done.
        return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in optimizer.variables])

    def flat(values) -> list:
        return [t for v in tf.nest.flatten(values) for t in strategy.local_results(v)]

    @tf.function
    def loop(iterator, n):
        wait = tf.constant(0.0, tf.float64)
        for _ in tf.range(n):
            with tf.control_dependencies([wait]):  # after the previous step, see below
                start = tf.timestamp()
            with tf.control_dependencies([start]):
                inputs = next(iterator)
            with tf.control_dependencies(flat(inputs)):
                waited = tf.timestamp() - start
            done = strategy.call_for_each_replica(step, args=(inputs,))
            with tf.control_dependencies(flat(done)):
                wait = wait + waited
        return wait

    iterator = iter(strategy.distribute_dataset(dataset.train_fn(batch, config.seed)))
    n = tf.constant(steps, tf.int64)
    return lambda: float(loop(iterator, n).numpy()) / steps * 1e6


# --- cases -------------------------------------------------------------------------------


def _strategy(name: str):
    import strategies

    return strategies.get(name)


def _training_contenders(config, strategy, workdir: str, loops: int, prefix: str = ""):
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


def _training_ratios(samples: dict[str, list[float]], prefix: str = "") -> dict[str, float]:
    ours = f"{prefix}towerflow"
    keras = [k for k in samples if k.startswith(f"{prefix}keras_fit_spe")]
    ratios = {f"{ours}/bare_loop": paired(samples, lambda r: r[ours] / r[f"{prefix}bare_loop"])}
    if keras:  # Keras may have failed to run at all (see `failed`)
        best = paired(samples, lambda r: r[ours] / max(r[k] for k in keras))
        ratios[f"{ours}/keras_fit_best"] = best
    for k in keras:
        ratios[f"{ours}/{k.removeprefix(prefix)}"] = paired(samples, lambda r, k=k: r[ours] / r[k])
    return ratios


def _small_config(sizes: Sizes, strategy: str, **fields):
    return _config(
        sizes, strategy, sizes.small_hidden, sizes.small_input, sizes.small_batch, **fields
    )


def small_mlp(sizes: Sizes, reps: int, workdir: str) -> dict:
    """An overhead-bound MLP under the default strategy: examples/s."""
    config = _small_config(sizes, _default_strategy())
    strategy = _strategy(config.strategy.name)
    contenders = _training_contenders(config, strategy, workdir, sizes.small_loops)
    # One step per loop: what a loop costs beyond its steps, measured where it is large.
    one_step = _small_config(sizes, config.strategy.name, **{"train.steps_per_loop": 1})
    one_step_dir = os.path.join(workdir, "small_mlp-loop1")
    contenders["towerflow_loop1"] = towerflow(one_step, strategy, one_step_dir, sizes.loop1_steps)
    failed: dict[str, str] = {}
    samples = alternate(contenders, reps, failed)
    figures = medians(samples)
    ratios = _training_ratios(samples)
    loop = config.train.steps_per_loop
    step_s = sizes.small_batch / figures["bare_loop"]
    overhead_s = paired(
        samples, lambda r: sizes.small_batch * (1 / r["towerflow_loop1"] - 1 / r["bare_loop"])
    )
    return _result(
        "examples/s",
        figures,
        ratios,
        samples,
        failed=failed,
        parameters=_parameters(config),
        strategy=config.strategy.name,
        steps_per_loop=loop,
        per_loop_overhead_ms=overhead_s * 1e3,
        # The shortest loop whose overhead is under 2%: how the default was chosen.
        steps_per_loop_for_2pct=max(1, math.ceil(overhead_s / (0.02 * step_s))),
    )


def dense_large(sizes: Sizes, reps: int, workdir: str) -> dict:
    """A compute-bound MLP under one_device: utilisation of the float32 matmul peak."""
    fields = {"train.steps_per_loop": 0}  # auto: a loop is a step or two at this size
    config = _config(
        sizes, "one_device", sizes.large_hidden, sizes.large_input, sizes.large_batch, **fields
    )
    bf16 = _config(
        sizes,
        "one_device",
        sizes.large_hidden,
        sizes.large_input,
        sizes.large_batch,
        **fields,
        **{"train.precision": "mixed_bfloat16"},
    )
    from trainer import data

    strategy = _strategy("one_device")
    dataset = data.get(config.data)
    steps = sizes.large_steps
    model_dir = os.path.join(workdir, "dense_large")
    classes = config.data.synthetic.num_classes
    widths = [sizes.large_input, *sizes.large_hidden, classes]
    flops_per_example = 6 * _parameters(config)
    contenders = {
        "towerflow": towerflow(config, strategy, model_dir, steps + 1),
        "keras_fit_spe1": keras_fit(config, strategy, dataset, steps, 1),
        f"keras_fit_spe{steps}": keras_fit(config, strategy, dataset, steps, steps),
        "bare_loop": bare_loop(config, strategy, dataset, steps),
        "towerflow_mixed_bfloat16": towerflow(bf16, strategy, model_dir + "-bf16", steps + 1),
        "bare_loop_mixed_bfloat16": bare_loop(bf16, strategy, dataset, steps),
        "matmul_peak": matmul_peak(sizes.peak_n, max(2, int(2e10 / (2 * sizes.peak_n**3)))),
        "model_matmuls": model_matmuls(widths, sizes.large_batch, steps),
    }
    failed: dict[str, str] = {}
    samples = alternate(contenders, reps, failed)
    # The matmuls of a step alone, at the model's shapes: the most any loop could reach.
    samples["model_matmuls_only"] = samples.pop("model_matmuls")
    rates = medians(samples)
    peak = rates.pop("matmul_peak")
    figures = {
        name: paired(samples, lambda r, name=name: r[name] * flops_per_example / r["matmul_peak"])
        for name in rates
    }
    ratios = _training_ratios(samples)
    ratios["towerflow_mixed_bfloat16/bare_loop_mixed_bfloat16"] = paired(
        samples, lambda r: r["towerflow_mixed_bfloat16"] / r["bare_loop_mixed_bfloat16"]
    )
    return _result(
        "utilisation of the float32 matmul peak",
        figures,
        ratios,
        samples,
        failed=failed,
        examples_per_sec=rates,
        matmul_peak_gflops=peak / 1e9,
        parameters=_parameters(config),
        strategy="one_device",
        steps_per_loop="auto",
    )


def input_case(sizes: Sizes, reps: int, workdir: str) -> dict:
    """The synthetic and TFRecord pipelines alone against what training on them consumes.

    The time a step waits for its batch is measured inside the loop; the same
    with one batch repeated from memory is what `tf.distribute`'s per-replica
    input path costs alone, and the difference is the pipeline's share. The
    bare loop on the real and the in-memory batch gives that share without
    instrumentation: the difference of their time per step.
    """
    from trainer import data

    synthetic = _small_config(sizes, _default_strategy())
    tfrecord = _small_config(sizes, _default_strategy())
    tfrecord.data.update(_tfrecord_fields(synthetic, os.path.join(workdir, "records")))
    strategy = _strategy(synthetic.strategy.name)
    batch, loop = sizes.small_batch, synthetic.train.steps_per_loop
    steps = loop * sizes.small_loops
    contenders = {}
    for name, config in (("synthetic", synthetic), ("tfrecord", tfrecord)):
        dataset = data.get(config.data)
        model_dir = os.path.join(workdir, f"input-{name}")
        contenders[f"pipeline_{name}"] = pipeline(
            strategy, dataset.train_fn(batch, 0), batch, steps
        )
        contenders[f"towerflow_{name}"] = towerflow(config, strategy, model_dir, steps + loop)
        contenders[f"bare_loop_{name}"] = bare_loop(config, strategy, dataset, steps)
        contenders[f"wait_us_{name}"] = input_wait(config, strategy, dataset, steps)
    in_memory = _OneBatchForever(data.get(synthetic.data))
    contenders["bare_loop_in_memory"] = bare_loop(synthetic, strategy, in_memory, steps)
    contenders["wait_us_in_memory"] = input_wait(synthetic, strategy, in_memory, steps)
    samples = alternate(contenders, reps)
    values = medians(samples)
    figures = {k: v for k, v in values.items() if not k.startswith("wait_us")}
    ratios, waits = {}, {"in_memory": values["wait_us_in_memory"]}
    for name in ("synthetic", "tfrecord"):
        ratios[f"pipeline/consumed_{name}"] = paired(
            samples, lambda r, n=name: r[f"pipeline_{n}"] / r[f"towerflow_{n}"]
        )
        waits[name] = values[f"wait_us_{name}"]
        waits[f"{name}_minus_in_memory"] = paired(
            samples, lambda r, n=name: r[f"wait_us_{n}"] - r["wait_us_in_memory"]
        )
        waits[f"{name}_step_minus_in_memory_step"] = paired(
            samples,
            lambda r, n=name: (
                batch * 1e6 * (1 / r[f"bare_loop_{n}"] - 1 / r["bare_loop_in_memory"])
            ),
        )
    return _result(
        "examples/s",
        figures,
        ratios,
        samples,
        input_wait_us=waits,
        strategy=synthetic.strategy.name,
    )


class _OneBatchForever:
    """A dataset whose training stream repeats its first batch from memory: input at no cost."""

    def __init__(self, dataset):
        self.spec = dataset.spec
        self._dataset = dataset

    def train_fn(self, global_batch_size: int, seed: int, start_step: int = 0):
        make = self._dataset.train_fn(global_batch_size, seed, start_step)
        return lambda context: make(context).take(1).cache().repeat()


def _tfrecord_fields(config, directory: str, files: int = 8) -> dict:
    """Writes the synthetic train split as TFRecord files; the `data` fields that read them."""
    import numpy as np
    import tensorflow as tf

    from trainer import data

    dataset = data.get(config.data)
    size = dataset.spec.train_size
    x, y = next(iter(dataset.train_fn(size, seed=0)(tf.distribute.InputContext())))  # all of it
    x, y = x.numpy(), y.numpy()
    os.makedirs(directory, exist_ok=True)
    for i in range(files):
        with tf.io.TFRecordWriter(os.path.join(directory, f"train-{i}.tfrecord")) as writer:
            for features, label in zip(x[i::files], y[i::files]):
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=features)),
                            "label": tf.train.Feature(
                                int64_list=tf.train.Int64List(value=[int(label)])
                            ),
                        }
                    )
                )
                writer.write(example.SerializeToString())
    width = int(np.prod(x.shape[1:]))
    pattern = os.path.join(directory, "train-*.tfrecord")
    return {
        "name": "tfrecord",
        "train_files": pattern,
        "eval_files": pattern,
        "features": f"x:float32:{width}",
        "input_shape": (width,),
        "num_classes": config.data.synthetic.num_classes,
    }


def strategies_case(sizes: Sizes, reps: int, workdir: str) -> dict:
    """small_mlp under every strategy, relative to one_device."""
    import strategies

    contenders = {}
    for name in SINGLE_PROCESS:
        config = _small_config(sizes, name)
        contenders.update(
            _training_contenders(
                config, _strategy(name), workdir, sizes.small_loops, prefix=f"{name}/"
            )
        )
    failed: dict[str, str] = {}
    samples = alternate(contenders, reps, failed)
    figures = medians(samples)
    ratios = {}
    for name in SINGLE_PROCESS:
        ratios.update(_training_ratios(samples, prefix=f"{name}/"))
    notes = []
    known = strategies.available()
    for name, topology in (("multi_worker", ["--workers=2"]), ("parameter_server", PS_TOPOLOGY)):
        if name not in sizes.clusters:
            notes.append(f"{name}: not run at these sizes (`Sizes.clusters`)")
            continue
        if name not in known:
            notes.append(f"{name}: not registered here (strategies.available()); skipped")
            _note(notes[-1])
            continue
        runs = [_cluster_rate(sizes, name, topology, workdir) for _ in range(max(1, reps // 3))]
        samples[f"{name}/towerflow"] = runs
        figures[f"{name}/towerflow"] = statistics.median(runs)
    base = "one_device/towerflow"
    for name in SINGLE_PROCESS:
        ratios[f"{name}/one_device"] = paired(
            samples, lambda r, n=name: r[f"{n}/towerflow"] / r[base]
        )
    for name in ("multi_worker", "parameter_server"):  # one run each: against the median
        if f"{name}/towerflow" in figures:
            ratios[f"{name}/one_device"] = figures[f"{name}/towerflow"] / figures[base]
    return _result("examples/s", figures, ratios, samples, failed=failed, notes=notes)


PS_TOPOLOGY = ["--workers=2", "--ps=1"]


def _cluster_rate(sizes: Sizes, name: str, topology: list[str], workdir: str) -> float:
    """examples/s of a local cluster, timed from the chief's progress lines as they arrive."""
    loop = sizes.steps_per_loop or _small_config(sizes, name).train.steps_per_loop
    overrides = {
        "data.name": "synthetic",
        "data.synthetic.input_shape": f"({sizes.small_input},)",
        "data.synthetic.num_examples": sizes.examples,
        "model.hidden_units": "(" + "".join(f"{u}," for u in sizes.small_hidden) + ")",
        "model.dropout": 0.0,
        "train.global_batch_size": sizes.small_batch,
        "train.steps": sizes.cluster_steps,
        "train.steps_per_loop": loop,
        "train.checkpoint_every": 0,
        "train.export": False,
        "eval.every": 0,
    }
    model_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    command = [
        sys.executable,
        "-m",
        "trainer.launch",
        *topology,
        "--",
        f"--strategy={name}",
        f"--model_dir={model_dir}",
        "--mode=train",
        *args,
    ]
    clock = ProgressClock()
    with _child(command) as child:
        for line in child.stdout:
            clock.mark(line)
    if child.returncode:
        raise RuntimeError(f"{name} cluster exited with {child.returncode}: {' '.join(command)}")
    return clock.rate(sizes.small_batch)


def startup(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Seconds to the first finished step of `python -m trainer`, and what they compare with."""
    trainer = [
        sys.executable,
        "-m",
        "trainer",
        "--mode=train",
        "--config.train.steps=2",
        "--config.train.steps_per_loop=1",
        "--config.train.export=false",
        "--config.eval.every=0",
    ]
    contenders = {
        "import_tensorflow_s": lambda: _seconds_to_exit([sys.executable, "-c", _IMPORT_TF]),
        "floor_s": lambda: _seconds_to_exit([sys.executable, "-c", _FLOOR]),
        "towerflow_first_step_s": lambda: _seconds_to_first_step(
            [*trainer, f"--model_dir={tempfile.mkdtemp(dir=workdir)}"]
        ),
    }
    samples = {name: [] for name in contenders}
    for _ in range(max(reps, sizes.startup_reps)):  # no warm-up: a cold start is the point
        for name, run in contenders.items():
            samples[name].append(run())
            _note(f"  {name}: {samples[name][-1]:.2f}")
    figures = medians(samples)
    first = "towerflow_first_step_s"
    ratios = {
        "towerflow_first_step/floor": paired(samples, lambda r: r[first] / r["floor_s"]),
        "towerflow_first_step/import_tensorflow": paired(
            samples, lambda r: r[first] / r["import_tensorflow_s"]
        ),
    }
    return _result("seconds", figures, ratios, samples)


_IMPORT_TF = "import tensorflow"
# The least a TF program does before its first step: import, build a model, trace and run it.
_FLOOR = """
import tensorflow as tf, keras
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam()
@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
step(tf.zeros([128, 8, 8, 1]), tf.zeros([128], tf.int32)).numpy()
"""


@contextlib.contextmanager
def _child(command: list[str]) -> Iterator[subprocess.Popen]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    child = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()


def _seconds_to_exit(command: list[str]) -> float:
    tic = time.perf_counter()
    with _child(command) as child:
        output = child.stdout.read()
    if child.returncode:
        raise RuntimeError(f"{command} failed: {output[-500:]}")
    return time.perf_counter() - tic


def _seconds_to_first_step(command: list[str]) -> float:
    tic = time.perf_counter()
    with _child(command) as child:
        for line in child.stdout:
            if _PROGRESS.match(line):
                return time.perf_counter() - tic
    raise RuntimeError(f"no progress line from {' '.join(command)}")


def checkpoint_case(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Seconds a save blocks training, synchronous and asynchronous, and a restore."""
    from trainer import train
    from trainer.checkpoints import Checkpointer

    config = _config(sizes, "one_device", sizes.ckpt_hidden, sizes.large_input, 64)
    job = train.build(config, os.path.join(workdir, "ckpt"))
    objects = train._checkpointed(job)
    savers = {
        mode: Checkpointer(
            os.path.join(workdir, f"ckpt-{mode}"), True, 2, async_save=mode == "async", **objects
        )
        for mode in ("sync", "async")
    }
    step = iter(range(1, 10**6))
    finished: dict[str, list[float]] = {"async": []}

    def save(mode: str) -> float:
        saver = savers[mode]
        blocked = _timed(lambda: saver.save(next(step)))
        if mode == "async":
            finished["async"].append(blocked + _timed(saver.sync))
        return blocked

    contenders = {
        "sync_save_blocks_s": lambda: save("sync"),
        "async_save_blocks_s": lambda: save("async"),
        "restore_s": lambda: _timed(savers["sync"].restore),
    }
    samples = alternate(contenders, reps)
    figures = medians(samples)
    figures["async_save_completes_s"] = statistics.median(finished["async"][1:])
    size = _directory_mb(savers["sync"].latest)
    for saver in savers.values():
        saver.close()
    ratios = {
        "async_blocks/sync_blocks": paired(
            samples, lambda r: r["async_save_blocks_s"] / r["sync_save_blocks_s"]
        )
    }
    return _result(
        "seconds", figures, ratios, samples, checkpoint_mb=size, parameters=_parameters(config)
    )


def _directory_mb(prefix: str) -> float:
    directory, stem = os.path.split(prefix)
    files = [f for f in os.listdir(directory) if f.startswith(os.path.basename(stem) + ".")]
    return sum(os.path.getsize(os.path.join(directory, f)) for f in files) / 2**20


# --- helpers --------------------------------------------------------------------------


def _default_strategy() -> str:
    import configs.default

    return configs.default.get_config().strategy.name


def _parameters(config) -> int:
    from trainer import data, models

    return models.build(config.model, data.get(config.data).spec).count_params()


def _result(unit: str, figures: dict, ratios: dict, samples: dict, **extra) -> dict:
    return {"unit": unit, "figures": figures, "ratios": ratios, "samples": samples, **extra}


def _first_line(error: BaseException) -> str:
    """The telling line of an error: TF's first root error if there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    root = [line for line in lines if re.match(r"\(0\) [A-Z_]+:", line)]
    return f"{type(error).__name__}: {(root or lines or [''])[0][:300]}"


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def machine() -> dict:
    """What the figures were measured on."""
    import keras
    import tensorflow as tf

    model = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return {
        "cpu": model,
        "cpu_cores": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "load_average_at_start": os.getloadavg()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": sys.version.split()[0],
    }


def table(results: dict) -> str:
    """The figures and ratios of every case, as Markdown tables.

    `spread` is (max - min) / median of a figure's repetitions.
    """
    lines = []
    for case, result in results["cases"].items():
        lines += ["", f"### {case} ({result['unit']})", ""]
        lines += ["| figure | median | spread |", "| --- | --- | --- |"]
        for name, value in result["figures"].items():
            runs = result["samples"].get(name, [])
            spread = f"{(max(runs) - min(runs)) / statistics.median(runs):.0%}" if runs else "-"
            lines.append(f"| {name} | {_fmt(value)} | {spread} |")
        lines += [f"| **{k}** | **{_fmt(v)}** | |" for k, v in result["ratios"].items()]
        for key, value in result.items():
            if key not in ("unit", "figures", "ratios", "samples"):
                lines.append(f"\n{key}: {_fmt(value)}")
    return "\n".join(lines).strip() + "\n"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(_fmt(v) for v in value) or "-"
    return str(value)


_RUNNERS = {
    "small_mlp": small_mlp,
    "dense_large": dense_large,
    "input": input_case,
    "strategies": strategies_case,
    "startup": startup,
    "checkpoint": checkpoint_case,
}


def benchmark(cases: list[str], quick: bool, reps: int, in_process: bool = False) -> dict:
    """Runs `cases`; returns the machine, the sizes and every case's figures.

    Each case runs in a process of its own, set up (logical CPUs, threads per
    op) as the trainer sets up that case's strategy: `dense_large` as
    `one_device`, the others as the default strategy, whose towers share the
    cores. The setup holds for the whole process, so every contender of a case
    runs with it. `in_process` runs `cases` here instead, set up for the first.
    """
    if not in_process:
        return _in_children(cases, quick, reps)
    import strategies
    from strategies import devices

    replicas = strategies.plugin(_case_strategy(cases[0])).local_replicas(None, LOGICAL_CPUS)
    devices.configure(LOGICAL_CPUS, replicas=replicas)
    sizes = QUICK if quick else FULL
    results = {"machine": machine(), "quick": quick, "reps": reps, "cases": {}}
    results["sizes"] = dataclasses.asdict(sizes)
    workdir = tempfile.mkdtemp(prefix="towerflow-bench-")
    try:
        for case in cases:
            _note(f"{case}:")
            tic = time.perf_counter()
            results["cases"][case] = _RUNNERS[case](sizes, reps, workdir)
            results["cases"][case]["case_wall_s"] = time.perf_counter() - tic
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _case_strategy(case: str) -> str:
    return "one_device" if case == "dense_large" else _default_strategy()


def _in_children(cases: list[str], quick: bool, reps: int) -> dict:
    """`benchmark` of each case in a child process; their notes stream to stderr.

    With `quick` (a smoke test), neighbouring cases set up alike share a child,
    so that it spends its time in the cases rather than in starting TensorFlow.
    """
    if quick:
        groups = [",".join(group) for _, group in itertools.groupby(cases, _case_strategy)]
    else:
        groups = list(cases)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="towerflow-bench-") as scratch:
        for i, group in enumerate(groups):
            path = os.path.join(scratch, f"{i}.json")
            command = [sys.executable, "-m", "trainer.bench", "--in_process", f"--cases={group}"]
            command += [f"--reps={reps}", f"--json={path}", *(["--quick"] if quick else [])]
            code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
            if code:  # its own error is on stderr already
                sys.exit(f"error: the {group} case exited with {code}: {' '.join(command)}")
            with open(path) as f:
                part = json.load(f)
            if results:  # the first case's machine and sizes stand for all
                results["cases"].update(part["cases"])
            else:
                results = part
    return results


@cli.guarded
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"Unexpected arguments: {' '.join(argv[1:])}; see --help.")
    unknown = [c for c in _CASES.value if c not in CASES]
    if unknown or not _CASES.value:
        cli.fail(f"Unknown `--cases` {', '.join(unknown) or '(none)'}; known: {', '.join(CASES)}.")
    reps = _REPS.value if _REPS.value is not None else (1 if _QUICK.value else 5)
    if reps < 1:
        cli.fail(f"`--reps` ({reps}) must be at least 1; e.g. `--reps=3`.")
    import absl.logging

    absl.logging.set_verbosity(absl.logging.WARNING)
    results = benchmark(list(_CASES.value), _QUICK.value, reps, _IN_PROCESS.value)
    print(table(results), flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        cli.fail(cli.one_line(e))


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_parse_flags)
