"""`data.service`: the trainer's side (the client) of TensorFlow's tf.data service.

A pipeline is still the source's `dataset_fn`; `data.service` only says where
it runs:

- `""`: in the trainer's own process (the default);
- `"local:N"`: on a dispatcher and N data workers that the trainer starts as
  child processes beside it (the servers' command, `python -m
  trainer.data_service`; `LocalService`), forked from one process that imported
  TensorFlow once (`towerflow.forkserver`), and stops with
  it; their output is prefixed `[data:dispatcher]`, `[data:worker:0]`, ...;
- `"grpc://host:port"`: on a dispatcher (and its workers) that runs elsewhere.

`ServiceDataset` wraps any source's `Dataset` (built-in, TFRecord/CSV, a
user's `dataset_fn`, a task's): its training `dataset_fn` builds the source's
pipeline and applies `tf.data.experimental.service.distribute` to it, so every
strategy gets its batches from the service through its usual
`distribute_dataset`, and the loop does not know.

How the data workers share a trainer's stream, `data.service_sharding`:

- `off` (TF's `parallel_epochs`, no sharding by the service; the default,
  except under `parameter_server`): each trainer input pipeline is its own job,
  and a data worker runs that pipeline whole, sharded by the trainer's
  `InputContext` as in the trainer. With one data worker the trainer receives
  exactly the batches, in exactly the order, the in-process pipeline gives:
  each example once per epoch (exactly-once), and exact resume after SIGKILL
  or preemption (a restarted run skips the batches already trained on). More
  data workers would each run the whole pipeline and repeat every batch: a
  `local:N` with N > 1 is refused in this mode.
- `dynamic` (TF's `distributed_epoch`; the default under `parameter_server`,
  whose workers take steps as they come): the trainers' pipelines are one
  job, built for a single input pipeline, whose source elements (the batch
  numbers of an indexed source, the files of a file source) the dispatcher
  hands out to the data workers as they ask. Each batch reaches one trainer
  once while every data worker lives; a data worker that dies loses the
  batches it had made and not yet sent (at-most-once), and the others go on.
  The order batches arrive in depends on timing, so a resumed run starts from
  the right position but is not bit-identical. The pipeline must be
  splittable (its source a range, tensor slices or file names); the first
  batch says so when it is not.

Evaluation reads the eval split in the trainer's own process, in every mode:
it is one pass, read exactly once, which neither mode guarantees (parallel
epochs repeat it on each data worker, a distributed epoch loses a dead worker's
share).

`data.service_job` names a shared stream: trainers (the trials of a sweep,
`python -m trainer.sweep --share_input`) that give the same name and build
identical pipelines read one stream, each every batch (TF's cross-trainer
cache); a trial that falls behind the cache's window skips batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import ml_collections
import tensorflow as tf

from towerflow import errors, forkserver, processes
from towerflow.errors import UserError
from trainer.data.base import Dataset, DatasetFn, TrainStreamWrapper

SHARDING = {
    "auto": "off, or dynamic under a strategy whose workers take steps as they come",
    "off": "parallel_epochs: each trainer pipeline its own job, run whole by a data worker",
    "dynamic": "distributed_epoch: one job; the dispatcher hands out the source's elements",
}
_LOCAL = re.compile(r"local:(-?\d+)$")
_REMOTE = re.compile(r"grpc://([^:/\s]+):(\d+)$")
TIMEOUT_S = 60.0  # default `data.service_timeout_s`
_POLL_S = 0.5
_LOOPBACK = "127.0.0.1"
_DISPATCHER = "data:dispatcher"  # how a local dispatcher's output lines are prefixed
_STOP_S = 5.0  # how long a local server may take to exit after SIGTERM


@dataclasses.dataclass(frozen=True)
class Service:
    """Where the training input runs.

    Attributes:
      address: the dispatcher, "grpc://host:port".
      workers: the data workers that answered at start.
      local: whether the trainer started them (`local:N`).
      sharding: "off" or "dynamic" (see the module docstring).
      job: a shared stream's name (`data.service_job`), or "".
    """

    address: str
    workers: int
    local: bool
    sharding: str
    job: str = ""

    def line(self) -> str:
        """The start-up line: `input: tf.data service at ..., 2 workers, sharding ...`."""
        where = "beside the trainer" if self.local else "elsewhere"
        workers = f"{self.workers} worker{'s' if self.workers > 1 else ''} {where}"
        shared = f", shared stream '{self.job}'" if self.job else ""
        mode = SHARDING[self.sharding].partition(":")[0]
        return (
            f"input: tf.data service at {self.address}, {workers}, sharding {self.sharding} "
            f"({mode}){shared}; eval in the trainer"
        )

    def as_dict(self) -> dict:
        """What `results.json` records under "input"."""
        mode = SHARDING[self.sharding].partition(":")[0]
        return {"where": "tf.data service", **dataclasses.asdict(self), "processing_mode": mode}


IN_PROCESS = {"where": "trainer", "line": "input: in the trainers' own processes (tf.data)"}


@dataclasses.dataclass(frozen=True)
class ServiceDataset(TrainStreamWrapper):
    """A source's `Dataset` whose training stream comes from the tf.data service.

    Evaluation reads in the trainer: one pass, exactly once (see the module docstring).

    Attributes:
      inner: the source's own `Dataset`, whose pipelines the data workers run.
      service: where, and how the workers share the stream.
      name: this run's name for dynamic jobs and the cross-trainer cache, the same
        on every trainer of a cluster.
    """

    service: Service
    name: str

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The source's training stream, made by the data workers (see the module docstring)."""
        source = self.inner.train_fn(global_batch_size, seed, start_step, start_batch)
        # Where the stream starts names its jobs: a step, or a batch of the stream.
        origin = start_step if start_batch is None else f"b{start_batch}"
        service, settings = self.service, self.settings  # the client's reader is a new pipeline
        if service.sharding == "dynamic":
            distribute = tf.data.experimental.service.distribute(
                "distributed_epoch", service.address, job_name=f"{self.name}-from-{origin}"
            )

            def one_stream(context: tf.distribute.InputContext) -> tf.data.Dataset:
                whole = tf.distribute.InputContext(1, 0, context.num_replicas_in_sync)
                return settings.apply(source(whole).apply(distribute))

            return one_stream
        cache = None
        if service.job:
            cache = tf.data.experimental.service.CrossTrainerCache(self.name.encode())

        def per_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
            # Trials resumed at another step make other batches: a stream of their own.
            job = f"{service.job}-{origin}-{context.input_pipeline_id}" if service.job else None
            return settings.apply(
                source(context).apply(
                    tf.data.experimental.service.distribute(
                        "parallel_epochs", service.address, job_name=job, cross_trainer_cache=cache
                    )
                )
            )

        return per_pipeline


