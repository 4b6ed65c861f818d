"""Local servers on loopback only: a network namespace of their own, holding only `lo`.

TensorFlow's gRPC servers (a cluster member's, the tf.data service's
dispatcher and data workers) listen on every interface, whatever address they
are given, and a member runs any graph a client sends it. So a local cluster
on "127.0.0.1" would let anyone who reaches the machine run code as its user.
`loopback_only` moves the calling process, before it starts anything, into a
new network namespace whose only interface is `lo`; the processes it starts
inherit it. They reach each other on 127.0.0.1; nothing outside reaches them,
and they reach nothing outside either (a `gs://` model_dir or a remote
`grpc://` data service needs the network: the caller's explicit option).

As root this is `unshare(CLONE_NEWNET)`; otherwise a user namespace comes with
it (`CLONE_NEWUSER`, mapping the user to itself), where the kernel allows
unprivileged user namespaces. Both need a process of one thread: TensorFlow's
threads would stay behind in the host's namespace. No TensorFlow at import.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from collections.abc import Callable, Iterable

from towerflow.errors import UserError

ENV = "TOWERFLOW_NETWORK"  # "loopback" in a process of a loopback-only namespace, and below
LOOPBACK_ONLY = "loopback"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_LOCAL_SCHEMES = ("file://", "ram://")  # paths with a scheme that stay on this machine
_WHY = "TensorFlow's servers listen on every interface and run any graph a client sends"


def isolated() -> bool:
    """Whether this process runs in a loopback-only namespace made by `loopback_only`."""
    return os.environ.get(ENV) == LOOPBACK_ONLY


def remote_value(values: Iterable[str]) -> str | None:
    """The first of `values` that names something over the network (`scheme://`), or None.

    `file://` and `ram://` (in-memory files) stay on this machine.
    """
    for value in values:
        if "://" in value and not any(s in value for s in _LOCAL_SCHEMES):
            return value
    return None


def loopback_only(
    what: str, accept: str, values: Iterable[str], allowed: bool, say: Callable[[str], None]
) -> None:
    """Moves this process into a network namespace of its own with only `lo`, or refuses.

    Args:
      what: what runs the servers, for the messages ("the local cluster").
      accept: the option that accepts servers on the host's network ("--allow_network").
      values: the command's arguments or settings; one naming a remote address
        (`remote_value`) needs the network, and so is refused without `allowed`.
      allowed: the user accepted servers reachable from other hosts: nothing moves.
      say: shows the one line saying which it is, at start-up (none when this
        process was started in such a namespace already).

    Raises:
      UserError: a value needs the network, or the kernel refuses a namespace
        (no root and no unprivileged user namespaces); the line names `accept`.
    """
    if isolated():
        return  # started by an isolated launcher: its namespace holds the whole cluster
    if allowed:
        say(f"{what}: servers on every interface of this host, as {accept} asks ({_WHY})")
        return
    remote = remote_value(values)
    if remote:
        raise UserError(
            f"`{remote}` needs the network, but {what} runs in a network namespace that has "
            f"only loopback ({_WHY}); pass {accept} to run it on this host's network instead."
        )
    try:
        _unshare()
        _loopback_up()
    except OSError as e:
        raise UserError(
            f"{what} cannot have a network namespace of its own here ({os.strerror(e.errno)}: "
            f"needs root or unprivileged user namespaces), and {_WHY}; pass {accept} to "
            "accept servers reachable from other hosts."
        ) from None
    os.environ[ENV] = LOOPBACK_ONLY
    say(f"{what}: in a network namespace of its own, reachable on 127.0.0.1 only")


def _unshare() -> None:
    """A new network namespace for this single-threaded process (and a user one unless root)."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a namespace is per thread: the others would stay on the host's network
        raise OSError(errno.EBUSY, f"the process already runs {threads} threads")
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNET if uid == 0 else _CLONE_NEWNET | _CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if uid != 0:  # the user stays itself inside: files keep their owner
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
            _write(f"/proc/self/{name}", text)
        _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """Brings `lo` up (a new namespace has it down): `ip link set lo up`, without `ip`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))
