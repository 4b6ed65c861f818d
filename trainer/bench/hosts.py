"""Simulated hosts on one machine: a network namespace per host, joined by a bridge.

The multi-host tests (`tests/test_multihost.py`) and the `multi_host`
benchmark case run a cluster's members as on separate machines, each in a
network namespace of its own with a real address (10.77.0.1, 10.77.0.2, ...)
that exists only inside these namespaces: no loopback shortcut between members,
and nothing reaches or touches the machine's own interfaces. The bridge that
joins the hosts lives in a namespace of its own too, one port per host, so a
host's link can be shaped (`Hosts.shape`: a rate limit, delay, loss) or cut
(`Hosts.set_link`) on its own.

`Hosts(count, names)` makes the hosts, `Hosts.cluster` lays a cluster's members
out on them (`HostedMember`s, each with its `TF_CONFIG`), and `Hosts.start_trainer`
runs one.
A member runs the per-host command of docs/beyond-one-machine.md, `TF_CONFIG=...
python -m trainer ...`, through `ip netns exec` (optionally pinned to one core
with `taskset`, to stand for a host of its own). Names resolve through an
/etc/hosts-style file that `ip netns exec` mounts over /etc/hosts.

It lives in the package, not in `tests/`, because the benchmark uses it too.

Everything is torn down on the way out of the `with` (and by a finaliser,
should the object be dropped or the interpreter exit first): every process in
a host's namespace is killed, descendants included (a namespace lists all its
processes, whatever session they started), then the namespaces are deleted.
Names carry the owner's pid, so parallel runs do not clash, and namespaces
left by a run that was killed (its pid gone) are removed when the next starts.
Needs root and iproute2 (`ip`, `tc`); `available()` says why not otherwise.
Loss without `sch_netem` needs `iptables`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence

from strategies.cluster import tf_config as cluster
from towerflow import renamed
from trainer.bench import links
from trainer.bench.links import PREFIX, Unavailable, available

SUBNET = "10.77.0"  # hosts are SUBNET.1, SUBNET.2, ...: addresses that exist only in here
PORT = 2222  # every member listens on this port of its own host, as on real machines
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
_TEARDOWN_S = 30.0  # how long killed processes may take to leave a namespace
_serial = itertools.count()


@dataclasses.dataclass(frozen=True)
class HostedMember:
    """One member of a cluster laid out on a simulated host (a `TF_CONFIG` entry).

    `trainer.launch`'s `Member` is a member on 127.0.0.1 with its address; this
    one names the host it runs on instead.

    Attributes:
      type: its member type, TensorFlow's task type ("chief", "worker", "ps").
      index: its index within `type`.
      host: the host (index into `Hosts`) it runs on.
      tf_config: its `TF_CONFIG`.
    """

    type: str
    index: int
    host: int
    tf_config: str

    @property
    def name(self) -> str:
        """The member as towerflow's messages name it: "chief", "worker:1"."""
        return self.type if self.type == "chief" else f"{self.type}:{self.index}"