def check(config: ml_collections.ConfigDict) -> None:
    """Checks `data.service`, `data.service_sharding` and `data.service_timeout_s`.

    Raises:
      UserError: a malformed address, a worker count below 1, an unknown sharding.
    """
    _parse(config.get("service", ""))
    sharding = config.get("service_sharding", "auto")
    if sharding not in SHARDING:
        raise UserError(
            f"Unknown `data.service_sharding` '{sharding}'; known: {', '.join(SHARDING)}."
        )
    timeout = config.get("service_timeout_s", TIMEOUT_S)
    if timeout <= 0:
        raise UserError(f"`data.service_timeout_s` ({timeout}) must be > 0 seconds; set e.g. 60.")


def _parse(text: str) -> tuple[str, int] | tuple[None, int] | None:
    """`(address, None)` for grpc://, `(None, N)` for local:N, None for ""."""
    if not text:
        return None
    local, remote = _LOCAL.match(text), _REMOTE.match(text)
    if local:
        workers = int(local.group(1))
        if workers < 1:
            raise UserError(
                f"`data.service` '{text}' starts {workers} data workers, and the service needs "
                "at least 1 to run the input; use e.g. `local:1`, or '' for input in the trainer."
            )
        return None, workers
    if remote and 0 < int(remote.group(2)) < 65536:
        return text, None
    raise UserError(
        f"`data.service` '{text}' is not a tf.data service address; use 'local:N' (N data "
        "workers beside the trainer), 'grpc://host:port' (a dispatcher), or '' (no service)."
    )


def sharding(config: ml_collections.ConfigDict, ordered_input: bool) -> str:
    """`data.service_sharding`, with `auto` resolved by whether steps take input in order."""
    chosen = config.get("service_sharding", "auto")
    if chosen == "auto":
        return "off" if ordered_input else "dynamic"
    return chosen


def run_name(model_dir: str) -> str:
    """A name every trainer of one run derives alike: from its `model_dir`."""
    digest = hashlib.sha1(os.path.abspath(model_dir).encode()).hexdigest()[:12]
    return f"towerflow-{digest}"


