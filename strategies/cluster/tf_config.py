"""`TF_CONFIG`: the one description of a cluster, parsed and checked.

Every member of a cluster (one process of it) runs the same program with its
own `TF_CONFIG`, a JSON object that lists the whole cluster and names the
member itself in its `task` key (TensorFlow's word):

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 1}}

A scheduler sets it (a TFJob, Vertex AI), `python -m trainer.launch` writes it
for local clusters, `strategies.cluster.discovery` derives it from a Slurm step or a
JobSet pod, and `parse` turns it into a `ClusterSpec` or a one-line
`UserError` that says what is wrong and how to fix it. A member type's addresses may also be
given in TensorFlow's sparse form, `{"worker": {"0": "host:port", ...}}`, when it
lists every index. `start_up` waits, boundedly and
saying for whom, until the other members answer; `ClusterSpec.unreachable`
names the members whose server no longer replies; `wait_until_gone` lets a
server member (a ps, or a worker of a parameter-server cluster) see the chief end.

Glossary of member types (TensorFlow's task types; its `tf.train.ClusterSpec` calls
each a job):

* chief: the member that writes checkpoints, summaries and exports; worker 0
  when the cluster has no `chief` member. In a parameter-server cluster it is
  the coordinator that schedules work on the workers.
* worker: a member that computes steps.
* ps: a parameter server, which holds variables.
* evaluator: an optional member that evaluates checkpoints on the side. It is
  independent of training: it may be absent from `cluster` while its own
  `task.type` is "evaluator", and `ClusterSpec.as_dict` leaves it out. The
  chief leaves evaluation to it when `cluster` lists it (or when the config
  says one runs: `strategies.cluster.discovery`).

This module does not import TensorFlow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

from strategies.cluster.preemption import Preempted
from towerflow import renamed
from towerflow.errors import MemberLost, UserError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
DEFAULT_RPC_LAYER = "grpc"
_EXAMPLE = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
_EXAMPLE_TASK_KEY = '"task": {"type": "worker", "index": 0}'
_MISSING = object()
PROBE_S = 3.0  # how long a live member's server may take to reply to a probe
FIRST_PAUSE_S = 0.05  # the first pause between tries to reach a member; later ones grow
GONE_POLL_S = 0.25  # after a refusal, the next try to reach a chief whose server ran
PROXY_VARIABLES = (
    "grpc_proxy",
    "https_proxy",
    "http_proxy",
    "GRPC_PROXY",
    "HTTPS_PROXY",
    "HTTP_PROXY",
)
# The client's opening of an HTTP/2 connection: the preface and an empty SETTINGS frame.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A parsed, validated `TF_CONFIG`.

    Attributes:
      addresses: member type (`TF_CONFIG`'s task type) -> the addresses ("host:port") of
        its members, in index order.
      task_type: this member's task type; None when `TF_CONFIG` has no `task`.
      task_index: this process's index within `task_type`.
      rpc_layer: the protocol the members talk ("grpc").
    """

    addresses: dict[str, tuple[str, ...]]
    task_type: str | None = None
    task_index: int | None = None
    rpc_layer: str = DEFAULT_RPC_LAYER

    @property
    def jobs(self) -> dict[str, tuple[str, ...]]:
        """The old name of `addresses`, with a `DeprecationWarning` until towerflow 0.3."""
        renamed.warn("ClusterSpec.jobs", "ClusterSpec.addresses")
        return self.addresses

    @property
    def num_workers(self) -> int:
        """How many `worker` members the cluster has (the chief not counted)."""
        return len(self.addresses.get("worker", ()))

    @property
    def num_ps(self) -> int:
        """How many parameter servers the cluster has."""
        return len(self.addresses.get("ps", ()))

    @property
    def has_chief(self) -> bool:
        """Whether the cluster has a `chief` member."""
        return "chief" in self.addresses

    @property
    def has_evaluator(self) -> bool:
        """Whether the cluster lists an evaluator, or this member is one."""
        return "evaluator" in self.addresses or self.task_type == "evaluator"

    @property
    def is_chief(self) -> bool:
        """Whether this member is the chief: the `chief` member, or worker 0 when there is none."""
        if self.task_type == "chief":
            return True
        return not self.has_chief and self.task_type == "worker" and self.task_index == 0

    @property
    def member_name(self) -> str:
        """This member as errors name it: "chief", "worker:1", "ps:0"."""
        return _member_name(self.task_type or "", self.task_index or 0)

    @property
    def address(self) -> str | None:
        """This member's "host:port"; None for an evaluator absent from `cluster`."""
        addresses = self.addresses.get(self.task_type or "", ())
        return addresses[self.task_index] if addresses else None

    def as_dict(self) -> dict[str, list[str]]:
        """The training cluster, as `tf.train.ClusterSpec` takes it.

        The evaluator is left out: TensorFlow keeps it independent of training,
        and a coordinator that saw it would wait to connect to a server the
        evaluator never starts.
        """
        return {
            member_type: list(addresses)
            for member_type, addresses in self.addresses.items()
            if member_type != "evaluator"
        }

    def peers(self) -> list[tuple[str, str]]:
        """The other members of the training cluster, as ("worker:1", "host:port") pairs."""
        return [
            (_member_name(member_type, index), address)
            for member_type, addresses in self.as_dict().items()
            for index, address in enumerate(addresses)
            if (member_type, index) != (self.task_type, self.task_index)
        ]

    def unreachable(self, timeout_s: float = PROBE_S) -> list[str]:
        """The other members of the training cluster whose server does not answer now.

        Each as "worker:1 (host:port)". A member answers when its gRPC server
        replies to the opening of an HTTP/2 connection within `timeout_s`: a
        process that is gone refuses at once, and one that is hung (stopped,
        or its host lost) accepts the connection but never replies.
        """
        return [
            f"{name} ({address})"
            for name, address in self.peers()
            if not _serves(address, timeout_s)
        ]


