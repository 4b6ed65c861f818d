"""The `data_service` case: towerflow's input in the trainer against the tf.data service.

Four figures side by side:

1. `compute/` and 2. `input/`, `balanced/`: three jobs, each trained with
   its input in the trainer and on a dispatcher and one data worker
   (`data.service`), as `towerflow` contenders: the small MLP on synthetic
   data (compute-bound: the service's overhead), and the small MLP on a
   pipeline that does busy work for every batch, 4x the step's own time
   (`input`) or about as much (`balanced`). The case's process (the
   trainer) runs on one core and the data worker on another, so one data
   worker takes a step from I + C to max(I, C) (I the input's time a
   batch, C the step's own): `bounds` says what that allows each job (2x
   at most, where I = C; 1.25x for `input`, which more data workers
   would need). The targets: at least 1.6 for `balanced` and at least 0.95
   for the compute-bound job.
3. `sweep/`: `python -m trainer.sweep` of 2 trials with the same `busy`
   pipeline, side by side (`--parallel=2`), with `--share_input` (one data
   worker, one shared stream) and without (each trial on a service of its
   own, `data.service=local:1`): the CPU seconds of the data workers
   (utime + stime from `/proc/<pid>/stat`, their start-up included) per
   trial. Target: shared about half of own (ratio 0.5).
4. `hosts/`: the default job (`python -m trainer`, digits) reading from a
   dispatcher and a data worker on another simulated host (`hosts.py`, a
   network namespace each), against the same servers on the trainer's own
   host; the trainer pinned to one core, the servers to the other, in both.
   Needs root; elsewhere the case says why, no figures.

`step_ms` says where the step time of each contender of 1. and 2. goes: the
milliseconds a step waited for its input, out of the whole step.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import tensorflow as tf

from trainer.bench import clock, contenders, hosts, multi_host
from trainer.bench.harness import (
    REPO,
    alternate,
    child,
    descendants_cpu_s,
    medians,
    note,
    paired,
    result,
    tail,
)
from trainer.bench.sizes import Sizes, small_config

BUSY_EXAMPLES = 4096
BUSY_FEATURES = 16
BUSY_ROUNDS = 40  # 256x256 matmuls per batch: 4x the small MLP's own step on one core
BALANCED_ROUNDS = 6  # about the small MLP's own step: the input costs what the step does
POLL_S = 0.1  # how often the sweep's data workers' CPU time is read
RUN_TIMEOUT_S = 600  # one sweep or one trainer; a loaded machine is slow, not stuck
PORTS = {"dispatcher": 5050, "worker": 5051}  # on a simulated host (each has its own ports)


def busy(input_context, split, global_batch_size):
    """A user's pipeline whose every batch costs `BUSY_ROUNDS` matmuls: input-bound training."""
    return _busy(input_context, global_batch_size, BUSY_ROUNDS)


def balanced(input_context, split, global_batch_size):
    """`busy` with `BALANCED_ROUNDS`: a batch's input costs about what its step does."""
    return _busy(input_context, global_batch_size, BALANCED_ROUNDS)


