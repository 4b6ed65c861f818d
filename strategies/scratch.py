"""Private scratch directories in the temp dir, named after the process that owns them.

Tasks that are not the chief write what they must (a collective save, the
preemption handler's files) to a scratch directory and remove it when they
end. A task killed with SIGKILL cannot, so every name carries its owner's
host and pid, `towerflow-<kind>-<host>-<pid>-<random>`, and `make` first
removes those of this host whose process is gone. A live process's scratch is
never touched, nor one of another host sharing the temp dir, nor a name this
module did not make.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile

_NAME = re.compile(r"^towerflow-[a-z]+-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")


def make(kind: str) -> str:
    """Creates and returns a new scratch directory for `kind` ("ckpt", "preemption", ...).

    Scratch directories that processes of this host left behind when they
    died are removed first.
    """
    remove_orphans()
    host = _host()
    return tempfile.mkdtemp(prefix=f"towerflow-{kind}-{host}-{os.getpid()}-")


def remove_orphans(directory: str | None = None) -> list[str]:
    """Removes this host's scratch directories whose owner process is gone; returns them."""
    directory = directory or tempfile.gettempdir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _NAME.match(name)
        if not match or match["host"] != _host() or alive(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _host() -> str:
    """This host's name, kept to characters that are safe in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