def parse(text: str | None) -> ClusterSpec | None:
    """Parses and validates a `TF_CONFIG` value.

    Args:
      text: the JSON text of `TF_CONFIG`; None or blank means no cluster.

    Returns:
      The cluster, or None when `text` is None or blank (a single process).

    Raises:
      UserError: `text` is malformed; the message says what is wrong and how to fix it.
    """
    if text is None or not text.strip():
        return None
    config = _load(text)
    if "sparseCluster" in config and "cluster" not in config:
        raise UserError(
            "`TF_CONFIG` has a `sparseCluster` (a TFJob with `enableDynamicWorker` writes one) "
            "and no `cluster`; every towerflow member needs every member's address: set "
            "`enableDynamicWorker: false` in the TFJob."
        )
    by_type = _parse_cluster(config.get("cluster"), "cluster" in config)
    task_type, task_index = _parse_task_key(config.get("task"), "task" in config, by_type)
    rpc_layer = config.get("rpc_layer") or DEFAULT_RPC_LAYER
    if not isinstance(rpc_layer, str):
        raise UserError(
            f'`TF_CONFIG` `rpc_layer` must be a string such as "grpc", not {_show(rpc_layer)}; '
            "fix it or leave it out."
        )
    return ClusterSpec(by_type, task_type, task_index, rpc_layer)


def from_env(environ: Mapping[str, str] = os.environ) -> ClusterSpec | None:
    """The cluster described by the `TF_CONFIG` environment variable; None when it is unset."""
    return parse(environ.get("TF_CONFIG"))


def make_tf_config(by_type: Mapping[str, list[str]], task_type: str, task_index: int) -> str:
    """The `TF_CONFIG` JSON for one member of a cluster, checked with `parse`.

    Args:
      by_type: member type (task type) -> addresses ("host:port"), in index order.
      task_type: the member's type (one of `TASK_TYPES`).
      task_index: the member's index within `task_type`.

    Raises:
      UserError: the result would not be a valid `TF_CONFIG`.
    """
    text = json.dumps(
        {
            "cluster": {member_type: list(addresses) for member_type, addresses in by_type.items()},
            "task": {"type": task_type, "index": task_index},
        }
    )
    parse(text)
    return text


