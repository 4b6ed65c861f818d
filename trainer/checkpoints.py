"""Checkpoints under `model_dir/checkpoints`, written by the chief.

Every task calls `save` (some strategies save collectively); tasks other
than the chief write to a private temporary directory that `close` removes.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from strategies.errors import UserError


class Checkpointer:
    """Saves and restores `objects` (model, optimizer, ...) in `model_dir`."""

    def __init__(self, model_dir: str, is_chief: bool, max_to_keep: int, **objects):
        self.directory = os.path.join(model_dir, "checkpoints")
        self._temp_dir = None if is_chief else tempfile.mkdtemp(prefix="towerflow-ckpt-")
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self._temp_dir or self.directory, max_to_keep=max_to_keep
        )

    @property
    def latest(self) -> str | None:
        """The newest checkpoint in `model_dir`, or None."""
        return tf.train.latest_checkpoint(self.directory)

    def restore(self, path: str | None = None) -> str | None:
        """Restores checkpoint `path` (default: the newest, if any); returns its path.

        Raises:
          UserError: the checkpoint belongs to a different model or optimizer.
        """
        path = path or self.latest
        if path is None:
            return None
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as e:
            reason = str(e).strip().splitlines()[0][:200]
            raise UserError(
                f"`model_dir` holds checkpoint '{path}' of a different model or optimizer "
                f"({reason}); use a new `--model_dir`, or the config that wrote it."
            ) from None
        return path

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step`; returns its path."""
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        """Removes a non-chief task's temporary checkpoint directory."""
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
