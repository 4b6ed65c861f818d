"""The `data_service` case: towerflow's input in the trainer against the tf.data service.

Two jobs, each trained with its input in the trainer and on a dispatcher and
one data worker (`data.service`), as `towerflow` contenders: the small MLP on
synthetic data (compute-bound: the service's overhead) and the small MLP on a
pipeline that does busy work for every batch (input-bound). The case's process
(the trainer) runs on one core and the data worker on another, so the
service's gain is at most one more core: the issue's targets are a ratio of at
least 1.6 for the input-bound job and at least 0.95 for the compute-bound one.
"""

from __future__ import annotations

import contextlib
import os

import tensorflow as tf

from trainer.bench import contenders
from trainer.bench.harness import alternate, medians, note, paired, result
from trainer.bench.sizes import Sizes, small_config

BUSY_EXAMPLES = 4096
BUSY_FEATURES = 16
BUSY_ROUNDS = 40  # 256x256 matmuls per batch: a few ms of one core


def busy(input_context, split, global_batch_size):
    """A user's pipeline whose every batch costs `BUSY_ROUNDS` matmuls: input-bound training."""
    x = tf.random.stateless_normal([BUSY_EXAMPLES, BUSY_FEATURES], seed=[1, 2])
    y = tf.cast(tf.argmax(x[:, :10], axis=1), tf.int32)
    examples = tf.data.Dataset.from_tensor_slices((x, y)).shard(
        input_context.num_input_pipelines, input_context.input_pipeline_id
    )
    batch = input_context.get_per_replica_batch_size(global_batch_size)

    def work(x, y):
        m = tf.random.stateless_normal([256, 256], seed=[0, 0])
        m = tf.foldl(
            lambda a, _: tf.linalg.normalize(a @ m)[0], tf.range(BUSY_ROUNDS), initializer=m
        )
        return x + 0 * tf.reduce_sum(m), y

    return examples.shuffle(BUSY_EXAMPLES, seed=0).batch(batch, drop_remainder=True).map(work)


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Both jobs, in the trainer and on the service; the ratios of their examples/s."""
    from trainer.data import service
    from trainer.launch import pick_ports

    jobs = {
        "compute": small_config(sizes, "one_device"),
        "input": small_config(
            sizes,
            "one_device",
            **{"data.name": f"{__name__}:busy", "data.num_classes": 10},
        ),
    }
    strategy = contenders.plugin("one_device")
    loop = jobs["compute"].train.steps_per_loop
    steps = loop * sizes.small_loops
    cores = sorted(os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(service.LocalService(pick_ports(2)))
        if len(cores) > 1:  # the trainer on one core, the data worker on another
            os.sched_setaffinity(0, cores[:1])
            os.sched_setaffinity(servers.procs["data:worker:0"].pid, cores[1:2])
        workers = service.wait_until_served(servers.address, servers, service.TIMEOUT_S)
        on_service = service.Service(servers.address, workers, True, "off")
        runs = {}
        for job, config in jobs.items():
            for where, used in (("trainer", None), ("service", on_service)):
                model_dir = os.path.join(workdir, f"data_service-{job}-{where}")
                runs[f"{job}/{where}"] = contenders.towerflow(
                    config, strategy, model_dir, steps + loop, service=used
                )
        note(f"  trainer on core {cores[0]}, data worker on core {cores[1:2] or 'the same'}")
        samples = alternate(runs, reps)
    ratios = {
        f"{job}/service_over_trainer": paired(
            samples, lambda r, j=job: r[f"{j}/service"] / r[f"{j}/trainer"]
        )
        for job in jobs
    }
    return result(
        "examples/s",
        medians(samples),
        ratios,
        samples,
        targets={"input/service_over_trainer": 1.6, "compute/service_over_trainer": 0.95},
        cores={"trainer": cores[:1], "data_worker": cores[1:2] or cores[:1]},
    )
