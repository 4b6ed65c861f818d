"""`python -m trainer.data_service`: one server of TensorFlow's tf.data service.

    python -m trainer.data_service --role=dispatcher --port=5050 [--work_dir=/shared/dispatcher]
    python -m trainer.data_service --role=worker --port=5051 --dispatcher=host0:5050

Trainers started with `--config.data.service=grpc://host0:5050` then run their
input pipelines on the workers (see `trainer.data.service_client`). Without flags, which
server runs (`--role`), the port, the dispatcher and a worker's host come from the
cluster, found as the trainer finds its own (`--cluster`, `strategies.cluster.discovery`),
with `dispatcher` and `data_worker` members (or `data-worker`: Kubernetes names cannot
hold `_`):

- `tf_config`: `TF_CONFIG`, e.g.

      {"cluster": {"dispatcher": ["host0:5050"], "data_worker": ["host1:5051", "host2:5051"]},
       "task": {"type": "data_worker", "index": 0}}

- `slurm`: a Slurm step (`srun -n3 python -m trainer.data_service --cluster=slurm`):
  rank 0 is the dispatcher, the others data workers, at the addresses the
  trainer's Slurm tasks get (`strategies.cluster.slurm`: the node, and `--port` plus the
  task's index on its node; default port 5050);
- `jobset`: a JobSet pod (deploy/jobset-data-service.yaml): the replicated jobs
  `dispatcher` and `data-worker`, pod i at `<jobset>-<job>-0-<i>.<jobset>`, every
  pod on `--port` (default 5050);
- `local`: the flags alone (a `TF_CONFIG` is ignored);
- `auto` (the default): `TF_CONFIG` when set, else a Slurm step of several
  tasks, else a JobSet pod, else the flags alone; with `--role` given,
  `TF_CONFIG` or the flags alone (the servers `local:N` starts beside a
  trainer in a Slurm step or a JobSet pod are not that cluster's).

Flags given win over what the cluster says.

A dispatcher with `--work_dir` journals its state there; started again with the
same directory, it carries on with the tf.data service jobs it had (TensorFlow's
fault-tolerant mode). The server runs until the process is stopped (SIGTERM or SIGINT).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ chatter quiet

from absl import app, flags  # noqa: E402

from strategies.cluster import discovery  # noqa: E402
from towerflow import errors, processes, renamed  # noqa: E402
from towerflow.errors import UserError  # noqa: E402
from trainer import cli  # noqa: E402

SERVERS = ("dispatcher", "worker")  # `--role`: which of the service's two servers runs
MEMBER_TYPES = {"dispatcher": "dispatcher", "worker": "data_worker"}  # server -> `TF_CONFIG`'s
ALIASES = {"data-worker": "data_worker"}  # a JobSet's replicated job (no `_` in Kubernetes)
SOURCES = ("auto", "tf_config", "slurm", "jobset", "local")  # `--cluster`
DEFAULT_PORT = 5050  # every server's port in a Slurm step or a JobSet without `--port`
HEARTBEAT_MS = 1_000  # a worker's heartbeat to the dispatcher
WORKER_TIMEOUT_MS = 5_000  # a worker silent this long is dropped; its clients read the others
DISPATCHER_TIMEOUT_MS = 60_000  # a worker gives up on a dispatcher that never answers

_SERVER = flags.DEFINE_enum("role", None, SERVERS, "Which server to run; default from `TF_CONFIG`.")
_PORT = flags.DEFINE_integer("port", None, "Port to serve on; default from `TF_CONFIG`.")
_DISPATCHER = flags.DEFINE_string(
    "dispatcher", None, "worker: the dispatcher's host:port; default from `TF_CONFIG`."
)
_WORK_DIR = flags.DEFINE_string(
    "work_dir",
    "",
    "dispatcher: a directory for its journal, so a restart recovers its tf.data service jobs.",
)
_HOST = flags.DEFINE_string(
    "host",
    None,
    "worker: the host name trainers reach this worker at; default its address in the "
    "cluster, else localhost.",
)
_CLUSTER = flags.DEFINE_enum(
    "cluster",
    "auto",
    list(SOURCES),
    "Where the dispatcher and data workers come from (auto: TF_CONFIG, else a Slurm step "
    "of several tasks, else a JobSet pod, else the flags alone).",
)


@dataclasses.dataclass(frozen=True)
class Server:
    """What one process serves: which server (`kind`), its port and (a worker) its dispatcher."""

    kind: str  # "dispatcher" or "worker" (`--role`)
    port: int
    dispatcher: str = ""  # "host:port"
    work_dir: str = ""
    host: str = "localhost"

    @property
    def role(self) -> str:
        """The old name of `kind`, with a `DeprecationWarning` until towerflow 0.3."""
        renamed.warn("Server.role", "Server.kind")
        return self.kind


def plan(
    kind: str | None,
    port: int | None,
    dispatcher: str | None,
    work_dir: str = "",
    host: str | None = None,
    tf_config: str | None = None,
) -> Server:
    """The server to run: from the flags, with what they leave out taken from `TF_CONFIG`.

    Raises:
      UserError: no `--role`, no port, or a worker without a dispatcher, saying which flag to
        give.
    """
    by_type, own_type, own_index = _tf_config(tf_config)
    if host is None and own_type == MEMBER_TYPES["worker"] and kind in (None, "worker"):
        host = by_type[own_type][own_index].rpartition(":")[0]
    if kind is None:
        kind = {member_type: k for k, member_type in MEMBER_TYPES.items()}.get(own_type)
    if kind is None:
        raise UserError(
            "`--role` is not given and `TF_CONFIG` names no `dispatcher` or `data_worker` member; "
            "pass `--role=dispatcher` or `--role=worker`."
        )
    if port is None and own_type == MEMBER_TYPES[kind]:
        port = int(by_type[own_type][own_index].rpartition(":")[2])
    if port is None or not 0 < port < 65536:
        raise UserError(f"`--port` ({port}) must be a port number, 1-65535; pass one.")
    if kind == "worker":
        if dispatcher is None and by_type.get("dispatcher"):
            dispatcher = by_type["dispatcher"][0]
        if not dispatcher or ":" not in dispatcher:
            raise UserError(
                f"`--dispatcher` ({dispatcher!r}) must be the dispatcher's host:port; "
                "pass e.g. `--dispatcher=host0:5050`, or a `dispatcher` member in `TF_CONFIG`."
            )
        dispatcher = dispatcher.removeprefix("grpc://")
    return Server(kind, port, dispatcher or "", work_dir, host or "localhost")


def server(
    source: str,
    kind: str | None,
    port: int | None,
    dispatcher: str | None,
    work_dir: str = "",
    host: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Server:
    """The server to run: `plan` of the flags and the cluster `discover` finds.

    With `--role` given, `auto` reads only `TF_CONFIG` (as before `--cluster`
    existed): the servers `local:N` starts beside a trainer in a Slurm step or
    a JobSet pod are not that cluster's. In a Slurm step or a JobSet, `--port`
    is the cluster's port (a Slurm node's first), and each server's own port
    is its address in the cluster.

    Raises:
      UserError: as `plan` and `discover`.
    """
    if source == "auto" and kind is not None:
        source = "tf_config" if environ.get("TF_CONFIG", "").strip() else "local"
    found = discover(source, port, environ)
    if found.source in ("slurm", "jobset"):
        port = None
    return plan(kind, port, dispatcher, work_dir, host, found.tf_config)


def discover(
    source: str, port: int | None, environ: Mapping[str, str] = os.environ
) -> discovery.Found:
    """The data service's cluster from `source` (`--cluster`), as `TF_CONFIG` JSON.

    Args:
      source: one of `SOURCES`; `auto` picks as the trainer's discovery does.
      port: `--port`: every server's port in a JobSet, the first on each node
        of a Slurm step; None for `DEFAULT_PORT`.
      environ: the process's environment.

    Returns:
      The source found and the cluster (`tf_config` None for `local`: the flags alone).

    Raises:
      UserError: the source's environment is missing or describes no data service.
    """
    if source == "auto":
        source = discovery.detect(environ)
        source = source if source in SOURCES else "local"  # SageMaker runs no data service
    port = DEFAULT_PORT if port is None else port
    if source == "local":
        return discovery.Found("local", None)
    if source == "tf_config":
        if not environ.get("TF_CONFIG", "").strip():
            raise UserError(
                "`--cluster=tf_config`, but `TF_CONFIG` is not set (or blank); set it to the "
                "data service's cluster, or pass `--role`, `--port` and `--dispatcher`."
            )
        return discovery.Found("tf_config", environ["TF_CONFIG"])
    if source == "jobset":
        for warning in discovery.renamed_variable_warnings(environ):
            print(warning, file=sys.stderr, flush=True)
        hosts, own_type, index = discovery.jobset_pods(
            environ, ("dispatcher", *MEMBER_TYPES.values(), *ALIASES)
        )
        by_type = {t: [f"{host}:{port}" for host in names] for t, names in hosts.items()}
    else:
        from strategies.cluster import slurm  # only a Slurm task needs it

        addresses, rank = slurm.step_addresses(environ, port)
        if len(addresses) < 2:
            raise UserError(
                f"a Slurm step of {len(addresses)} task runs no data service: task 0 is the "
                "dispatcher and the others data workers; ask for 2 or more (`srun -n3`)."
            )
        by_type = {"dispatcher": addresses[:1], "data_worker": addresses[1:]}
        own_type, index = ("dispatcher", 0) if rank == 0 else ("data_worker", rank - 1)
    text = json.dumps({"cluster": by_type, "task": {"type": own_type, "index": index}})
    return discovery.Found(source, text)


def _tf_config(text: str | None) -> tuple[dict[str, list[str]], str, int]:
    """`TF_CONFIG`'s members by type, and this one's type and index ("" and 0 when none)."""
    if not text:
        return {}, "", 0
    try:
        loaded = json.loads(text)
        by_type = {
            ALIASES.get(member_type, member_type): list(addresses)
            for member_type, addresses in loaded.get("cluster", {}).items()
        }
        own = loaded.get("task", {})
        own_type, own_index = own.get("type", ""), int(own.get("index", 0))
        own_type = ALIASES.get(own_type, own_type)
        if own_type in MEMBER_TYPES.values():
            int(by_type[own_type][own_index].rpartition(":")[2])  # its own address has a port
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise UserError(
            f"`TF_CONFIG` is not a cluster with `dispatcher` and `data_worker` members ({e}); "
            'write it as {"cluster": {"dispatcher": ["host:port"], "data_worker": [...]}, '
            '"task": {"type": "data_worker", "index": 0}}.'
        ) from None
    return by_type, own_type, own_index


def serve(server: Server, stop: threading.Event) -> None:
    """Runs `server` until `stop` is set; says where it serves."""
    with processes.native_stderr_silenced():  # TensorFlow's C++ start-up chatter
        import tensorflow as tf

    service = tf.data.experimental.service
    if server.kind == "dispatcher":
        config = service.DispatcherConfig(
            port=server.port,
            work_dir=server.work_dir or None,
            fault_tolerant_mode=bool(server.work_dir),
            worker_timeout_ms=WORKER_TIMEOUT_MS,
        )
        running = service.DispatchServer(config)
        journal = f", journal in {server.work_dir}" if server.work_dir else ""
        print(f"dispatcher serving at {running.target}{journal} (pid {os.getpid()})", flush=True)
    else:
        config = service.WorkerConfig(
            dispatcher_address=server.dispatcher,
            worker_address=f"{server.host}:%port%",
            port=server.port,
            heartbeat_interval_ms=HEARTBEAT_MS,
            dispatcher_timeout_ms=DISPATCHER_TIMEOUT_MS,
        )
        running = service.WorkerServer(config)
        print(
            f"data worker serving at {server.host}:{server.port} for the dispatcher at "
            f"{server.dispatcher} (pid {os.getpid()})",
            flush=True,
        )
    stop.wait()
    running.stop()


def main(argv: list[str]) -> None:
    del argv
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        planned = server(
            _CLUSTER.value,
            _SERVER.value,
            _PORT.value,
            _DISPATCHER.value,
            _WORK_DIR.value,
            _HOST.value,
        )
    except UserError as e:
        cli.fail(errors.one_line(e))
    serve(planned, stop)


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
