"""A pytest plugin: the CPU seconds of each test, its processes included, one JSON line each.

    CPU_PER_TEST=cpu.jsonl python -m pytest tests -p tests.cpu_per_test

For each test, the CPU time (user and system) of the pytest process and of every
process below it, read from `/proc` before and after the test (children it
reaped included), its wall time, when it ended (seconds since the epoch) and the
xdist worker that ran it: `{"id": ..., "cpu": seconds, "wall": seconds, "end": seconds,
"worker": "gw0"}`, appended to the file `CPU_PER_TEST` names (the last two show a worker
left idle at the end of the run). On a machine the suite keeps busy,
wall time follows CPU time: the costliest tests are the lines with the most CPU.
Linux only.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")
_FILE = os.environ.get("CPU_PER_TEST", "cpu_per_test.jsonl")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of it and its reaped children), or None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), sum(int(t) for t in fields[11:15])  # utime stime cutime cstime


def _tree_ticks() -> dict[int, int]:
    """The CPU ticks of this process and of each process below it, by pid."""
    stats = {int(n): s for n in os.listdir("/proc") if n.isdigit() and (s := _stat(int(n)))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    ticks, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            ticks[pid] = stats[pid][1]
        todo.extend(children.get(pid, []))
    return ticks


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = _tree_ticks(), time.monotonic()
    yield
    after, wall = _tree_ticks(), time.monotonic() - started
    cpu = sum(t - before.get(pid, 0) for pid, t in after.items()) / _TICKS
    with open(_FILE, "a") as out:
        line = {"id": item.nodeid, "cpu": round(cpu, 2), "wall": round(wall, 2)}
        line.update(end=round(time.time(), 2), worker=os.environ.get("PYTEST_XDIST_WORKER", ""))
        out.write(json.dumps(line))
        out.write("\n")