def _busy(input_context, global_batch_size: int, rounds: int) -> tf.data.Dataset:
    x = tf.random.stateless_normal([BUSY_EXAMPLES, BUSY_FEATURES], seed=[1, 2])
    y = tf.cast(tf.argmax(x[:, :10], axis=1), tf.int32)
    examples = tf.data.Dataset.from_tensor_slices((x, y)).shard(
        input_context.num_input_pipelines, input_context.input_pipeline_id
    )
    batch = input_context.get_per_replica_batch_size(global_batch_size)

    def work(x, y):
        m = tf.random.stateless_normal([256, 256], seed=[0, 0])
        m = tf.foldl(lambda a, _: tf.linalg.normalize(a @ m)[0], tf.range(rounds), initializer=m)
        return x + 0 * tf.reduce_sum(m), y

    return examples.shuffle(BUSY_EXAMPLES, seed=0).batch(batch, drop_remainder=True).map(work)


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Both jobs, in the trainer and on the service; the ratios of their examples/s."""
    jobs = _jobs(sizes)
    cores = sorted(os.sched_getaffinity(0))
    runs, samples = _in_trainer_and_on_service(sizes, jobs, cores, reps, workdir)
    step_time = _step_time(runs, samples, jobs["compute"].train.global_batch_size)
    ratios = {
        f"{job}/service_over_trainer": paired(
            samples, lambda r, j=job: r[f"{j}/service"] / r[f"{j}/trainer"]
        )
        for job in jobs
    }
    rounds = max(1, reps // 2)
    sweep = _sweep_rounds(sizes, rounds, workdir)
    samples.update(sweep)
    ratios["sweep/shared_over_own"] = paired(
        sweep,
        lambda r: r["sweep/shared_input_cpu_s_per_trial"] / r["sweep/own_input_cpu_s_per_trial"],
    )
    notes = []
    reason = hosts.available()
    if reason:
        notes.append(f"hosts/ not run: {reason}")
        note(f"  across hosts skipped: {reason}")
    else:
        across = _across_hosts_rounds(sizes, rounds, workdir)
        samples.update(across)
        ratios["hosts/two_hosts_over_one_host"] = paired(
            across, lambda r: r["hosts/two_hosts"] / r["hosts/one_host"]
        )
    return result(
        "examples/s; sweep/: CPU seconds",
        medians(samples),
        ratios,
        samples,
        targets={
            "balanced/service_over_trainer": 1.6,
            "compute/service_over_trainer": 0.95,
            "sweep/shared_over_own": 0.5,
        },
        cores={"trainer": cores[:1], "data_worker": cores[1:2] or cores[:1]},
        step_ms=step_time,
        bounds=_bounds_of_one_worker(step_time),
        notes=notes,
    )


def _jobs(sizes: Sizes) -> dict:
    """The compute-bound job, and the two whose input costs 4x and about 1x the step."""

    def on(source: str) -> dict:
        return {"data.name": f"{__name__}:{source}", "data.num_classes": 10}

    return {
        "compute": small_config(sizes, "one_device"),
        "input": small_config(sizes, "one_device", **on("busy")),
        "balanced": small_config(sizes, "one_device", **on("balanced")),
    }


def _in_trainer_and_on_service(
    sizes: Sizes, jobs: dict, cores: list[int], reps: int, workdir: str
) -> tuple[dict, dict]:
    """Each job with its input in the trainer and on one data worker, in turn.

    The trainer runs on one core and the data worker on another, so the service
    takes the input off the trainer's core.
    """
    from trainer.data import service_client
    from trainer.launch import pick_ports

    strategy = contenders.plugin("one_device")
    loop = jobs["compute"].train.steps_per_loop
    steps = loop * sizes.small_loops
    with contextlib.ExitStack() as stack:
        stack.callback(pin, os.getpid(), cores)  # the sweeps after this use every core
        servers = stack.enter_context(service_client.LocalService(pick_ports(2)))
        if len(cores) > 1:
            pin(os.getpid(), cores[:1])
            pin(servers.procs["data:worker:0"].pid, cores[1:2])
        workers = service_client.wait_until_served(
            servers.address, servers, service_client.TIMEOUT_S
        )
        on_service = service_client.Service(servers.address, workers, True, "off")
        runs = {}
        for job, config in jobs.items():
            for where, used in (("trainer", None), ("service", on_service)):
                model_dir = os.path.join(workdir, f"data_service-{job}-{where}")
                runs[f"{job}/{where}"] = contenders.towerflow(
                    config, strategy, model_dir, steps + loop, service=used
                )
        note(f"  trainer on core {cores[0]}, data worker on core {cores[1:2] or 'the same'}")
        return runs, alternate(runs, reps)


def _bounds_of_one_worker(step_time: dict) -> dict[str, float]:
    """The speedup one data worker allows each input-heavy job.

    It takes the input off the trainer's core: from I + C a step to max(I, C),
    I the input's time a batch (the service's step, which waits for it) and C
    the step's own (the compute-bound job's): 2x at most, where I = C.
    """
    bounds = {}
    for job in ("input", "balanced"):
        if f"{job}/service" in step_time and "compute/trainer" in step_time:
            i, c = step_time[f"{job}/service"]["step"], step_time["compute/trainer"]["step"]
            bounds[f"{job}/bound_of_one_worker"] = (i + c) / max(i, c)
    return bounds


def _sweep_rounds(sizes: Sizes, rounds: int, workdir: str) -> dict[str, list[float]]:
    """Input CPU seconds per sweep trial, with the input shared and each trial's own."""
    sweep = {}
    for rep in range(rounds):
        for shared in (True, False):
            key = f"sweep/{'shared' if shared else 'own'}_input_cpu_s_per_trial"
            cpu_s = _sweep_input_cpu_s(sizes, shared, os.path.join(workdir, f"{key}-{rep}"))
            sweep.setdefault(key, []).append(cpu_s)
            note(f"  rep {rep + 1} {key}: {cpu_s:.3g}")
    return sweep


def _across_hosts_rounds(sizes: Sizes, rounds: int, workdir: str) -> dict[str, list[float]]:
    """Examples/s with the data worker on the trainer's host and on another host."""
    across = {}
    for rep in range(rounds):
        for where in ("one_host", "two_hosts"):
            rate = _across_hosts(sizes, where, os.path.join(workdir, f"hosts-{where}-{rep}"))
            across.setdefault(f"hosts/{where}", []).append(rate)
            note(f"  rep {rep + 1} hosts/{where}: {rate:.4g} examples/s")
    return across


def pin(pid: int, cores: list[int]) -> None:
    """Puts every thread of process `pid` on `cores`; threads it starts later inherit them.

    `os.sched_setaffinity(pid)` alone moves one thread (Linux): TensorFlow's
    thread pools, started with the process, would keep every core.
    """
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended meanwhile
            os.sched_setaffinity(int(thread), cores)


