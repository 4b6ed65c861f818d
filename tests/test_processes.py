"""`towerflow.processes`: a `Group` of named children, their output, their stop."""

import io
import signal
import sys
import time

from towerflow import processes

# A child that says it is ready, then ignores SIGTERM: only SIGKILL ends it.
_STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_group_prefixes_output_and_kills_a_child_that_ignores_sigterm_after_the_wait():
    stream = io.StringIO()
    group = processes.Group(processes.Console(stream))
    group.start("quick", [sys.executable, "-c", "print('hello')"], {})
    group.start("stubborn", [sys.executable, "-c", _STUBBORN], {})
    try:
        group.procs["quick"].wait(timeout=30)
        deadline = time.monotonic() + 30
        while "[stubborn] ready" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(processes.POLL_S)
        assert group.ended() == [("quick", 0)], stream.getvalue()
    finally:
        group.stop(wait_s=0.5)
    assert dict(group.ended()) == {"quick": 0, "stubborn": -signal.SIGKILL}
    assert "[quick] hello\n" in stream.getvalue()
