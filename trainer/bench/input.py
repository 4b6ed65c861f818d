"""The `input` case: the synthetic and TFRecord pipelines alone against what training consumes.

The time a step waits for its batch is measured inside the loop; the same
with one batch repeated from memory is what `tf.distribute`'s per-replica
input path costs alone, and the difference is the pipeline's share. The
bare loop on the real and the in-memory batch gives that share without
instrumentation: the difference of their time per step.
"""

from __future__ import annotations

import os

import ml_collections

from trainer.bench import contenders
from trainer.bench.harness import TimedRun, alternate, medians, paired, result, timed
from trainer.bench.sizes import Sizes, default_strategy, small_config


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Pipelines alone, towerflow and the bare loop on them, and the wait for a batch."""
    from trainer import data

    synthetic = small_config(sizes, default_strategy())
    tfrecord = small_config(sizes, default_strategy())
    tfrecord.data.update(tfrecord_fields(synthetic, os.path.join(workdir, "records")))
    strategy = contenders.plugin(synthetic.strategy.name)
    batch, loop = sizes.small_batch, synthetic.train.steps_per_loop
    steps = loop * sizes.small_loops
    runs = {}
    for name, config in (("synthetic", synthetic), ("tfrecord", tfrecord)):
        dataset = data.get(config.data)
        model_dir = os.path.join(workdir, f"input-{name}")
        runs[f"pipeline_{name}"] = pipeline(strategy, dataset.train_fn(batch, 0), batch, steps)
        runs[f"towerflow_{name}"] = contenders.towerflow(config, strategy, model_dir, steps + loop)
        runs[f"bare_loop_{name}"] = contenders.bare_loop(config, strategy, dataset, steps)
        runs[f"wait_us_{name}"] = input_wait(config, strategy, dataset, steps)
    in_memory = OneBatchForever(data.get(synthetic.data))
    runs["bare_loop_in_memory"] = contenders.bare_loop(synthetic, strategy, in_memory, steps)
    runs["wait_us_in_memory"] = input_wait(synthetic, strategy, in_memory, steps)
    samples = alternate(runs, reps)
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
    return result(
        "examples/s",
        figures,
        ratios,
        samples,
        input_wait_us=waits,
        strategy=synthetic.strategy.name,
    )


def pipeline(strategy, dataset_fn, batch: int, batches: int) -> TimedRun:
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
    return lambda: batches * batch / timed(lambda: loop(iterator, n).numpy())


def input_wait(config: ml_collections.ConfigDict, strategy, dataset, steps: int) -> TimedRun:
    """Mean microseconds a towerflow step waits for its batch, timed inside the loop.

    The clock starts once the previous step has updated the variables and
    stops once the next batch is there, on every replica.
    """
    import tensorflow as tf

    from trainer.loop import objectives
    from trainer.loop import steps as steps_lib

    model, optimizer = contenders.model_and_optimizer(config, dataset.spec, strategy)
    batch = config.train.global_batch_size
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    objective = objectives.for_spec(dataset.spec.num_classes)
    train_step = steps_lib.TrainStep(model, optimizer, objective, batch)

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


class OneBatchForever:
    """A dataset whose training stream repeats its first batch from memory: input at no cost."""

    def __init__(self, dataset):
        self.spec = dataset.spec
        self.dataset = dataset

    def train_fn(self, global_batch_size: int, seed: int, start_step: int = 0, start_batch=None):
        """The wrapped dataset's `train_fn`, taking its first batch and repeating it."""
        make = self.dataset.train_fn(global_batch_size, seed, start_step, start_batch)
        return lambda context: make(context).take(1).cache().repeat()


def tfrecord_fields(config: ml_collections.ConfigDict, directory: str, files: int = 8) -> dict:
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
