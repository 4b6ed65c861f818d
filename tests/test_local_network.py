"""Local means local: a local cluster's servers answer on loopback and from nowhere else.

TensorFlow's servers listen on every interface; `towerflow.netns` puts a local
cluster (and a trainer's `data.service=local:N` servers) in a network namespace
of its own holding only `lo`. These tests stand for another host with a second
network namespace, joined to this one by a veth pair (as root, with iproute2):
from there the cluster's ports must not answer, while from inside the
cluster's namespace 127.0.0.1 does; `--allow_network` is the control, where
the other host does reach them. That a trainer's `local:N` servers and the
trainer itself run in such a namespace is seen on the run whose server
tests/test_data_service.py kills (one run for both).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests import helpers
from towerflow import netns

_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"


def _needs_root_and_ip() -> None:
    reason = None if os.geteuid() == 0 else "needs root (network namespaces)"
    reason = reason or (None if shutil.which("ip") and shutil.which("nsenter") else "no iproute2")
    if reason:  # under `.ci/run` (root, iproute2 installed) they must run
        (pytest.fail if os.environ.get("TOWERFLOW_CI") else pytest.skip)(reason)


@contextlib.contextmanager
def _other_host() -> Iterator[tuple[list[str], str]]:
    """A second network namespace on a veth pair to this one: (its command prefix, our address)."""
    _needs_root_and_ip()
    tag, octet = f"tfl{os.getpid() % 100000}", os.getpid() % 250 + 1
    namespace, ours, theirs = f"{tag}-other", f"10.79.{octet}.1", f"10.79.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", namespace)
    try:
        ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}o", "netns", namespace)
        ip("addr", "add", f"{ours}/30", "dev", f"{tag}h")
        ip("link", "set", f"{tag}h", "up")
        ip("-n", namespace, "addr", "add", f"{theirs}/30", "dev", f"{tag}o")
        ip("-n", namespace, "link", "set", f"{tag}o", "up")
        yield ["ip", "netns", "exec", namespace], ours
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}h"], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _connects(prefix: list[str], host: str, port: int) -> bool:
    """Whether a TCP connection to host:port succeeds, made by `prefix python` (a namespace)."""
    command = [*prefix, sys.executable, "-c", _CONNECT, host, str(port)]
    return subprocess.run(command, capture_output=True, timeout=60).returncode == 0


def _namespace(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _members(pid_dir: pathlib.Path, count: int, proc: subprocess.Popen) -> dict[int, int]:
    """{pid: port} of the `count` listening members, once each has recorded its pid."""
    deadline = time.monotonic() + helpers.TIMEOUT_S
    while len(pids := list(pid_dir.glob("*.pid"))) < count:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    members = {}
    for path in pids:
        pid = int(path.stem)
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        tf_config = next(e for e in environ if e.startswith(b"TF_CONFIG=")).split(b"=", 1)[1]
        task = json.loads(tf_config)["task"]
        address = json.loads(tf_config)["cluster"][task["type"]][task["index"]]
        members[pid] = int(address.rsplit(":", 1)[1])
    return members


@pytest.mark.parametrize("allow_network", [False, True])
def test_another_host_reaches_a_local_cluster_only_with_allow_network(tmp_path, allow_network):
    with _other_host() as (from_other_host, our_address), helpers.killed_when_done():
        flags = ["--allow_network"] if allow_network else []
        proc = helpers.start_cli(
            "--workers=2", "--module=tests.fake_member", *flags, "--",
            "--listen", "--sleep=120", f"--pid_dir={tmp_path}",
            cwd=tmp_path, module="trainer.launch",
        )  # fmt: skip
        members = _members(tmp_path, 2, proc)
        for pid, port in members.items():
            assert _connects(from_other_host, our_address, port) == allow_network
            assert _connects(["nsenter", f"--net=/proc/{pid}/ns/net"], "127.0.0.1", port)
        namespaces = {_namespace(pid) for pid in members}
        assert len(namespaces) == 1  # one namespace holds the whole cluster
        assert (namespaces == {_namespace("self")}) == allow_network
        helpers.kill(proc)
        assert ("servers on every interface" in proc.stdout.read()) == allow_network


def test_a_local_cluster_that_needs_the_network_is_refused_in_one_line(tmp_path):
    result = helpers.launch("--workers=1", "--", "--model_dir=gs://bucket/run", cwd=tmp_path)
    helpers.assert_exit(result, 2)
    assert re.fullmatch(
        r"error: `--model_dir=gs://bucket/run` needs the network, but the local cluster runs "
        r"in a network namespace that has only loopback \(.*\); pass --allow_network .*\n",
        result.stderr,
    ), result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_local_data_service_that_needs_the_network_is_refused_in_one_line(tmp_path):
    result = helpers.run_cli(
        "--config.data.service=local:1", "--model_dir=gs://bucket/run", cwd=tmp_path
    )
    helpers.assert_exit(result, 2)
    assert "pass `--config.data.service_allow_network=True`" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_an_unprivileged_user_gets_a_user_namespace_with_it():
    _needs_root_and_ip()  # root, to become another user in a child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, then `loopback_only` as a user's launcher calls it
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as a user's own process
            said = []
            netns.loopback_only("the local cluster", "--allow_network", [], False, said.append)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                request = struct.pack("16sH14s", b"lo", 0, b"")
                flags = struct.unpack("16sH14s", fcntl.ioctl(sock, 0x8913, request))[1]  # GET
            devices = pathlib.Path("/proc/self/net/dev").read_text().splitlines()[2:]
            seen = [os.getuid(), _namespace("self"), [d.split(":")[0].strip() for d in devices]]
            os.write(write, json.dumps([*seen, flags & 1, said]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as result:
        uid, namespace, devices, up, said = json.loads(result.read())
    assert uid == 65534 and namespace != _namespace("self")
    assert devices == ["lo"] and up == 1
    assert said == [
        "the local cluster: in a network namespace of its own, reachable on 127.0.0.1 only"
    ]


def _documented() -> list[tuple[str, str]]:
    """docs/security.md's commands, each with the line it shows (the text block after)."""
    page = pathlib.Path(helpers.REPO, "docs", "security.md").read_text()
    return re.findall(r"```sh\n(.*?)\n```\s*```text\n(.*?)\n```", page, re.S)


def test_the_page_shows_its_commands():
    assert len(_documented()) == 2


@pytest.mark.slow  # two trainers each: the launcher's cluster path runs in the default tier
@pytest.mark.parametrize("command, shown", _documented())
def test_the_pages_command_runs_as_written_and_shows_its_line(tmp_path, command, shown):
    _needs_root_and_ip()
    program, *args = shlex.split(command)
    assert program == "python"
    result = helpers.run_command([sys.executable, *args], str(tmp_path))
    helpers.assert_exit(result)
    assert shown in result.stdout.splitlines()
