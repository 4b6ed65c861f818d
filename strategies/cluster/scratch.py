"""Scratch space of a member that is not the chief, in the process's own memory.

Members other than the chief must write what the chief writes (a collective
checkpoint save, the preemption handler's files, an export), and keep none of
it. They write to TensorFlow's in-memory file system (`ram://`), which
belongs to the process: however the process ends, SIGKILL and the OOM killer
included, nothing is left on any disk, and nothing needs cleaning up on the
next start. `remove` frees the memory while the process runs; a checkpoint in
scratch costs about as much memory as the variables it holds.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator


def make(kind: str) -> str:
    """Creates and returns a new scratch directory for `kind` ("ckpt", "preemption", ...)."""
    import tensorflow as tf  # here: the launcher imports `preemption`, and with it this module

    # A random name: on `ram://` a name is also a prefix match, so none may start another.
    path = f"ram://towerflow-{kind}-{uuid.uuid4().hex}"
    tf.io.gfile.makedirs(path)
    return path


def remove(path: str) -> None:
    """Removes scratch directory `path` and frees its memory; nothing when it is gone."""
    import tensorflow as tf

    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


@contextlib.contextmanager
def directory(kind: str) -> Iterator[str]:
    """A scratch directory for the block, removed after it."""
    path = make(kind)
    try:
        yield path
    finally:
        remove(path)
