"""Finding and restoring the newest good checkpoint, a part of `trainer.loop.checkpoints`.

`Restorer` tries the committed checkpoints newest first: it skips an
unreadable one with a warning, refuses one of another model or optimizer
(comparing the variables' shapes first, since TensorFlow does not always),
restores one written with another split of the tables and sharded layers
through `trainer.loop.portable`, and a delta as its full checkpoint with the
delta replayed over it (`trainer.loop.deltas`).
"""

from __future__ import annotations

import os
import re
import sys

import tensorflow as tf

from towerflow.errors import UserError, one_line
from trainer.layers import table_seen
from trainer.loop import deltas, portable
from trainer.loop.retention import Increments, Retention, newest_first

# The slot -> id table of dynamic tables' indexes before it joined the slot -> (stamp,
# last-seen step) table (`trainer.layers.tables`): its checkpoints are refused.
LEGACY_TABLE = "slot_keys"


class Restorer:
    """Restores a checkpoint of `model_dir`, or the newest one that reads, into the objects.

    It owns the checks that a checkpoint fits this model (`_check_shapes`) and
    the order of a restore: the full checkpoint, then the deltas' base
    (`Increments`), then a delta replayed over it.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        directory: str,
        variables: list,
        *,
        model,
        optimizer,
        indexes: list,
        retention: Retention,
        increments: Increments,
    ):
        """Args:
        checkpoint: the checkpoint of every object, `variables` among them.
        directory: the committed checkpoints to restore the newest of.
        variables: every model variable, checked by shape before a restore.
        model: the model, to restore a checkpoint of another split (None: refused).
        optimizer: the optimizer, likewise.
        indexes: the dynamic tables' indexes, which a delta holds whole.
        retention: which full checkpoint each delta builds on.
        increments: told which full checkpoint deltas build on after a restore.
        """
        self._checkpoint, self._directory = checkpoint, directory
        self._model, self._optimizer, self._indexes = model, optimizer, indexes
        self._retention, self._increments = retention, increments
        self._save_counter = checkpoint.save_counter
        self._shapes = {  # checkpoint key -> (variable name, shape)
            f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE": (
                getattr(v, "path", None) or v.name,
                tuple(v.shape),
            )
            for i, v in enumerate(variables)
        }

    def restore(self, path: str | None = None) -> tuple[str, str | None] | None:
        """Restores checkpoint `path`, or else the newest readable one.

        A truncated or corrupt newest checkpoint is skipped with a warning that
        names it, and the one before is used.

        Returns:
          The path restored and the line saying what it re-split (None: nothing),
          or None when there is no checkpoint.

        Raises:
          UserError: the checkpoint belongs to a different model or optimizer.
        """
        for candidate in [path] if path else newest_first(self._directory):
            try:
                return candidate, self._restore_one(candidate)
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

    def _restore_one(self, path: str) -> str | None:
        """Restores checkpoint `path`; returns the line saying what it re-split (None: nothing).

        Raises:
          AssertionError, ValueError: it does not fit these objects.
        """
        full = self._retention.full_of(path)
        delta = path if full != path else None
        resplit = self._check_shapes(full)
        if resplit is None:
            table_seen.restore_matched(self._checkpoint, full, self._indexes)
            self._increments.restored_full(_step_of(full))
            if delta is not None:
                deltas.replay(delta, self._increments.layout(), self._indexes, self._save_counter)
            return None
        line, warnings = portable.restore(full, resplit, self._optimizer, self._save_counter, delta)
        self._increments.forget()  # the rows moved to other slots: the next save is full
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        return line

    def _check_shapes(self, path: str) -> portable.RestorePlan | None:
        """Refuses a checkpoint whose variable list or shapes differ from `shapes`.

        TensorFlow does not always refuse one itself (a mirrored variable can
        skip a mismatched value silently), so compare before restoring. Where
        they differ only by the split of tables and sharded layers, returns the
        plan to restore it by.

        Raises:
          UserError: it holds dynamic tables in the earlier index format.
          ValueError: it differs otherwise.
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
        differs = self._difference(found)
        if differs is None:
            return None
        saved = [k for k in found if k.startswith("variables/")]
        if self._model is not None and self._optimizer is not None:
            keys = [f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(len(saved))]
            if all(key in found for key in keys):
                resplit = portable.plan(self._model, [found[key] for key in keys])
                if resplit is not None:
                    return resplit
        raise ValueError(differs)

    def _difference(self, found: dict[str, list[int]]) -> str | None:
        """How the model variables of a checkpoint (`found`: key -> shape) differ from ours."""
        for key, (name, shape) in self._shapes.items():
            if key not in found or tuple(found[key]) != tuple(shape):
                there = tuple(found[key]) if key in found else "absent"
                return f"`{name}` is {there} there and {tuple(shape)} here"
        saved = [k for k in found if k.startswith("variables/")]
        if len(saved) > len(self._shapes):
            return f"it has {len(saved)} model variables, this model {len(self._shapes)}"
        return None


def _step_of(path: str) -> int | None:
    """The step of checkpoint `path` (`ckpt-<step>`); None if it is named otherwise."""
    named = re.fullmatch(r"ckpt-(\d+)", os.path.basename(path))
    return int(named[1]) if named else None