def wait_until_gone(
    address: str, startup_s: float = 600.0, interval_s: float = 1.0, misses: int = 3
) -> bool:
    """Blocks while the member at `address` ("host:port") runs; how a server learns the job ended.

    Tries a TCP connection, first until the member answers (for at most
    `startup_s`; the pauses between tries grow from `FIRST_PAUSE_S` to
    `interval_s`), then, a try every `interval_s`, until it is gone: `misses`
    tries in a row without an answer, or, once its gRPC server has replied, two
    refused connections in a row, the second `GONE_POLL_S` after the first. A
    server lasts as long as its process, so a refusal then means the process
    ended; before, the port may be held by `start_up` and free for a moment
    while TensorFlow takes it over. Each member tries once a second: a chief
    with many members is not asked more often than that by each.

    Returns:
      True when the member came up and is gone; False when it never came up.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + startup_s
    pauses = _growing_pauses(interval_s)
    while _reach(host, int(port), interval_s) != "answers":
        if time.monotonic() >= deadline:
            return False
        time.sleep(next(pauses))
    served, refused, failed = False, 0, 0
    while failed < misses and not (served and refused >= 2):
        time.sleep(GONE_POLL_S if served and refused else interval_s)
        if not served and _serves(address, interval_s):
            served, failed, refused = True, 0, 0
            continue
        reach = _reach(host, int(port), interval_s)
        failed = 0 if reach == "answers" else failed + 1
        refused = refused + 1 if reach == "refused" else 0
    return True


def _growing_pauses(longest_s: float) -> Iterator[float]:
    """Pauses between tries: `FIRST_PAUSE_S`, doubling up to `longest_s`.

    A member a moment late is seen a moment later, and one that takes minutes
    (a scheduler placing it) is not asked more than once every `longest_s`.
    """
    pause = min(FIRST_PAUSE_S, longest_s)
    while True:
        yield pause
        pause = min(2 * pause, longest_s)


def _no_answer(name: str, address: str, timeout_s: float, setting: str) -> MemberLost:
    """The one line for a member that did not answer at `address` in time."""
    host = address.rpartition(":")[0]
    return MemberLost(
        f"{name} at {address} did not answer within {timeout_s:g} s; check that it "
        f"runs with the same `TF_CONFIG` cluster, that `{host}` resolves here (DNS) "
        f"to its machine, that its port is open to this host, and that no "
        f"`http_proxy`/`grpc_proxy` applies; `{setting}` sets this wait."
    )


def start_up(
    spec: ClusterSpec,
    timeout_s: float,
    setting: str,
    report: Callable[[str], None] = print,
    interval_s: float = 1.0,
) -> None:
    """Prepares this member to join `spec` and waits until the other members answer.

    Call it before TensorFlow starts its server: TensorFlow's own wait for
    the cluster lasts an hour, prints nothing and cannot be interrupted.
    Here, cluster traffic is kept off proxies (`keep_off_proxies`), each member
    missing is named once ("waiting for worker:1 at host1:2222"), SIGTERM
    stops the wait at once (exit 143), and after `timeout_s` seconds the
    first member still missing is named in a `MemberLost` with what to check.
    Meanwhile this member's own port is held open, so that its peers, waiting
    the same way, see it before its server starts.

    Args:
      spec: the cluster, naming this member.
      timeout_s: how long to wait for the others, in seconds (> 0).
      setting: the config field that sets `timeout_s`, named in the error.
      report: prints one line for the user.
      interval_s: the longest pause between tries (they grow to it from `FIRST_PAUSE_S`).

    Raises:
      UserError: `timeout_s` is not a positive number, this member's own host does
        not resolve (TensorFlow would wait for itself for good), or its port is taken.
      MemberLost: a member did not answer within `timeout_s`.
      Preempted: SIGTERM arrived while waiting.
    """
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(
            f"`{setting}` ({timeout_s}) must be a positive number of seconds; e.g. 120."
        )
    check_own_host(spec)
    for warning in (_not_this_machine(spec), keep_off_proxies(spec)):
        if warning:
            report(warning)
    deadline = time.monotonic() + timeout_s
    pauses = _growing_pauses(interval_s)
    with _own_port_held(spec), _sigterm_stops_start_up(report):
        missing = dict(spec.peers())
        said: set[str] = set()
        while missing:
            for name, address in list(missing.items()):
                problem = _connect_problem(address, interval_s)
                if problem is None:
                    del missing[name]
                elif name not in said:
                    said.add(name)
                    report(f"waiting for {name} at {address}{problem}")
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise _no_answer(*next(iter(missing.items())), timeout_s, setting)
            time.sleep(next(pauses))


def check_own_host(spec: ClusterSpec) -> None:
    """Raises a one-line `UserError` when this member's own host does not resolve here.

    TensorFlow's server and its coordination service then wait for this very
    member for good: such a config can never work, whatever the wait.
    """
    if spec.address is None:  # an evaluator outside `cluster` has no address
        return
    host, _, port = spec.address.rpartition(":")
    problem = _resolve_problem(host, int(port))
    if problem:
        raise UserError(
            f"`TF_CONFIG` gives this member ({spec.member_name}) the address "
            f"{_show(spec.address)}, but its host does not resolve here ({problem}); give "
            "each member the name or address of its own machine (e.g. `hostname -f`)."
        )


def _not_this_machine(spec: ClusterSpec) -> str | None:
    """A warning when this member's own host resolves to no address of this machine.

    TensorFlow then waits for this member at another machine, until the start-up
    bound ends it; behind a NAT (a service address) it may still work.
    """
    if spec.address is None:
        return None
    host, _, port = spec.address.rpartition(":")
    found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    for family, kind, _, _, address in found:
        with contextlib.suppress(OSError), socket.socket(family, kind) as probe:
            probe.bind((address[0], 0))
            return None
    return (
        f"warning: this member's host `{host}` ({found[0][4][0]}) is no address of this machine; "
        "TensorFlow will wait for this member there, and this start-up ends at its bound."
    )


def keep_off_proxies(
    spec: ClusterSpec, environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Keeps the cluster's traffic off any proxy the environment names; a warning if there is one.

    gRPC sends connections through `grpc_proxy`, `https_proxy` or `http_proxy`
    when one is set, and a proxy seldom reaches the cluster's ports. The
    cluster's hosts are added to `no_grpc_proxy` and `no_proxy` (in
    `environ`, before gRPC starts), which gRPC honours.

    Returns:
      One line naming the proxy variables set, or None when none is.
    """
    proxies = [name for name in PROXY_VARIABLES if environ.get(name)]
    if not proxies:
        return None
    hosts = sorted(
        {
            address.rpartition(":")[0]
            for addresses in spec.as_dict().values()
            for address in addresses
        }
    )
    for name in ("no_grpc_proxy", "no_proxy"):
        present = [h for h in environ.get(name, "").split(",") if h.strip()]
        environ[name] = ",".join(present + [h for h in hosts if h not in present])
    return (
        f"warning: {', '.join(f'`{name}`' for name in proxies)} set; the cluster's hosts "
        f"({', '.join(hosts)}) were added to `no_proxy` and `no_grpc_proxy`, so its traffic "
        "goes direct."
    )