@contextlib.contextmanager
def started(
    config: ml_collections.ConfigDict, ordered_input: bool, say: Callable[[str], None]
) -> Iterator[Service | None]:
    """The service `config` (the `data` part) asks for, up and answering; None for none.

    `local:N` starts the dispatcher and the N workers here and stops them on the
    way out. Either way the dispatcher and a data worker must answer within
    `data.service_timeout_s`. While the block runs, a local server that stops,
    or a remote dispatcher silent for `data.service_timeout_s`, ends this process
    with one line and exit status 144, which schedulers retry (the run resumes
    from its checkpoint): TensorFlow's client would otherwise wait for it without
    end. Under `dynamic` sharding a lost local data worker of several is only
    reported: the others take over its work.

    Raises:
      UserError: a bad address or count, or nothing answers in time.
    """
    check(config)
    parsed = _parse(config.get("service", ""))
    if parsed is None:
        yield None
        return
    address, workers = parsed
    mode = sharding(config, ordered_input)
    if workers is not None:
        _check_count(config.service, workers, mode)
    timeout_s = config.get("service_timeout_s", TIMEOUT_S)
    with contextlib.ExitStack() as stack:
        local = None
        if workers is not None:
            # One import of TensorFlow for all N + 1 servers; the server ends after them.
            forks = stack.enter_context(contextlib.closing(forkserver.Client()))
            forks.enabled = True
            ports = processes.pick_ports(workers + 1)
            local = stack.enter_context(LocalService(ports, forks=forks))
            address = local.address
        counted = wait_until_served(address, local, timeout_s)
        answering = workers if local is not None else counted  # local ones may still register
        _check_count(config.service, answering, mode)
        job = config.get("service_job", "")
        service = Service(address, answering, local is not None, mode, job)
        stack.enter_context(_watched(service, local, say, timeout_s))
        yield service


def _check_count(text: str, workers: int, mode: str) -> None:
    """Refuses several data workers where each would send every batch (sharding off)."""
    if workers > 1 and mode == "off":
        raise UserError(
            f"`data.service` '{text}' has {workers} data workers, and with "
            "`data.service_sharding` 'off' each would run the whole pipeline and send every "
            "batch again; use one data worker per trainer, or "
            "`--config.data.service_sharding=dynamic`."
        )


class LocalService:
    """A dispatcher and N data workers as child processes on 127.0.0.1 (`local:N`)."""

    def __init__(
        self,
        ports: list[int],
        console: processes.Console | None = None,
        forks: forkserver.Client | None = None,
    ):
        """Plans the dispatcher on `ports[0]` and a worker on each other port of 127.0.0.1.

        `console` gets their output, prefixed; `forks` forks each (`processes.Group`).
        """
        self.address = f"grpc://{_LOOPBACK}:{ports[0]}"
        dispatcher = f"{_LOOPBACK}:{ports[0]}"
        module = [sys.executable, "-m", "trainer.data_service"]
        self.commands = {
            _DISPATCHER: [*module, "--role=dispatcher", f"--port={ports[0]}"],
            **{
                f"data:worker:{i}": [
                    *module,
                    "--role=worker",
                    f"--port={port}",
                    f"--dispatcher={dispatcher}",
                    f"--host={_LOOPBACK}",
                ]
                for i, port in enumerate(ports[1:])
            },
        }
        self.ports = dict(zip(self.commands, ports, strict=True))
        self._group = processes.Group(console, forks)
        self.procs = self._group.procs  # name -> process, once started

    def __enter__(self) -> LocalService:
        env = {**os.environ, "TF_CONFIG": ""}
        for name, command in self.commands.items():
            self._group.start(name, command, env)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to every server, SIGKILL to those still there after a few seconds."""
        self._group.stop(_STOP_S)

    def ended(self) -> list[tuple[str, int]]:
        """The servers that have exited, with their exit codes."""
        return self._group.ended()

    def describe(self, name: str) -> str:
        """E.g. "data:worker:1 (127.0.0.1:4242, pid 99)"."""
        return f"{name} ({_LOOPBACK}:{self.ports[name]}, pid {self.procs[name].pid})"


@contextlib.contextmanager
def serving_locally(
    workers: int,
    console: processes.Console | None = None,
    forks: forkserver.Client | None = None,
) -> Iterator[LocalService]:
    """A dispatcher and `workers` data workers on free ports of 127.0.0.1, answering.

    For the commands that start a service for their trainers (`trainer.launch
    --data_workers`, `trainer.sweep --share_input`); stopped on the way out.
    `forks` forks each server (`processes.Group`; the launcher forks them as it
    forks its members).

    Raises:
      UserError: a server exited, or none answered within `TIMEOUT_S`.
    """
    with LocalService(processes.pick_ports(workers + 1), console, forks) as servers:
        wait_until_served(servers.address, servers, TIMEOUT_S)
        yield servers


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("grpc://").rpartition(":")
    return host, int(port)


def _listens(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at `address`."""
    with contextlib.suppress(OSError), socket.create_connection(_host_port(address), timeout_s):
        return True
    return False


