"""Checkpoints under `model_dir/checkpoints`, written by the chief.

Every member calls `save` (some strategies save collectively); members other
than the chief write to a private scratch directory in their own memory
(`strategies.cluster.scratch`), keep only the newest there, and `close` frees it.

With `async_save`, `save` returns once the values are copied to host memory
and a background thread writes the files, so training goes on meanwhile.
TensorFlow makes each copy on its variable's own member, so where variables
live on other members (parameter servers) saves stay synchronous: a lost ps
cannot take a checkpoint in flight with it.

A checkpoint is *committed*, named in the `checkpoint` state file that
`latest`, `restore` and a restarted job read, only once its files are
complete: a synchronous save commits at once, an asynchronous one when the
next save starts (which first waits for it), or at `sync`, `latest`,
`restore` and `close`. Old checkpoints are deleted only after a newer one is
committed. So a write that fails, because the disk is full or because a member
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

`Checkpointer` is what the loop holds; it joins parts that each own one thing:

    _Saver        (here)          what a save writes (full or delta, in the
                                  background or not), and when it is committed
    Restorer      (restore.py)    finds and restores the newest good checkpoint
    Retention     (retention.py)  the state file, and which checkpoints are kept
    Increments    (retention.py)  when a save is a delta, and the full one it builds on
"""

from __future__ import annotations

import math
import os

import tensorflow as tf

from strategies import tf_patches
from strategies.cluster import scratch
from trainer.loop import deltas
from trainer.loop.restore import LEGACY_TABLE, Restorer
from trainer.loop.retention import Increments, NoSpace, Retention
from trainer.loop.writes import TracedWrite, all_here

__all__ = ["LEGACY_TABLE", "Checkpointer", "NoSpace"]