@contextlib.contextmanager
def _own_port_held(spec: ClusterSpec) -> Iterator[None]:
    """Listens on this member's port while it waits, so waiting peers see it.

    Connections are never accepted: closing the socket resets them, leaving
    nothing behind that would stop TensorFlow's server binding the port next.
    """
    if spec.address is None:  # an evaluator outside `cluster` has no port
        yield
        return
    port = int(spec.address.rpartition(":")[2])
    dualstack = socket.has_dualstack_ipv6()  # TensorFlow's server listens on every address too
    try:
        listener = socket.create_server(
            ("", port),
            family=socket.AF_INET6 if dualstack else socket.AF_INET,
            backlog=64,
            dualstack_ipv6=dualstack,
        )
    except OSError as e:
        raise UserError(
            f"`TF_CONFIG` gives this member ({spec.member_name}) the address {spec.address}, but "
            f"port {port} cannot be used here ({e.strerror}); stop what holds it, or give the "
            "member a free port."
        ) from None
    try:
        yield
    finally:
        listener.close()


@contextlib.contextmanager
def _sigterm_stops_start_up(report: Callable[[str], None]) -> Iterator[None]:
    """SIGTERM while waiting: one line, then `Preempted` (exit 143); there is nothing to save."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        report("SIGTERM while waiting for the cluster to start: stopping (nothing to save yet)")
        raise Preempted("SIGTERM during start-up")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _connect_problem(address: str, timeout_s: float) -> str | None:
    """None when `address` accepts a TCP connection; else what the user is told while waiting."""
    host, _, port = address.rpartition(":")
    if _resolve_problem(host, int(port)):
        shown = host if len(host) <= 60 else host[:57] + "..."
        return f" (`{shown}` does not resolve here: check its name and DNS)"
    return None if _reach(host, int(port), timeout_s) == "answers" else ""


def _resolve_problem(host: str, port: int) -> str | None:
    """None when `host` resolves; else why not (a name too long never resolves)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return e.strerror
    except UnicodeError:  # a label longer than 63 characters, refused before any lookup
        return "a part of the name is longer than 63 characters"
    return None