def wait_until_served(address: str, local: LocalService | None, timeout_s: float) -> int:
    """How many data workers sent a tiny dataset through the dispatcher at `address`.

    Each worker sends the whole of it (parallel epochs), so the count is the number
    of workers that answered. Raises UserError when none has after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    name = f"local:{len(local.procs) - 1}" if local else address
    while not _listens(address):
        if local is not None and local.ended():
            server, code = local.ended()[0]
            raise UserError(
                f"`data.service` '{name}': {local.describe(server)} exited with code {code} "
                "before serving; see its output above."
            )
        if time.monotonic() > deadline:
            raise UserError(
                f"`data.service` '{name}': nothing answers at {address} within "
                f"{timeout_s:g} s; start a dispatcher there (`python -m trainer.data_service "
                "--role=dispatcher --port=...`) or fix the address."
            )
        time.sleep(_POLL_S)
    came: list[object] = []

    def read_one() -> None:
        one = tf.data.Dataset.range(1).apply(
            tf.data.experimental.service.distribute("parallel_epochs", address)
        )
        came.extend(one)

    reader = threading.Thread(target=read_one, daemon=True)  # TF's client has no deadline
    reader.start()
    while reader.is_alive() and time.monotonic() < deadline:
        if local is not None and local.ended():
            break
        reader.join(_POLL_S)
    if not came:
        raise UserError(
            f"`data.service` '{name}': the dispatcher at {address} sent no data within "
            f"{timeout_s:g} s (not a tf.data dispatcher, or no data worker answers it); start "
            "workers (`python -m trainer.data_service --role=worker --dispatcher=...`) or raise "
            "`data.service_timeout_s`."
        )
    return len(came)


@contextlib.contextmanager
def _watched(
    service: Service, local: LocalService | None, say: Callable[[str], None], timeout_s: float
) -> Iterator[None]:
    """Ends the process (exit 144) when a server the input needs stops, while the block runs.

    A remote dispatcher may be gone for up to `timeout_s`: one restarted with its
    `--work_dir` in that time carries on with the jobs, and so does training.
    """
    done = threading.Event()
    reported: set[str] = set()

    def lost(what: str) -> None:
        if local is not None:
            local.stop()  # its servers run in process groups of their own
        print(
            f"error: {what}; training cannot read its input. Restart it (the scheduler's "
            "restart policy, or `python -m trainer.launch --restarts=N`) and the run resumes "
            "from its newest checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(errors.MEMBER_LOST_EXIT_CODE)  # the main thread waits in TF's client for ever

    def watch() -> None:
        silent_since = None
        while not done.wait(_POLL_S * 2):
            if local is not None:
                ended = dict(local.ended())
                workers = [n for n in local.procs if n != _DISPATCHER]
                for name in sorted(set(ended) - reported):
                    reported.add(name)
                    alive = [n for n in workers if n not in ended]
                    what = f"{local.describe(name)} exited with code {ended[name]}"
                    if name == _DISPATCHER or service.sharding != "dynamic" or not alive:
                        lost(what)
                    say(f"{what}; the other data workers ({len(alive)}) take over its work")
            elif _listens(service.address):
                silent_since = None
            else:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > timeout_s:
                    lost(
                        f"the tf.data dispatcher at {service.address} stopped answering for "
                        f"{timeout_s:g} s (`data.service_timeout_s`)"
                    )

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def wrap(dataset: Dataset, service: Service | None, model_dir: str) -> Dataset:
    """`dataset` with its training stream on `service` (unchanged for None)."""
    if service is None:
        return dataset
    return ServiceDataset(dataset, service, run_name(model_dir))


def describe(dataset: Dataset) -> dict:
    """Where `dataset`'s input runs, for the start-up line and `results.json`."""
    if isinstance(dataset, ServiceDataset):
        return {**dataset.service.as_dict(), "line": dataset.service.line()}
    return IN_PROCESS