class Checkpointer:
    """Saves and restores `objects` (model, optimizer, ...) in `model_dir`.

    It owns the `tf.train.Checkpoint` of the objects and, on a member other than
    the chief, the scratch directory written instead; its parts (see the
    module) do the saving, the restoring and the bookkeeping.
    """

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
        is_chief: whether this member writes there (others write to a scratch directory).
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
        self.resplit: str | None = None  # the line saying what the last restore re-split
        self.directory = os.path.join(model_dir, "checkpoints")
        checkpoint_bytes = _total_bytes([*variables, *objects.values()])
        model, optimizer = objects.get("model"), objects.get("optimizer")
        indexes = list(objects.get("tables", []))
        self._increments = Increments(variables, optimizer, full_every)
        objects["variables"] = list(variables)
        self.checkpoint = tf.train.Checkpoint(**objects)
        save_counter = self.checkpoint.save_counter  # created now, so every write holds it
        local = all_here(variables, save_counter.device)
        options = _options(async_save and local)
        self._temp_dir = None if is_chief else scratch.make("ckpt")
        max_to_keep = max_to_keep if is_chief else 1  # scratch holds memory: no more
        kept = Retention(model_dir, self._temp_dir or self.directory, max_to_keep, checkpoint_bytes)
        self._saver = _Saver(self.checkpoint, options, indexes, kept, self._increments, local)
        self._restorer = Restorer(
            self.checkpoint,
            self.directory,
            variables,
            model=model,
            optimizer=optimizer,
            indexes=indexes,
            retention=kept,
            increments=self._increments,
        )

    @property
    def asynchronous(self) -> bool:
        """Whether saves are written in the background (asked for, and every variable is local)."""
        return self._saver.asynchronous

    @property
    def incremental(self) -> bool:
        """Whether checkpoints between full ones are deltas (`full_every`, and dynamic tables)."""
        return self._increments.incremental

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
        restored = self._restorer.restore(path)
        if restored is None:
            return None
        path, self.resplit = restored
        return path

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step` (in the background if `async_save`); returns its path.

        The previous checkpoint is committed first, so at most one write is
        ever in flight. A second save at the same step (a preemption right at
        a periodic save) returns the first one's path.

        Raises:
          NoSpace: this checkpoint, or the one before, did not fit on the disk.
        """
        return self._saver.save(step)

    def sync(self) -> None:
        """Waits for a checkpoint being written in the background and commits it.

        Raises:
          NoSpace: it did not fit on the disk (it is not committed).
        """
        self._saver.sync()

    def close(self) -> None:
        """Commits a pending write; removes a non-chief member's scratch directory."""
        try:
            self.sync()
        finally:
            if self._temp_dir:
                scratch.remove(self._temp_dir)


class _Saver:
    """Writes the saves of a `Checkpointer` and commits them (see the module).

    It decides whether a save is full or a delta (`Increments`), writes a
    full one in the background where it may, and commits each one through
    `Retention`: a synchronous one at once, an asynchronous one when the next
    save or a `sync` finds it complete.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        options: tf.train.CheckpointOptions,
        indexes: list,
        kept: Retention,
        increments: Increments,
        local: bool,
    ):
        """Args:
        checkpoint: the checkpoint of every object, written whole by a full save.
        options: how a full save writes (`enable_async`: in the background).
        indexes: the dynamic tables' indexes, which a delta holds whole.
        kept: the directory written to, which commits and keeps the saves.
        increments: whether a save is a delta, and what it builds on.
        local: whether every variable lives on this member; else full saves go
          through one traced write (`trainer.loop.writes`).
        """
        self._checkpoint, self._options, self._indexes = checkpoint, options, indexes
        self._kept, self._increments = kept, increments
        self._save_counter = checkpoint.save_counter
        here = checkpoint.save_counter.device
        self._traced = None if local else TracedWrite(checkpoint, here, options)
        self._deltas: deltas.Writer | None = None  # made at the first delta
        self._saved: tuple[int | None, str] = (None, "")  # (step, path) of the last save
        self._pending: tuple[int, str] | None = None  # an asynchronous write not yet committed

    @property
    def asynchronous(self) -> bool:
        """Whether full saves are written in the background."""
        return self._options.enable_async

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step`; returns its path (`Checkpointer.save`)."""
        if self._saved[0] == step:
            return self._saved[1]
        self.sync()
        prefix = os.path.join(self._kept.directory, f"ckpt-{step}")
        self._save_counter.assign_add(1)  # `write` does not count saves itself
        increments = self._increments
        delta = increments.due(step)
        try:
            if delta:
                if self._deltas is None:
                    self._deltas = deltas.Writer(increments.layout(), self._indexes)
                path = self._deltas.write(prefix, *increments.base, self._save_counter)
            else:
                since = increments.marks()
                path = self._write(prefix)
        except Exception as e:
            raise self._kept.failed(step, prefix, e) from None
        self._kept.written(path, increments.base[0] if delta else None)
        if not delta:
            increments.saved_full(step, since)
        self._saved = (step, path)
        if self.asynchronous and not delta:
            self._pending = (step, path)
        else:
            self._kept.commit(step, path)
        return path

    def _write(self, prefix: str) -> str:
        """Writes a full checkpoint at `prefix`: eagerly here, or through the traced write."""
        if self._traced is None:
            return self._checkpoint.write(prefix, options=self._options)
        return self._traced(prefix)

    def sync(self) -> None:
        """Waits for a write in the background and commits it (`Checkpointer.sync`)."""
        if self._pending is None:
            return
        (step, path), self._pending = self._pending, None
        self._checkpoint.sync()
        error = tf_patches.take_async_checkpoint_error(self._checkpoint)
        if error is None and not tf.io.gfile.exists(path + ".index"):
            error = tf.errors.DataLossError(None, None, f"{path}.index was not written")
        if error is not None:
            raise self._kept.failed(step, path, error) from None
        self._kept.commit(step, path)


def _options(async_save: bool) -> tf.train.CheckpointOptions:
    """How full checkpoints are written: in the background if asked and every variable is here.

    TF's background write reads a copy made on each variable's own member: with
    variables on other members (parameter servers), a checkpoint in flight would
    die with them, so it is written before `save` returns (the caller passes
    `async_save` only where every variable is here).
    """
    if async_save:
        tf_patches.keras_variables_save_asynchronously()
    return tf.train.CheckpointOptions(enable_async=async_save)


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