def _serves(address: str, timeout_s: float) -> bool:
    """Whether a gRPC (HTTP/2) server at `address` replies within `timeout_s`.

    An HTTP/2 server sends its SETTINGS frame as soon as a client opens the
    connection; the kernel alone, accepting for a stopped process, sends nothing.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
            connection.sendall(_HTTP2_PREFACE)
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            return bool(connection.recv(9))
    except OSError:
        return False


def _reach(host: str, port: int, timeout_s: float) -> str:
    """Whether a TCP connection to `host:port` opens within `timeout_s`.

    "answers": it opens (a server, a port held open, or a stopped process's
    kernel); "refused": nothing listens there; "silent": no answer in time (a
    lost host, a network that drops the traffic) or another error.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "answers"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def _load(text: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"`TF_CONFIG` is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            f"set it to a JSON object such as {_EXAMPLE}."
        ) from None
    if not isinstance(config, dict):
        raise UserError(
            f"`TF_CONFIG` must be a JSON object, not {_show(config)}; "
            f"set it to one such as {_EXAMPLE}."
        )
    return config


def _parse_cluster(cluster: Any, present: bool) -> dict[str, tuple[str, ...]]:
    if not present:
        raise UserError(f"`TF_CONFIG` has no `cluster`; add one, as in {_EXAMPLE}.")
    if not isinstance(cluster, dict) or not cluster:
        problem = "is empty" if cluster == {} else f"must be a JSON object, not {_show(cluster)}"
        raise UserError(
            f"`TF_CONFIG` `cluster` {problem}; map task types to address lists, "
            'as in {"worker": ["host:port", ...]}.'
        )
    by_type = {
        member_type: _parse_addresses(member_type, addresses)
        for member_type, addresses in cluster.items()
    }
    _check_unique(by_type)
    for member_type in ("chief", "evaluator"):
        if len(by_type.get(member_type, ())) > 1:
            raise UserError(
                f"`TF_CONFIG` `cluster.{member_type}` has {len(by_type[member_type])} addresses, "
                f"but a cluster has at most one {member_type}; keep one and move or remove the "
                "others."
            )
    if "ps" in by_type and "worker" not in by_type:
        raise UserError(
            "`TF_CONFIG` `cluster` has `ps` members but no `worker`; add `worker` addresses "
            "(parameter servers only hold variables, workers compute)."
        )
    return by_type


def _parse_addresses(member_type: str, addresses: Any) -> tuple[str, ...]:
    if member_type not in TASK_TYPES:
        raise UserError(
            f"`TF_CONFIG` `cluster` has unknown task type {_show(member_type)}; "
            f"use only {_names(TASK_TYPES)}."
        )
    if isinstance(addresses, dict):
        addresses = _dense(member_type, addresses)
    if (
        not isinstance(addresses, list)
        or not addresses
        or not all(isinstance(a, str) for a in addresses)
    ):
        raise UserError(
            f'`TF_CONFIG` `cluster.{member_type}` must be a non-empty list of "host:port" strings, '
            f"not {_show(addresses)}."
        )
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UserError(
                f"`TF_CONFIG` `cluster.{member_type}` address {_show(address)} is not host:port "
                'with a port from 1 to 65535; write it as "10.0.0.1:2222".'
            )
    return tuple(addresses)