def _step_time(runs: dict, samples: dict, batch: int) -> dict[str, dict[str, float]]:
    """Where each contender's step goes: milliseconds waiting for input, and the rest (medians).

    The rest is the step's own work plus, with the input in the trainer, the
    input pipeline's work on the same core. The wait is taken where batches are
    read, which may be the prefetch running beside the step: when the input is
    the bottleneck it is about the whole step.
    """
    timed = [name for name, run in runs.items() if run.input_wait_ms and samples.get(name)]
    rates = medians({name: samples[name] for name in timed})
    waits = medians({name: runs[name].input_wait_ms for name in timed})
    split = {}
    for name in timed:
        step, wait = 1000 * batch / rates[name], waits[name]
        split[name] = {"step": round(step, 3), "input_wait": round(wait, 3)}
        note(f"  {name}: {step:.3g} ms a step, {wait:.3g} ms of it waiting for input")
    return split


def _sweep_input_cpu_s(sizes: Sizes, shared: bool, stem: str) -> float:
    """CPU seconds of a 2-trial sweep's data workers, per trial, with or without `--share_input`.

    Trials of the same `busy` pipeline (only the learning rate differs) run
    side by side; without sharing each starts a service of its own
    (`data.service=local:1`). The data workers are the sweep's descendants,
    read every `POLL_S` until they exit.
    """
    command = [
        sys.executable, "-m", "trainer.sweep",
        "--sweep.optimizer.learning_rate=1e-3,3e-3",
        "--parallel=2",
        "--metric=train/loss",
        "--mode=min",
        f"--sweep_dir={stem}",
        *(["--share_input"] if shared else []),
        "--",
        "--strategy=one_device",
        "--mode=train",
        f"--config.data.name={__name__}:busy",
        "--config.data.num_classes=10",
        f"--config.train.steps={sizes.service_sweep_steps}",
        "--config.train.checkpoint_every=0",
        "--config.train.export=False",
        *([] if shared else ["--config.data.service=local:1"]),
    ]  # fmt: skip
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    cpu: dict[int, float] = {}  # data worker pid -> its latest CPU seconds
    with child(command, f"{stem}.log") as sweep:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while sweep.poll() is None and time.monotonic() < deadline:
            cpu.update(data_workers_cpu_s(sweep.pid))
            time.sleep(POLL_S)
    if sweep.returncode != 0:
        raise RuntimeError(f"the sweep exited with {sweep.returncode}:\n{tail(f'{stem}.log')}")
    if len(cpu) != (1 if shared else 2):
        raise RuntimeError(f"expected {1 if shared else 2} data workers, saw {len(cpu)}")
    return sum(cpu.values()) / 2


def data_workers_cpu_s(root: int) -> dict[int, float]:
    """The CPU seconds (user + system) of each data worker descended from process `root`.

    A data worker is known by its command line, or, forked from a server
    (`towerflow.forkserver`, whose command line it shows), by its name
    (`data:worker:N`). Its own child is not another: forked and not yet exec'd
    (a subprocess it runs) it carries the worker's argv and name for a moment.
    """
    workers = {
        pid: (seconds, parent)
        for pid, (argv, seconds, parent) in descendants_cpu_s(root).items()
        if (b"trainer.data_service" in argv and b"--role=worker" in argv) or _named_worker(pid)
    }
    return {pid: seconds for pid, (seconds, parent) in workers.items() if parent not in workers}


def _named_worker(pid: int) -> bool:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().startswith("data:worker:")
    return False


def _across_hosts(sizes: Sizes, where: str, stem: str) -> float:
    """examples/s of the default job on the service, its servers on another host or its own."""
    flags = multi_host._models(sizes)["default"]
    per_step = int(multi_host._flag(flags, "train.global_batch_size"))
    cores = sorted(os.sched_getaffinity(0))
    data_cpu = cores[1] if len(cores) > 1 else cores[0]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    module = [sys.executable, "-m", "trainer.data_service"]
    with hosts.Hosts(2 if where == "two_hosts" else 1) as simulated:
        data_host = 1 if where == "two_hosts" else 0
        address = simulated.address(data_host)
        with open(f"{stem}-data.log", "w") as log:
            for role, port in PORTS.items():
                simulated.start(
                    data_host,
                    [*module, f"--role={role}", f"--port={port}",
                     f"--dispatcher={address}:{PORTS['dispatcher']}", f"--host={address}"],
                    env=env, cpu=data_cpu, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        trainer = simulated.start_trainer(
            0,
            [
                "--strategy=one_device",
                f"--model_dir={stem}",
                f"--config.data.service=grpc://{address}:{PORTS['dispatcher']}",
                *flags,
            ],
            f"{stem}.log",
            cpu=cores[0],
            env={clock.FILE_VARIABLE: f"{stem}.clock"},
        )
        if trainer.wait(timeout=RUN_TIMEOUT_S):
            raise RuntimeError(f"{stem} exited with {trainer.returncode}:\n{tail(f'{stem}.log')}")
    steps = int(multi_host._flag(flags, "train.steps")) - 1
    return clock.rate(clock.read(f"{stem}.clock"), per_step, until=steps)
