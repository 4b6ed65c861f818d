"""A simulated host's link, and the `ip` and `tc` calls behind `trainer.bench.hosts`.

`Links` is the part of `hosts.Hosts` that shapes a host's link (a rate
limit, delay, loss: `shape`) or cuts it (`set_link`), and reads what the
shaping saw (`counters`). Every link joins a host's namespace (device
`HOST_DEVICE`) to its port on the bridge (`port(host)`, in the bridge's
namespace). `available()` and `netem()` say what this machine can do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess

PREFIX = "towerflow-"  # every namespace made here starts with it: "towerflow-<pid>-..."
HOST_DEVICE = "eth0"  # a host's end of its link, in its own namespace


class Unavailable(RuntimeError):
    """Namespaces (or a shaping tool) cannot be used here; the message says why."""


def available() -> str | None:
    """None when simulated hosts can be made here; else why not, in one line."""
    return _probe()


@functools.cache
def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = [tool for tool in ("ip", "tc", "taskset") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "name", "br0", "type", "bridge")
        ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace with a bridge and a veth pair: {why(e)}"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", probe)
    return None


@functools.cache
def netem() -> bool:
    """Whether this kernel has `sch_netem` (delay and loss on a link)."""
    if available():
        return False
    probe = f"{PREFIX}{os.getpid()}-netem"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
        run("tc", "-n", probe, "qdisc", "add", "dev", "va", "root", "netem", "delay", "1ms")
        return True
    except subprocess.CalledProcessError:
        return False
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", probe)


class Links:
    """Shaping and cutting the hosts' links; mixed into `hosts.Hosts`.

    Uses the host's `bridge` and `namespaces`, `address(host)`, and `_drops`
    (host -> the `iptables` rules that drop its packets).
    """

    bridge: str
    namespaces: list[str]
    _drops: dict[int, list[tuple[str, list[str]]]]

    def set_link(self, host: int, up: bool) -> None:
        """Takes `host`'s link down (its bridge port: the host is cut off) or up again."""
        ip("-n", self.bridge, "link", "set", port(host), "up" if up else "down")

    def shape(
        self, host: int, rate_mbit: float = 0.0, delay_ms: float = 0.0, loss: float = 0.0
    ) -> None:
        """Shapes `host`'s link, both directions alike, in place of any shaping before.

        Args:
          host: the host.
          rate_mbit: an HTB rate limit in Mbit/s (0: none).
          delay_ms: added one-way delay in ms (needs `sch_netem`: see `netem()`).
          loss: the fraction of packets dropped each way: by netem where the
            kernel has it, else by `iptables`' `statistic` match at the receiving end.

        Raises:
          Unavailable: delay without netem, or loss with neither netem nor iptables.
        """
        if delay_ms and not netem():
            raise Unavailable("added delay needs `sch_netem`, which this kernel lacks")
        use_netem = netem() and bool(delay_ms or loss)
        if loss and not use_netem and not shutil.which("iptables"):
            raise Unavailable("loss without `sch_netem` needs iptables (apt-get install iptables)")
        self._unshape(host)
        for namespace, device in self._link_ends(host):
            tc = ["tc", "-n", namespace]
            parent = "root"
            if rate_mbit:
                # HTB lets a class send `burst` bytes at once before it waits for its
                # timer; the default (one timer tick's worth) holds one TCP stream to
                # 60% of a 10 Gbit/s rate here, 2 ms' worth to about 90%. quantum: bytes
                # per turn; the default (rate / r2q) is over HTB's limit at these rates.
                rate = f"{rate_mbit:g}mbit"
                burst = f"{max(64_000, int(rate_mbit * 1e6 / 8 * 0.002))}b"
                htb = f"rate {rate} ceil {rate} burst {burst} cburst {burst} quantum 200000"
                run(*tc, *f"qdisc add dev {device} root handle 1: htb default 1".split())
                run(*tc, *f"class add dev {device} parent 1: classid 1:1 htb {htb}".split())
                parent = "parent 1:1"
            if use_netem:
                netem_args = f"delay {delay_ms:g}ms " if delay_ms else ""
                netem_args += f"loss {loss * 100:g}%" if loss else ""
                run(*tc, *f"qdisc add dev {device} {parent} netem {netem_args}".split())
        if loss and not use_netem:
            self._drop(host, loss)

    def counters(self, host: int) -> dict[str, int]:
        """What `host`'s link shaping saw: bytes through its queues (both ways), packets dropped."""
        counts = {"shaped_bytes": 0, "dropped_packets": 0}
        for namespace, device in self._link_ends(host):
            shown = run("tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", device).stdout
            for qdisc in json.loads(shown):
                if qdisc.get("root") and qdisc["kind"] != "noqueue":
                    counts["shaped_bytes"] += qdisc["bytes"]
                if qdisc["kind"] == "netem":
                    counts["dropped_packets"] += qdisc["drops"]
        for namespace, rule in self._drops.get(host, []):
            # Listed as "-A INPUT [-s 10.77.0.2/32] -m statistic ... -c PACKETS BYTES -j DROP".
            source = f"-s {rule[1]}/32" if rule[0] == "-s" else None
            listed = run("ip", "netns", "exec", namespace, "iptables", "-S", "INPUT", "-v").stdout
            for line in listed.splitlines():
                if "statistic" in line and (source in line if source else " -s " not in line):
                    counts["dropped_packets"] += int(line.split(" -c ")[1].split()[0])
        return counts

    def _link_ends(self, host: int) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of `host`'s link: its own, and the bridge's port."""
        return [(self.namespaces[host], HOST_DEVICE), (self.bridge, port(host))]

    def _unshape(self, host: int) -> None:
        for namespace, device in self._link_ends(host):
            with contextlib.suppress(subprocess.CalledProcessError):  # none there yet
                run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root")
        for namespace, rule in self._drops.pop(host, []):
            run("ip", "netns", "exec", namespace, "iptables", "-D", "INPUT", *rule)

    def _drop(self, host: int, loss: float) -> None:
        """Drops `loss` of the packets each way over `host`'s link, where they arrive."""
        statistic = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:g}", "-j"]
        rules = [(self.namespaces[host], [*statistic, "DROP"])]  # into the host
        rules += [  # out of it, into the others
            (namespace, ["-s", self.address(host), *statistic, "DROP"])
            for other, namespace in enumerate(self.namespaces)
            if other != host
        ]
        for namespace, rule in rules:
            run("ip", "netns", "exec", namespace, "iptables", "-A", "INPUT", *rule)
        self._drops[host] = rules


def port(host: int) -> str:
    """The bridge's port for `host`'s link, in the bridge's namespace."""
    return f"p{host}"


def ip(*args: str) -> subprocess.CompletedProcess:
    return run("ip", *args)


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True)


def why(error: subprocess.CalledProcessError) -> str:
    return (error.stderr or error.stdout or str(error)).strip().splitlines()[-1]
