"""`input_wait_ms` is timed around the loop's reads, leaving the input pipeline as it was.

Timing inside tf.data (a clock zipped with the batches, no prefetch at the
end) cost small_mlp's step about 0.2 ms of CPU; the loop of steps now reads
the clock around each `next` of the training iterator.
"""

import os

import numpy as np
import tensorflow as tf

from tests.helpers import tiny_config
from trainer.data import wait
from trainer.loop import train


def _loop(iterator, n: int):
    @tf.function
    def loop():
        total = tf.constant(0, tf.int64)
        for _ in tf.range(n):
            total += tf.reduce_sum(next(iterator))
        return total

    return loop


def test_a_timed_iterator_gives_the_batches_as_they_are_and_adds_up_its_waits():
    clock = wait.InputWait()
    dataset = tf.data.Dataset.range(40).batch(4)
    plain, timed = iter(dataset), clock.timed(iter(dataset))
    assert int(_loop(plain, 10)()) == int(_loop(timed, 10)()) == sum(range(40))
    assert clock.take() > 0
    assert clock.take() == 0.0  # taken


def test_a_slow_pipeline_shows_in_the_waits_and_a_ready_one_does_not():
    def slowly(x):
        m = tf.random.stateless_normal([128, 128], seed=[0, 0])
        m = tf.foldl(lambda a, _: tf.linalg.normalize(a @ m)[0], tf.range(400), initializer=m)
        return x + tf.cast(0 * tf.reduce_sum(m), tf.int64)

    waits = {}
    for name, dataset in {
        "ready": tf.data.Dataset.range(20).cache().repeat().prefetch(8),
        "slow": tf.data.Dataset.range(20).map(slowly),
    }.items():
        clock = wait.InputWait()
        timed = clock.timed(iter(dataset))
        _loop(timed, 1)()  # traced, and the prefetch buffer filled
        clock.take()
        _loop(timed, 10)()
        waits[name] = clock.take()
    assert waits["slow"] > 4 * waits["ready"], waits


def test_the_trainer_times_its_reads_not_its_pipeline(tmp_path):
    config = tiny_config(**{"strategy.name": "one_device", "train.steps": 20})
    job = train.build(config, str(tmp_path / "run"))
    assert job.feature("input_wait") is not None
    pipeline = job.dataset.train_fn(16, 0)(tf.distribute.InputContext())
    assert pipeline.options().experimental_optimization.inject_prefetch is not False
    results = train.run(job, "train")
    assert np.isfinite(results["train"]["input_wait_ms"]) and results["train"]["input_wait_ms"] >= 0


def test_runs_one_after_another_leave_no_pipeline_threads_behind(tmp_path):
    # The timed iterator is an input of the traced loop. As a plain Python object it
    # was a capture of a new trace each run, which kept the run's per-device
    # pipelines (about 19 threads under mirrored) for as long as the process lived.
    config = tiny_config(**{"strategy.name": "mirrored", "train.async_checkpoint": False})
    job = train.build(config, str(tmp_path / "run"))
    assert job.feature("input_wait") is not None

    def threads_after_more_steps() -> int:
        job.total_steps = int(job.optimizer.iterations.numpy()) + 10
        train.run(job, "train")
        return len(os.listdir("/proc/self/task"))

    threads_after_more_steps()  # what a first run starts for good, started
    before = threads_after_more_steps()
    assert threads_after_more_steps() <= before  # a run's pipelines kept: about 19 more