def _dense(member_type: str, members: dict[str, Any]) -> list[Any]:
    """A member type's addresses in TensorFlow's sparse form, {"1": "host:port"}, as a list.

    Every index must be there.

    A sparse cluster (a TFJob with `enableDynamicWorker` gives each worker only
    itself) cannot run here: the chief schedules on every worker, the workers
    of `multi_worker` all-reduce with every other, and a server watches the chief.
    """
    if not all(isinstance(key, str) and key.isdigit() for key in members):
        raise UserError(
            f"`TF_CONFIG` `cluster.{member_type}` is an object with keys {_show(list(members))}; "
            'as an object it maps indices to addresses, as in {"0": "host:2222"}; or give a list.'
        )
    by_index = {int(key): address for key, address in members.items()}
    if sorted(by_index) != list(range(len(by_index))):
        raise UserError(
            f"`TF_CONFIG` `cluster.{member_type}` lists only index(es) "
            f"{_show(sorted(by_index))} (a sparse cluster, as a TFJob with `enableDynamicWorker` "
            "writes); every towerflow member needs every member's address: list them all "
            "(`enableDynamicWorker: false`)."
        )
    return [by_index[index] for index in range(len(by_index))]


def _check_unique(by_type: dict[str, tuple[str, ...]]) -> None:
    seen: dict[str, str] = {}
    for member_type, addresses in by_type.items():
        for index, address in enumerate(addresses):
            member = f"{member_type}:{index}"
            if address in seen:
                raise UserError(
                    f"`TF_CONFIG` `cluster` gives {_show(address)} to both {seen[address]} "
                    f"and {member}; give every member its own host:port."
                )
            seen[address] = member


def _parse_task_key(
    entry: Any, present: bool, by_type: dict[str, tuple[str, ...]]
) -> tuple[str, int]:
    """`TF_CONFIG`'s `task` key (`entry`; `present`: whether it is there) as (type, index)."""
    if not present:
        if sum(len(addresses) for addresses in by_type.values()) > 1:
            raise UserError(
                f"`TF_CONFIG` has no `task`, but its cluster has more than one member; "
                f"name this member, as in {_EXAMPLE_TASK_KEY}."
            )
        (only,) = by_type  # a one-member cluster: that member is this process
        return only, 0
    if not isinstance(entry, dict):
        raise UserError(
            f"`TF_CONFIG` `task` must be a JSON object, not {_show(entry)}; "
            f"write it as {_EXAMPLE_TASK_KEY}."
        )
    task_type = entry.get("type", _MISSING)
    if task_type not in TASK_TYPES:
        raise UserError(
            f"`TF_CONFIG` `task.type` is {_show(task_type)}, not a known task type; "
            f"use one of {_names(TASK_TYPES)}."
        )
    if task_type not in by_type and task_type != "evaluator":
        raise UserError(
            f"`TF_CONFIG` `task.type` is {_show(task_type)} but `cluster` has no such members; "
            f"use one of {_names(by_type)}, or add `{task_type}` addresses to `cluster`."
        )
    count = len(by_type.get(task_type, ())) or 1  # an evaluator outside `cluster` is one member
    index = entry.get("index", 0 if count == 1 else _MISSING)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise UserError(
            f"`TF_CONFIG` `task.index` is {_show(index)}, but `{task_type}` has {count} "
            f"member{'s' if count > 1 else ''}; use an integer from 0 to {count - 1}."
        )
    return task_type, index


def _member_name(member_type: str, index: int) -> str:
    return member_type if member_type == "chief" else f"{member_type}:{index}"


def _names(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON, shortened to keep error messages on one line."""
    text = "missing" if value is _MISSING else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
