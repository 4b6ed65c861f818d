"""Files under `model_dir` and a sweep directory, on any file system TensorFlow has.

Every read and write of `model_dir` goes through `tf.io.gfile`, as
checkpoints and TensorBoard events already do, so `model_dir` may be a local
path, a shared mount, or a bucket (`gs://...`, `s3://...`, `hdfs://...`, or
any scheme a TensorFlow file-system plugin registers). A path with a scheme
is *remote*: what only a local file system offers (free space, `flock`,
permission bits, an atomic directory rename) is used for local paths only,
and each caller says what it does instead.

Writes are whole or absent: a file is written under a temporary name and
renamed into place (on an object store a rename is a copy and a delete, so
a reader still never sees half a file).

TensorFlow is imported on first use, not with this module: the sweep, which
only writes its directory, starts without it.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING

from towerflow.errors import UserError

if TYPE_CHECKING:
    import tensorflow as tf

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_local(path: str) -> bool:
    """Whether `path` is on the local file system (no `scheme://` prefix)."""
    return not _SCHEME.match(path)


def check_scheme(path: str, flag: str) -> None:
    """TensorFlow must have a file system for `path`'s scheme (`gs://` is built in).

    Raises:
      UserError: it has none (`s3://` without a file-system plugin, a typo).
    """
    scheme = _SCHEME.match(path)
    known = _tf().io.gfile.get_registered_schemes()
    if scheme and scheme[0][: -len("://")] not in known:
        schemes = ", ".join(f"`{s}://`" for s in sorted(known) if s and s != "file")
        raise UserError(
            f"`{flag}` '{path}': TensorFlow has no file system for `{scheme[0]}` here (it has "
            f"{schemes} and local paths); load a TensorFlow file-system plugin for it, or give "
            "a local or mounted path."
        )


def parent(path: str) -> str | None:
    """The directory holding `path`; None above a remote path's root (`gs://bucket`)."""
    if is_local(path):
        return os.path.dirname(os.path.abspath(path))
    scheme = _SCHEME.match(path)[0]
    rest = path[len(scheme) :].rstrip("/")
    return scheme + rest.rsplit("/", 1)[0] if "/" in rest else None


def makedirs(path: str) -> None:
    """Creates directory `path` and its parents, as needed."""
    _tf().io.gfile.makedirs(path)


def is_file(path: str) -> bool:
    """Whether `path` exists and is not a directory."""
    gfile = _tf().io.gfile
    return gfile.exists(path) and not gfile.isdir(path)


def open_file(path: str, mode: str = "r") -> tf.io.gfile.GFile:
    """`path` opened with `tf.io.gfile.GFile` ("r", "w" or "a"; "b" for bytes)."""
    return _tf().io.gfile.GFile(path, mode)


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` whole: under a temporary name, then renamed into place."""
    staging = path + ".tmp"
    with open_file(staging, "w") as f:
        f.write(text)
    _tf().io.gfile.rename(staging, path, overwrite=True)


def write_json(path: str, value: dict) -> None:
    """Writes `value` as indented JSON to `path`, whole (see `write_text`)."""
    write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_json(path: str) -> dict | None:
    """The JSON in `path`, or None when there is no such file."""
    try:
        with open_file(path) as f:
            return json.loads(f.read())
    except _tf().errors.NotFoundError:
        return None


def replace_dir(staging: str, path: str) -> None:
    """Moves directory `staging` to `path`, replacing what `path` held.

    Locally one `rename` moves the whole directory at once. Object stores have
    no directories to rename (and `ram://` renames only the name itself), so
    there each file is moved in turn.
    """
    tf = _tf()
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)
    if is_local(staging):
        tf.io.gfile.rename(staging, path)
        return
    for directory, _, files in tf.io.gfile.walk(staging):
        target = path + directory[len(staging) :]
        tf.io.gfile.makedirs(target)
        for name in files:
            tf.io.gfile.rename(f"{directory}/{name}", f"{target}/{name}", overwrite=True)
    tf.io.gfile.rmtree(staging)


def _tf():
    """TensorFlow, imported at the first file access (see the module's docstring)."""
    import tensorflow as tf

    return tf
