"""Checkpoints under `model_dir/checkpoints`, written by the chief.

Every task calls `save` (some strategies save collectively); tasks other
than the chief write to a private scratch directory in their own memory
(`strategies.cluster.scratch`), keep only the newest there, and `close` frees it.

With `async_save`, `save` returns once the values are copied to host memory
and a background thread writes the files, so training goes on meanwhile.
TensorFlow makes each copy on its variable's own task, so where variables
live on other tasks (parameter servers) saves stay synchronous: a lost ps
cannot take a checkpoint in flight with it.

A checkpoint is *committed*, named in the `checkpoint` state file that
`latest`, `restore` and a restarted job read, only once its files are
complete: a synchronous save commits at once, an asynchronous one when the
next save starts (which first waits for it), or at `sync`, `latest`,
`restore` and `close`. Old checkpoints are deleted only after a newer one is
committed. So a write that fails, because the disk is full or because a task
holding the variables was lost mid-write, costs at most that one checkpoint:
the state file still names the one before. A full disk stops training with
`NoSpace`, one line naming `model_dir` and the space a checkpoint needs.

A checkpoint written with other splits of the tables and sharded layers
(another number of ps members, or none) restores through `trainer.loop.portable`.

With `full_every` (`train.full_checkpoint_every`) the checkpoints between two
full ones are deltas holding only the table rows changed since the full one
(`trainer.loop.deltas`); restoring one restores its full checkpoint, then replays
it. A full checkpoint is kept, past `max_to_keep`, while a kept delta needs
it; a delta whose full checkpoint is gone is a one-line error naming both.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
import sys

import tensorflow as tf

from strategies import tf_patches
from strategies.cluster import scratch
from towerflow.errors import UserError, one_line
from trainer.loop import deltas, portable

_STATE_FILE = "checkpoint"  # the name TensorFlow's `latest_checkpoint` reads
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")
_TASK = re.compile(r"/job:[^/]+/replica:\d+/task:\d+")
# The slot -> id table of dynamic tables' indexes before it joined the slot -> (stamp,
# last-seen step) table (`trainer.layers.tables`): its checkpoints are refused.
LEGACY_TABLE = "slot_keys"


class NoSpace(Exception):
    """A checkpoint did not fit in `model_dir`; the last committed one is kept."""


class Checkpointer:
    """Saves and restores `objects` (model, optimizer, ...) in `model_dir`."""

    def __init__(
        self,
        model_dir: str,
        is_chief: bool,
        max_to_keep: int,
        variables: list,
        *,
        async_save: bool = False,
        full_every: int = 0,
        **objects,
    ):
        """Args:
        model_dir: the checkpoints go to `model_dir/checkpoints`.
        is_chief: whether this task writes there (others write to a scratch directory).
        max_to_keep: how many checkpoints to keep.
        variables: every model variable; saved as a list and checked by shape on restore.
        async_save: write checkpoint files in the background (full checkpoints).
        full_every: steps between full checkpoints (`trainer.loop.deltas`); 0: every
          checkpoint is full. Deltas need dynamic tables, and `model` and
          `optimizer` among `objects`; without them every checkpoint is full.
        **objects: other trackables to save (model, optimizer, ...); with `model`
          and `optimizer`, a checkpoint of other splits restores (`trainer.loop.portable`).
        """
        self.model_dir = model_dir
        self._model, self._optimizer = objects.get("model"), objects.get("optimizer")
        self.resplit: str | None = None  # the line saying what the last restore re-split
        self.directory = os.path.join(model_dir, "checkpoints")
        self._shapes = {  # checkpoint key -> (variable name, shape)
            f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE": (
                getattr(v, "path", None) or v.name,
                tuple(v.shape),
            )
            for i, v in enumerate(variables)
        }
        self._bytes = _total_bytes([*variables, *objects.values()])
        self._variables, self._indexes = list(variables), list(objects.get("tables", []))
        self._full_every = full_every if self._optimizer is not None else 0
        self._layout: deltas.Layout | None = None  # built at the first need
        # (step, each table part's step then) of the full checkpoint that deltas build on.
        self._base: tuple[int, list[int]] | None = None
        self._base_steps: dict[str, int | None] = {}  # checkpoint name -> its full one's step
        objects["variables"] = list(variables)
        self.checkpoint = tf.train.Checkpoint(**objects)
        self._save_counter = self.checkpoint.save_counter  # created now, so every write holds it
        # TF's background write reads a copy made on each variable's own task: with
        # variables on other tasks (parameter servers), a checkpoint in flight would
        # die with them, so it is written before `save` returns.
        async_save = async_save and _all_on_task(variables, self._save_counter.device)
        self._options = tf.train.CheckpointOptions(enable_async=async_save)
        if async_save:
            tf_patches.keras_variables_save_asynchronously()
        self._max_to_keep = max_to_keep if is_chief else 1  # scratch holds memory: no more
        self._temp_dir = None if is_chief else scratch.make("ckpt")
        self._write_dir = self._temp_dir or self.directory
        self._saved: tuple[int | None, str] = (None, "")  # (step, path) of the last save
        self._pending: tuple[int, str] | None = None  # an asynchronous write not yet committed

    @property
    def asynchronous(self) -> bool:
        """Whether saves are written in the background (asked for, and every variable is local)."""
        return self._options.enable_async

    @property
    def incremental(self) -> bool:
        """Whether checkpoints between full ones are deltas (`full_every`, and dynamic tables)."""
        return self._full_every > 0 and bool(self._deltas().families)

    def _deltas(self) -> deltas.Layout:
        if self._layout is None:
            self._layout = deltas.layout(self._variables, self._optimizer)
        return self._layout

    @property
    def latest(self) -> str | None:
        """The newest checkpoint in `model_dir`, or None."""
        self.sync()
        return tf.train.latest_checkpoint(self.directory)

    def restore(self, path: str | None = None) -> str | None:
        """Restores checkpoint `path`, or else the newest readable one; returns its path.

        A truncated or corrupt newest checkpoint is skipped with a warning that
        names it, and the one before is used.

        Raises:
          UserError: the checkpoint belongs to a different model or optimizer.
        """
        self.sync()
        self.resplit = None
        for candidate in [path] if path else self._newest_first():
            try:
                full, delta = self._full_of(candidate), None
                if full != candidate:
                    delta = candidate
                resplit = self._check_shapes(full)
                if resplit is None:
                    self.checkpoint.restore(full).assert_existing_objects_matched()
                    self._base = None
                    step = _step_of(full)
                    if self._full_every and step is not None:
                        self._base = (step, deltas.marks(self._deltas()))
                    if delta is not None:
                        deltas.replay(delta, self._deltas(), self._indexes, self._save_counter)
                    return candidate
                self.resplit, warnings = portable.restore(
                    full, resplit, self._optimizer, self._save_counter, delta
                )
                self._base = None  # the rows moved to other slots: the next save is full
                for warning in warnings:
                    print(f"warning: {warning}", file=sys.stderr, flush=True)
                return candidate
            except (
                tf.errors.OpError,  # data loss, missing or unreadable shards
                IndexError,  # a truncated file: "Read less bytes than requested"
            ) as e:
                if path:
                    raise
                print(
                    f"warning: checkpoint {candidate} is unreadable ({one_line(e)}); "
                    "trying the one before",
                    file=sys.stderr,
                    flush=True,
                )
            except UserError:
                raise
            except (AssertionError, ValueError) as e:
                raise UserError(
                    f"`model_dir` holds checkpoint '{candidate}' of a different model or "
                    f"optimizer ({one_line(e)[:200]}); use a new `--model_dir`, or the "
                    "config that wrote it."
                ) from None
        return None

    def _full_of(self, path: str) -> str:
        """The full checkpoint that checkpoint `path` is a delta of (`path` if it is full).

        Raises:
          UserError: it is a delta, and its full checkpoint is gone.
        """
        base = self._base_step(path)
        if base is None:
            return path
        full = os.path.join(os.path.dirname(path), f"ckpt-{base}")
        if not tf.io.gfile.exists(full + ".index"):
            raise UserError(
                f"checkpoint {path} is a delta of the full checkpoint {full}, which is "
                f"missing; put {full}.* back, or remove {os.path.basename(path)} from "
                f"{os.path.join(os.path.dirname(path), _STATE_FILE)} to resume from an "
                "earlier one."
            )
        return full

    def _base_step(self, path: str) -> int | None:
        """The step of the full checkpoint that `path` is a delta of (None: full), read once."""
        name = os.path.basename(path)
        if name not in self._base_steps:
            self._base_steps[name] = deltas.base_step(path)
        return self._base_steps[name]

    def _check_shapes(self, path: str) -> portable.Plan | None:
        """Refuses a checkpoint whose variable list or shapes differ from `shapes`.

        TensorFlow does not always refuse one itself (a mirrored variable can
        skip a mismatched value silently), so compare before restoring. Where
        they differ only by the split of tables and sharded layers, returns the
        plan to restore it by.
        """
        # Not `tf.train.load_checkpoint`, which reads a path that is a directory as
        # "the newest checkpoint in it": on `ram://` (whose directories are name
        # prefixes) the prefix `ckpt-20` of `ckpt-20.index` is such a path.
        found = tf.compat.v1.train.NewCheckpointReader(path).get_variable_to_shape_map()
        if any(f"/{LEGACY_TABLE}/" in key for key in found):
            raise UserError(
                f"checkpoint '{path}' holds dynamic tables in an earlier index format (a "
                f"`{LEGACY_TABLE}` table) that this version does not read; train into a new "
                "`--model_dir`, or evaluate and export it with the version that wrote it."
            )
        saved = [k for k in found if k.startswith("variables/")]
        differs = None
        for key, (name, shape) in self._shapes.items():
            if key not in found or tuple(found[key]) != tuple(shape):
                there = tuple(found[key]) if key in found else "absent"
                differs = f"`{name}` is {there} there and {tuple(shape)} here"
                break
        if differs is None and len(saved) > len(self._shapes):
            differs = f"it has {len(saved)} model variables, this model {len(self._shapes)}"
        if differs is None:
            return None
        if self._model is not None and self._optimizer is not None:
            keys = [f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(len(saved))]
            if all(key in found for key in keys):
                resplit = portable.plan(self._model, [found[key] for key in keys])
                if resplit is not None:
                    return resplit
        raise ValueError(differs)

    def _newest_first(self, directory: str | None = None) -> list[str]:
        """Committed checkpoints in `directory` (default `model_dir`'s), newest first."""
        state = tf.train.get_checkpoint_state(directory or self.directory)
        return list(reversed(state.all_model_checkpoint_paths)) if state else []

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step` (in the background if `async_save`); returns its path.

        The previous checkpoint is committed first, so at most one write is
        ever in flight. A second save at the same step (a preemption right at
        a periodic save) returns the first one's path.

        Raises:
          NoSpace: this checkpoint, or the one before, did not fit on the disk.
        """
        if self._saved[0] == step:
            return self._saved[1]
        self.sync()
        prefix = os.path.join(self._write_dir, f"ckpt-{step}")
        self._save_counter.assign_add(1)  # `write` does not count saves itself
        delta = self._delta_due(step)
        try:
            if delta:
                base, since = self._base
                path = deltas.write(
                    prefix, self._deltas(), base, since, self._indexes, self._save_counter
                )
            else:
                since = deltas.marks(self._deltas()) if self._full_every else []
                path = self.checkpoint.write(prefix, options=self._options)
        except Exception as e:
            raise self._failed(step, prefix, e) from None
        self._base_steps[os.path.basename(path)] = self._base[0] if delta else None
        if self._full_every and not delta:
            self._base = (step, since)
        self._saved = (step, path)
        if self._options.enable_async and not delta:
            self._pending = (step, path)
        else:
            self._commit(step, path)
        return path

    def _delta_due(self, step: int) -> bool:
        """Whether the checkpoint of `step` is a delta: in the full one's `full_every` steps."""
        if not self.incremental or self._base is None:
            return False
        return step // self._full_every == self._base[0] // self._full_every

    def sync(self) -> None:
        """Waits for a checkpoint being written in the background and commits it.

        Raises:
          NoSpace: it did not fit on the disk (it is not committed).
        """
        if self._pending is None:
            return
        (step, path), self._pending = self._pending, None
        self.checkpoint.sync()
        error = tf_patches.take_async_checkpoint_error(self.checkpoint)
        if error is None and not tf.io.gfile.exists(path + ".index"):
            error = tf.errors.DataLossError(None, None, f"{path}.index was not written")
        if error is not None:
            raise self._failed(step, path, error) from None
        self._commit(step, path)

    def close(self) -> None:
        """Commits a pending write; removes a non-chief task's scratch directory."""
        try:
            self.sync()
        finally:
            if self._temp_dir:
                scratch.remove(self._temp_dir)

    def _commit(self, step: int, path: str) -> None:
        """Names `path` in the state file, then deletes checkpoints beyond `max_to_keep`."""
        kept = [p for p in self._newest_first(self._write_dir)[::-1] if p != path] + [path]
        dropped, kept = kept[: -self._max_to_keep], kept[-self._max_to_keep :]
        needed = set()  # the names of the full checkpoints of kept deltas
        for kept_path in kept:
            with contextlib.suppress(tf.errors.OpError):  # unreadable: restore skips it
                base = self._base_step(kept_path)
                if base is not None:
                    needed.add(f"ckpt-{base}")
        kept = [p for p in dropped if os.path.basename(p) in needed] + kept
        dropped = [p for p in dropped if p not in kept]
        lines = [f'model_checkpoint_path: "{os.path.basename(path)}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in kept]
        state = os.path.join(self._write_dir, _STATE_FILE)
        try:
            with tf.io.gfile.GFile(state + ".tmp", "w") as f:
                f.write("\n".join(lines) + "\n")
            tf.io.gfile.rename(state + ".tmp", state, overwrite=True)
        except Exception as e:
            with contextlib.suppress(tf.errors.OpError):
                tf.io.gfile.remove(state + ".tmp")
            raise self._failed(step, path, e) from None
        for old in dropped:
            _remove(old)

    def _failed(self, step: int, path: str, error: Exception) -> Exception:
        """`NoSpace` for a write that did not fit (its partial files removed); else `error`."""
        if not _is_no_space(error):
            return error
        _remove(path)
        free = ""
        with contextlib.suppress(OSError):  # not a local file system
            free = f", {shutil.disk_usage(self._write_dir).free / 2**20:.1f} MiB free"
        latest = self._newest_first(self._write_dir)
        kept = f"the last good checkpoint {latest[0]} is kept" if latest else "none was saved"
        return NoSpace(
            f"no space left in `model_dir` {self.model_dir} for checkpoint ckpt-{step}: it "
            f"needs about {self._bytes / 2**20:.1f} MiB{free}; {kept}. Free some space (or "
            "pass another `--model_dir` on a larger disk) and run again to resume."
        )


def _step_of(path: str) -> int | None:
    """The step of checkpoint `path` (`ckpt-<step>`); None if it is named otherwise."""
    named = re.fullmatch(r"ckpt-(\d+)", os.path.basename(path))
    return int(named[1]) if named else None


def _all_on_task(variables: list, local_device: str) -> bool:
    """Whether every variable lives on the task of `local_device` (or names no task)."""
    here = _TASK.match(local_device)
    for variable in variables:
        device = getattr(getattr(variable, "value", variable), "device", "") or ""
        there = _TASK.match(device)
        if there and (not here or there[0] != here[0]):
            return False
    return True


def _is_no_space(error: BaseException) -> bool:
    """Whether a write failed for lack of space (as `OSError` or TensorFlow's error)."""
    if isinstance(error, OSError) and error.errno in _NO_SPACE:
        return True
    text = str(error)
    return isinstance(error, tf.errors.ResourceExhaustedError) or any(
        t in text for t in _NO_SPACE_TEXT
    )


def _remove(path: str) -> None:
    """Deletes checkpoint `path`: its files and the staging directory of a partial write."""
    for name in tf.io.gfile.glob(path + ".*") + tf.io.gfile.glob(path + "_temp*"):
        with contextlib.suppress(tf.errors.OpError):
            if tf.io.gfile.isdir(name):
                tf.io.gfile.rmtree(name)
            else:
                tf.io.gfile.remove(name)


def _total_bytes(trackables: list) -> int:
    """Bytes of every variable of `trackables` (variables, models, optimizers), each once."""
    seen, total = set(), 0
    for trackable in trackables:
        for variable in getattr(trackable, "variables", None) or [trackable]:
            if id(variable) in seen or not hasattr(variable, "shape"):
                continue
            seen.add(id(variable))
            total += math.prod(variable.shape) * tf.as_dtype(variable.dtype).size
    return total
