"""Checkpoints under `model_dir/checkpoints`, written by the chief.

Every task calls `save` (some strategies save collectively); tasks other
than the chief write to a private temporary directory that `close` removes.
"""

from __future__ import annotations

import os
import shutil
import sys
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
        """Restores checkpoint `path`, or else the newest readable one; returns its path.

        A truncated or corrupt newest checkpoint is skipped with a warning that
        names it, and the one before is used.

        Raises:
          UserError: the checkpoint belongs to a different model or optimizer.
        """
        for candidate in [path] if path else self._newest_first():
            try:
                self.checkpoint.restore(candidate).assert_existing_objects_matched()
                return candidate
            except (
                tf.errors.OpError,  # data loss, missing or unreadable shards
                IndexError,  # a truncated file: "Read less bytes than requested"
            ) as e:
                if path:
                    raise
                print(
                    f"warning: checkpoint {candidate} is unreadable ({_first_line(e)}); "
                    "trying the one before",
                    file=sys.stderr,
                    flush=True,
                )
            except (AssertionError, ValueError) as e:
                raise UserError(
                    f"`model_dir` holds checkpoint '{candidate}' of a different model or "
                    f"optimizer ({_first_line(e)[:200]}); use a new `--model_dir`, or the "
                    "config that wrote it."
                ) from None
        return None

    def _newest_first(self) -> list[str]:
        state = tf.train.get_checkpoint_state(self.directory)
        return list(reversed(state.all_model_checkpoint_paths)) if state else []

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step`; returns its path."""
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        """Removes a non-chief task's temporary checkpoint directory."""
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]