class Hosts(links.Links):
    """`count` simulated hosts on a bridge; a context manager that tears all down on exit.

    Args:
      count: how many hosts (1 to 250).
      names: optional host names, one per host, resolvable on every host.

    Raises:
      Unavailable: on entry, when namespaces cannot be made here (`available()`).
    """

    def __init__(self, count: int, names: Sequence[str] | None = None):
        if not 1 <= count <= 250:
            raise ValueError(f"`count` ({count}) must be from 1 to 250 hosts")
        if names is not None and len(names) != count:
            raise ValueError(f"{len(names)} `names` for {count} hosts; give one per host")
        self.count = count
        self.names = list(names) if names else None
        stem = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.bridge = f"{stem}-bridge"
        self.namespaces = [f"{stem}-h{i}" for i in range(count)]
        self._procs: list[subprocess.Popen] = []
        self._drops: dict[int, list[tuple[str, list[str]]]] = {}  # host -> its iptables rules
        # Runs on `close`, when the object is dropped, or at interpreter exit: whichever is first.
        self._teardown = weakref.finalize(
            self, _teardown, [*self.namespaces, self.bridge], self._procs
        )

    # --- building and tearing down ---------------------------------------------------------

    def __enter__(self) -> Hosts:
        reason = available()
        if reason:
            self._teardown.detach()
            raise Unavailable(reason)
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process on the hosts and deletes the namespaces (idempotent)."""
        self._teardown()

    def _build(self) -> None:
        links.ip("netns", "add", self.bridge)
        links.ip("-n", self.bridge, "link", "add", "name", "br0", "type", "bridge")
        links.ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, namespace in enumerate(self.namespaces):
            links.ip("netns", "add", namespace)
            # Made inside the bridge's namespace, its peer straight in the host's: no
            # interface of this link ever exists in the machine's own namespace.
            port = links.port(i)
            link = f"link add name {port} type veth peer name {links.HOST_DEVICE} netns {namespace}"
            links.ip("-n", self.bridge, *link.split())
            links.ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            links.ip(
                "-n", namespace, "addr", "add", f"{self.address(i)}/24", "dev", links.HOST_DEVICE
            )
            links.ip("-n", namespace, "link", "set", links.HOST_DEVICE, "up")
            links.ip("-n", namespace, "link", "set", "lo", "up")
            if self.names:
                self._write_hosts_file(namespace)

    def _write_hosts_file(self, namespace: str) -> None:
        os.makedirs(os.path.join(NETNS_ETC, namespace), exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        lines += [f"{self.address(i)} {name}" for i, name in enumerate(self.names or [])]
        with open(os.path.join(NETNS_ETC, namespace, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    # --- what a host is ----------------------------------------------------------------

    def address(self, host: int) -> str:
        """The IPv4 address of `host` (10.77.0.1 for host 0)."""
        return f"{SUBNET}.{host + 1}"

    def hostname(self, host: int, by_name: bool = True) -> str:
        """How other hosts reach `host`: its name (when given and `by_name`), else its address."""
        return self.names[host] if self.names and by_name else self.address(host)

    def cluster(
        self, layout: Mapping[str, Sequence[int]], by_name: bool = False
    ) -> list[HostedMember]:
        """A cluster's members laid out on the hosts, each with its `TF_CONFIG`.

        Args:
          layout: member type -> the host of each of its members, in index order,
            e.g. `{"chief": [0], "worker": [1, 2], "ps": [3]}`.
          by_name: address members by host name instead of by address.

        Returns:
          The members, in `layout` order.
        """
        addresses = {
            member_type: [f"{self.hostname(h, by_name)}:{PORT}" for h in hosts]
            for member_type, hosts in layout.items()
        }
        return [
            HostedMember(
                member_type, index, host, cluster.make_tf_config(addresses, member_type, index)
            )
            for member_type, hosts in layout.items()
            for index, host in enumerate(hosts)
        ]

    # --- running members ----------------------------------------------------------------

    def start(
        self,
        host: int,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        cpu: int | None = None,
        **popen_args,
    ) -> subprocess.Popen:
        """Starts `command` on `host` (in its namespace), pinned to core `cpu` if given.

        It runs in a session of its own; `close` kills it and whatever it started.
        """
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[host], *pin, *command],
            env=dict(env if env is not None else os.environ),
            start_new_session=True,
            **popen_args,
        )
        self._procs.append(proc)
        return proc

    def start_trainer(
        self,
        member: HostedMember | int,
        args: Sequence[str],
        log: str,
        cwd: str | None = None,
        cpu: int | None = None,
        env: Mapping[str, str] | None = None,
        module: str = "trainer",
    ) -> subprocess.Popen:
        """Starts the per-host command for `member`: `TF_CONFIG=... python -m trainer ARGS`.

        Args:
          member: the member (from `cluster`), which runs on its host; or a host, to
            run one process there without `TF_CONFIG`.
          args: the trainer's flags.
          log: the file its stdout and stderr go to.
          cwd: its working directory.
          cpu: the core it is pinned to (None: any).
          env: more environment variables.
          module: what runs (`python -m MODULE ARGS`), e.g. the agent `trainer.elastic`.
        """
        environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, environ.get("PYTHONPATH")]))
        environ.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **(env or {}))
        if isinstance(member, HostedMember):
            environ["TF_CONFIG"] = member.tf_config
        with open(log, "w") as output:
            return self.start(
                member.host if isinstance(member, HostedMember) else member,
                [sys.executable, "-m", module, *args],
                env=environ,
                cpu=cpu,
                cwd=cwd,
                stdout=output,
                stderr=subprocess.STDOUT,
            )


def remove_stale() -> list[str]:
    """Removes the namespaces (and their processes) of runs whose process is gone; their names."""
    removed = []
    for namespace in _namespaces():
        pid = namespace.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _teardown([namespace], [])
            removed.append(namespace)
    return removed


def _namespaces() -> list[str]:
    listing = links.run("ip", "netns", "list").stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def _teardown(namespaces: list[str], procs: list[subprocess.Popen]) -> None:
    """Kills every process in `namespaces`, then deletes them and their /etc/netns files."""
    existing = set(_namespaces())
    for namespace in namespaces:
        if namespace not in existing:
            continue
        deadline = time.monotonic() + _TEARDOWN_S
        # Again until none is left: one may have started another meanwhile.
        while (pids := _pids(namespace)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(subprocess.CalledProcessError):
            links.ip("netns", "del", namespace)
        shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)
    for proc in procs:  # reaped, so that none stays a zombie
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def _pids(namespace: str) -> list[int]:
    try:
        return [int(pid) for pid in links.ip("netns", "pids", namespace).stdout.split()]
    except subprocess.CalledProcessError:  # gone already
        return []


__getattr__ = renamed.old_names(__name__, {"Member": "HostedMember"}, globals())
