"""TensorFlow's own cluster start-up, bounded in time and ended by SIGTERM at any moment.

When a cluster strategy is built, TensorFlow starts this member's server and
connects to the cluster's coordination service (`TFE_EnableCollectiveOps`
for `multi_worker`, `TFE_ContextSetServerDef*` for the coordinator of
`parameter_server`). Its binding holds the interpreter lock all the while and
the wait has no end of its own (a leader that never answers), so no Python
code runs: no watchdog, no signal handler. Worse, TensorFlow installs a
SIGTERM handler of its own there, which only records the signal.

`bounded` runs those calls through `ctypes`, which releases the lock
(`tf_patches.start_calls_unlocked`), in a thread of their own; this thread
meanwhile waits in Python: after `timeout_s` it raises `MemberLost` (one
line, exit 144), and SIGTERM raises exit 143 (the handler is put back every
few milliseconds, so TensorFlow's own cannot keep it). The call left running
is abandoned with the process, which exits without interpreter teardown (the
command's `MemberLost` path does the same), as the teardown would crash under
it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from strategies import tf_patches
from strategies.cluster.preemption import Preempted
from towerflow.errors import PREEMPTED_EXIT_CODE, MemberLost

POLL_S = 0.02  # how often the waiting thread looks at the clock and re-asserts its handler
SAY_AFTER_S = 1.0  # a call still running after this long is named once


def _not_joined(timeout_s: float, setting: str, what: str) -> MemberLost:
    """The one line for a member TensorFlow did not join to its cluster in time."""
    return MemberLost(
        f"TensorFlow did not join the cluster within {timeout_s:g} s as {what}; "
        "check that every member runs with the same `TF_CONFIG` cluster, that each "
        "host resolves here (DNS) to its machine and that its port is open to "
        f"this host; `{setting}` sets this wait."
    )


@contextlib.contextmanager
def bounded(
    timeout_s: float, setting: str, what: str, report: Callable[[str], None] = print
) -> Iterator[None]:
    """TensorFlow's cluster start-up calls made inside the block end by `timeout_s` or SIGTERM.

    Args:
      timeout_s: how long TensorFlow may take to join the cluster, in seconds.
      setting: the config field that sets `timeout_s`, named in the error.
      what: this member and its cluster as the error names them, e.g.
        "worker:0 (127.0.0.1:2222)".
      report: prints one line for the user.

    Raises:
      MemberLost: TensorFlow had not joined the cluster within `timeout_s`.
      Preempted: SIGTERM arrived meanwhile.
    """
    with tf_patches.grpc_reconnects_quickly(), _bounded(timeout_s, setting, what, report):
        yield


@contextlib.contextmanager
def _bounded(
    timeout_s: float, setting: str, what: str, report: Callable[[str], None]
) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; the bound stays TensorFlow's
        return
    deadline = time.monotonic() + timeout_s

    def stop(signum, frame):
        report("SIGTERM while TensorFlow joined the cluster: stopping (nothing to save yet)")
        if in_flight:  # the interpreter's teardown would crash under the abandoned call
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PREEMPTED_EXIT_CODE)
        raise Preempted("SIGTERM during start-up")

    in_flight: list[str] = []

    def call(name: str, run: Callable[[], None]) -> None:
        outcome: list[BaseException | None] = []
        thread = threading.Thread(
            target=_capture, args=(run, outcome), name=f"towerflow-{name}", daemon=True
        )
        in_flight.append(name)
        thread.start()
        say_at = time.monotonic() + SAY_AFTER_S
        while thread.is_alive():
            signal.signal(signal.SIGTERM, stop)  # TensorFlow's own handler only records it
            if say_at is not None and time.monotonic() >= say_at:
                say_at = None
                report(
                    f"waiting for TensorFlow to join the cluster as {what} "
                    f"(at most {timeout_s:g} s)"
                )
            if time.monotonic() >= deadline:
                raise _not_joined(timeout_s, setting, what)
            thread.join(POLL_S)
        in_flight.remove(name)
        if outcome[0] is not None:
            raise outcome[0]

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with tf_patches.start_calls_unlocked(call):
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _capture(run: Callable[[], None], outcome: list) -> None:
    try:
        run()
        outcome.append(None)
    except BaseException as e:  # handed to the waiting thread
        outcome.append(e)
