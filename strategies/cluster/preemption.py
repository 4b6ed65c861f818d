"""Preemption: on SIGTERM every member saves at one agreed step, then exits to be restarted.

Schedulers (Kubernetes, Slurm, spot-instance reclaimers) send SIGTERM before
they stop a process. The loop asks its strategy for a watch
(`strategy.membership.watch_preemption()`) and calls `check(save)` after every loop:

- `SignalWatch` (one process): SIGTERM sets a flag; the next `check` saves
  and raises `Preempted`.
- `CoordinatedWatch` (`multi_worker`): TensorFlow's
  `PreemptionCheckpointHandler`. The worker that got SIGTERM tells the others
  through the coordination service which loop to stop after; every worker
  saves at that same step (the save is collective) and raises `Preempted`.

The command line turns `Preempted` into exit status `errors.PREEMPTED_EXIT_CODE`
(143 = 128 + SIGTERM), which schedulers treat as "restart me" (a TFJob's
`ExitCode` restart policy retries 128-255). The restarted job resumes from
that checkpoint and loses no steps. This module imports TensorFlow only
when a `CoordinatedWatch` starts, so the launcher can read the exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from strategies.cluster import scratch

if TYPE_CHECKING:
    import tensorflow as tf

TEARDOWN_S = 10.0  # the longest a healthy cluster takes to stop the handler's watchers
Save = Callable[[], object]


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint holds the step reached. Exit with 143."""


class SignalWatch:
    """SIGTERM to this process sets a flag; `check` saves and raises `Preempted`.

    Use as a context manager: the handler is installed inside it (on the main
    thread only; elsewhere signals cannot be caught and the flag stays unset).
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def check(self, save: Save) -> None:
        """After a loop: if SIGTERM arrived, `save()` and raise `Preempted`."""
        if self.requested:
            save()
            raise Preempted("SIGTERM")


class CoordinatedWatch:
    """SIGTERM to any worker: every worker saves at the same step, then raises `Preempted`.

    Every worker must call `check` once per loop, in step (as the collective
    loop makes them). TensorFlow's handler counts the calls: the worker that
    got the signal picks "after the next call" and waits until every peer has
    acknowledged it, so all of them save after the same loop.
    """

    def __init__(self, cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver):
        self._resolver = cluster_resolver
        self._save: Save | None = None
        self._scratch = None
        self._handler = None
        self._previous = None

    def __enter__(self) -> CoordinatedWatch:
        import tensorflow as tf

        _no_cloud_metadata_probe()
        self._previous = signal.getsignal(signal.SIGTERM)
        # The handler restores "the latest checkpoint" of what it is given when it
        # starts; the loop restores (with its own checks) before this, so give it
        # an empty directory and let `save_fn` write the real checkpoint.
        self._scratch = scratch.make("preemption")  # in memory: gone however the process ends
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            self._resolver,
            tf.train.Checkpoint(),
            checkpoint_dir=os.path.join(self._scratch, "unused"),
            termination_config=tf.distribute.experimental.TerminationConfig(
                exit_fn=self._exit, save_fn=self._saved, grace_period=0
            ),
        )
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._handler is not None:
            _close_within(self._handler, TEARDOWN_S, lost=exc_type not in (None, Preempted))
            self._handler = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        if self._scratch is not None:
            scratch.remove(self._scratch)
            self._scratch = None

    def check(self, save: Save) -> None:
        """After a loop, on every worker: saves and raises `Preempted` at the agreed step."""
        self._save = save
        with _tf_warnings_hidden():  # a deprecation notice and "switching to a sync save"
            self._handler.save_checkpoint_if_preempted()

    def _saved(self) -> None:
        self._save()

    def _exit(self) -> None:
        raise Preempted("SIGTERM to a worker of the cluster")


def _close_within(
    handler: tf.distribute.experimental.PreemptionCheckpointHandler, timeout_s: float, lost: bool
) -> None:
    """Stops a `PreemptionCheckpointHandler`'s watcher threads, in `timeout_s` at most.

    The handler has no public close: its `__del__` tells the coordination
    service's leader to stop watching (an RPC with no deadline) and joins a
    thread that waits on the leader. When a step failed (`lost`), the leader
    may be the member that stopped answering, and that RPC would never return;
    otherwise it runs in a daemon thread given `timeout_s`. Either way the
    handler is disarmed, so its `__del__` (when collected, or at interpreter
    exit) has nothing left to wait for; its threads are daemons and end with
    the process.
    """
    if not lost:
        closer = threading.Thread(
            target=handler.__del__, name="towerflow-preemption-close", daemon=True
        )
        closer.start()
        closer.join(timeout_s)
    from strategies import tf_patches  # noqa: PLC0415 (TensorFlow: only once a handler exists)

    tf_patches.disarm_preemption_handler(handler)


@contextlib.contextmanager
def _tf_warnings_hidden() -> Iterator[None]:
    import tensorflow as tf

    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _no_cloud_metadata_probe() -> None:
    """Keeps TensorFlow's platform probe on this machine.

    `PreemptionCheckpointHandler` asks the cloud metadata server whether it runs
    on Google Cloud (an HTTP request to `GCE_METADATA_IP`). Pointing it at a
    closed port of the loopback address answers "no" at once and sends nothing
    off the machine; a user who sets `GCE_METADATA_IP` keeps their value.
    """
    os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:1")
