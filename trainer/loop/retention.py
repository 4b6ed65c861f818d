"""The bookkeeping of checkpoints: which are committed and kept, and what each delta builds on.

`Retention` owns one directory of checkpoints (the chief's `model_dir/checkpoints`,
or another member's scratch directory): the `checkpoint` state file that commits
them, which of them to keep (`max_to_keep`, and past it a full checkpoint that
a kept delta needs), which full checkpoint each delta on disk builds on, and
the removal of dropped checkpoints and of a write that failed (`NoSpace` when
the disk was full).

`Increments` owns the deltas' side in memory (`trainer.loop.deltas`): whether a
save is a delta, and the full checkpoint the next delta builds on.

Both are parts of `trainer.loop.checkpoints.Checkpointer`, which says when
each is used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import tensorflow as tf

from towerflow.errors import UserError
from trainer.loop import deltas

STATE_FILE = "checkpoint"  # the name TensorFlow's `latest_checkpoint` reads
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")


class NoSpace(Exception):
    """A checkpoint did not fit in `model_dir`; the last committed one is kept."""


class Retention:
    """The checkpoints committed in one directory, and which of them are kept.

    It writes the state file, deletes checkpoints beyond `max_to_keep` once a
    newer one is committed (a full checkpoint stays while a kept delta needs
    it), remembers which full checkpoint each delta builds on, and turns a
    write that did not fit on the disk into `NoSpace`.
    """

    def __init__(self, model_dir: str, directory: str, max_to_keep: int, checkpoint_bytes: int):
        """Args:
        model_dir: the job's `model_dir`, named in `NoSpace`.
        directory: where the checkpoints are written and committed.
        max_to_keep: how many checkpoints to keep.
        checkpoint_bytes: about how large a checkpoint is, named in `NoSpace`.
        """
        self.directory = directory
        self._model_dir = model_dir
        self._max_to_keep = max_to_keep
        self._bytes = checkpoint_bytes
        self._base_steps: dict[str, int | None] = {}  # checkpoint name -> its full one's step

    def base_step(self, path: str) -> int | None:
        """The step of the full checkpoint that `path` is a delta of (None: full), read once."""
        name = os.path.basename(path)
        if name not in self._base_steps:
            self._base_steps[name] = deltas.base_step(path)
        return self._base_steps[name]

    def written(self, path: str, base_step: int | None) -> None:
        """Notes that checkpoint `path` was just written, a delta of `base_step` (None: full)."""
        self._base_steps[os.path.basename(path)] = base_step

    def full_of(self, path: str) -> str:
        """The full checkpoint that checkpoint `path` is a delta of (`path` if it is full).

        Raises:
          UserError: it is a delta, and its full checkpoint is gone.
        """
        base = self.base_step(path)
        if base is None:
            return path
        full = os.path.join(os.path.dirname(path), f"ckpt-{base}")
        if not tf.io.gfile.exists(full + ".index"):
            raise UserError(
                f"checkpoint {path} is a delta of the full checkpoint {full}, which is "
                f"missing; put {full}.* back, or remove {os.path.basename(path)} from "
                f"{os.path.join(os.path.dirname(path), STATE_FILE)} to resume from an "
                "earlier one."
            )
        return full

    def commit(self, step: int, path: str) -> None:
        """Names `path` in the state file, then deletes checkpoints beyond `max_to_keep`.

        Raises:
          NoSpace: the state file did not fit on the disk (`path` is removed).
        """
        kept, dropped = self._kept_and_dropped(path)
        lines = [f'model_checkpoint_path: "{os.path.basename(path)}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in kept]
        state = os.path.join(self.directory, STATE_FILE)
        try:
            with tf.io.gfile.GFile(state + ".tmp", "w") as f:
                f.write("\n".join(lines) + "\n")
            tf.io.gfile.rename(state + ".tmp", state, overwrite=True)
        except Exception as e:
            with contextlib.suppress(tf.errors.OpError):
                tf.io.gfile.remove(state + ".tmp")
            raise self.failed(step, path, e) from None
        for old in dropped:
            remove(old)

    def _kept_and_dropped(self, path: str) -> tuple[list[str], list[str]]:
        """The checkpoints to keep once `path` is committed (oldest first), and those to drop."""
        kept = [p for p in newest_first(self.directory)[::-1] if p != path] + [path]
        dropped, kept = kept[: -self._max_to_keep], kept[-self._max_to_keep :]
        needed = set()  # the names of the full checkpoints of kept deltas
        for kept_path in kept:
            with contextlib.suppress(tf.errors.OpError):  # unreadable: restore skips it
                base = self.base_step(kept_path)
                if base is not None:
                    needed.add(f"ckpt-{base}")
        kept = [p for p in dropped if os.path.basename(p) in needed] + kept
        dropped = [p for p in dropped if p not in kept]
        return kept, dropped

    def failed(self, step: int, path: str, error: Exception) -> Exception:
        """`NoSpace` for a write that did not fit (its partial files removed); else `error`."""
        if not _is_no_space(error):
            return error
        remove(path)
        free = ""
        with contextlib.suppress(OSError):  # not a local file system
            free = f", {shutil.disk_usage(self.directory).free / 2**20:.1f} MiB free"
        latest = newest_first(self.directory)
        kept = f"the last good checkpoint {latest[0]} is kept" if latest else "none was saved"
        return NoSpace(
            f"no space left in `model_dir` {self._model_dir} for checkpoint ckpt-{step}: it "
            f"needs about {self._bytes / 2**20:.1f} MiB{free}; {kept}. Free some space (or "
            "pass another `--model_dir` on a larger disk) and run again to resume."
        )


class Increments:
    """When a save is a delta, and the full checkpoint (and table clocks) it builds on.

    A save is a delta while it falls in the same `full_every` steps as the
    last full checkpoint saved or restored here; with no such checkpoint
    (a fresh `model_dir`, or a restore that re-split the tables) it is full.
    """

    def __init__(self, variables: list, optimizer, full_every: int):
        """Args:
        variables: every model variable (the dynamic tables' among them).
        optimizer: the optimizer whose slots a delta holds; None: every checkpoint is full.
        full_every: steps between full checkpoints; 0: every checkpoint is full.
        """
        self._variables, self._optimizer = list(variables), optimizer
        self.full_every = full_every if optimizer is not None else 0
        self._layout: deltas.Layout | None = None  # built at the first need
        # (step, each table part's step then) of the full checkpoint that deltas build on.
        self.base: tuple[int, list[int]] | None = None

    def layout(self) -> deltas.Layout:
        """The dynamic tables' parts and the variables a delta holds, built once."""
        if self._layout is None:
            self._layout = deltas.layout(self._variables, self._optimizer)
        return self._layout

    @property
    def incremental(self) -> bool:
        """Whether checkpoints between full ones are deltas (`full_every`, and dynamic tables)."""
        return self.full_every > 0 and bool(self.layout().families)

    def due(self, step: int) -> bool:
        """Whether the checkpoint of `step` is a delta: in the full one's `full_every` steps."""
        if not self.incremental or self.base is None:
            return False
        return step // self.full_every == self.base[0] // self.full_every

    def marks(self) -> list[int]:
        """Each table part's step now, for a full checkpoint written now ([] without deltas)."""
        return deltas.marks(self.layout()) if self.full_every else []

    def saved_full(self, step: int, marks: list[int]) -> None:
        """Deltas build on the full checkpoint just saved at `step`, with table clocks `marks`."""
        if self.full_every:
            self.base = (step, marks)

    def restored_full(self, step: int | None) -> None:
        """Deltas build on the full checkpoint just restored (`step` None: named otherwise)."""
        self.base = None
        if self.full_every and step is not None:
            self.base = (step, deltas.marks(self.layout()))

    def forget(self) -> None:
        """No full checkpoint to build on (the tables were re-split): the next save is full."""
        self.base = None


def newest_first(directory: str) -> list[str]:
    """The checkpoints committed in `directory`, newest first."""
    state = tf.train.get_checkpoint_state(directory)
    return list(reversed(state.all_model_checkpoint_paths)) if state else []


def remove(path: str) -> None:
    """Deletes checkpoint `path`: its files and the staging directory of a partial write."""
    for name in tf.io.gfile.glob(path + ".*") + tf.io.gfile.glob(path + "_temp*"):
        with contextlib.suppress(tf.errors.OpError):
            if tf.io.gfile.isdir(name):
                tf.io.gfile.rmtree(name)
            else:
                tf.io.gfile.remove(name)


def _is_no_space(error: BaseException) -> bool:
    """Whether a write failed for lack of space (as `OSError` or TensorFlow's error)."""
    if isinstance(error, OSError) and error.errno in _NO_SPACE:
        return True
    text = str(error)
    return isinstance(error, tf.errors.ResourceExhaustedError) or any(
        t in text for t in _NO_SPACE_TEXT
    )
