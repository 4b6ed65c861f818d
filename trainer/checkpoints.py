"""Checkpoints under `model_dir/checkpoints`, written by the chief.

Every task calls `save` (some strategies save collectively); tasks other
than the chief write to a private temporary directory that `close` removes.

With `async_save`, `save` returns once the values are copied to host memory
and a background thread writes the files, so training goes on meanwhile.
Everything that reads checkpoints (`latest`, `restore`) and `close` first
waits for a pending write, so a checkpoint is never read half-written and
the last one is complete before the process exits.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import keras
import tensorflow as tf

from strategies.errors import UserError


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
        **objects,
    ):
        """Args:
        model_dir: the checkpoints go to `model_dir/checkpoints`.
        is_chief: whether this task writes there (others write to a temporary directory).
        max_to_keep: how many checkpoints to keep.
        variables: every model variable; saved as a list and checked by shape on restore.
        async_save: write checkpoint files in the background.
        **objects: other trackables to save (model, optimizer, ...).
        """
        self.directory = os.path.join(model_dir, "checkpoints")
        self._shapes = {  # checkpoint key -> (variable name, shape)
            f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE": (
                getattr(v, "path", None) or v.name,
                tuple(v.shape),
            )
            for i, v in enumerate(variables)
        }
        objects["variables"] = list(variables)
        self._options = tf.train.CheckpointOptions(enable_async=async_save)
        if async_save:
            _let_keras_variables_save_asynchronously()
        self._temp_dir = None if is_chief else tempfile.mkdtemp(prefix="towerflow-ckpt-")
        self._saved: tuple[int | None, str] = (None, "")  # (step, path) of the last save
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self._temp_dir or self.directory, max_to_keep=max_to_keep
        )

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
        for candidate in [path] if path else self._newest_first():
            try:
                self._check_shapes(candidate)
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

    def _check_shapes(self, path: str) -> None:
        """Refuses a checkpoint whose variable list or shapes differ from `shapes`.

        TensorFlow does not always refuse one itself (a mirrored variable can
        skip a mismatched value silently), so compare before restoring.
        """
        found = tf.train.load_checkpoint(path).get_variable_to_shape_map()
        for key, (name, shape) in self._shapes.items():
            if key not in found or tuple(found[key]) != tuple(shape):
                there = tuple(found[key]) if key in found else "absent"
                raise ValueError(f"`{name}` is {there} there and {tuple(shape)} here")
        saved = [k for k in found if k.startswith("variables/")]
        if len(saved) > len(self._shapes):
            raise ValueError(f"it has {len(saved)} model variables, this model {len(self._shapes)}")

    def _newest_first(self) -> list[str]:
        state = tf.train.get_checkpoint_state(self.directory)
        return list(reversed(state.all_model_checkpoint_paths)) if state else []

    def save(self, step: int) -> str:
        """Writes a checkpoint for `step` (in the background if `async_save`); returns its path.

        A second save at the same step (a preemption right at a periodic save)
        returns the first one's path.
        """
        if self._saved[0] != step:
            self._saved = (step, self.manager.save(checkpoint_number=step, options=self._options))
        return self._saved[1]

    def sync(self) -> None:
        """Waits until a checkpoint being written in the background is complete."""
        if self._options.enable_async:
            self.checkpoint.sync()

    def close(self) -> None:
        """Finishes a pending write; removes a non-chief task's temporary checkpoint directory."""
        self.sync()
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


def _let_keras_variables_save_asynchronously() -> None:
    """Lets TF's asynchronous saver copy Keras variables more than once.

    Keras 3's `Variable._copy_trackable_to_cpu` makes a new `tf.Variable` each
    time, and TF calls it inside a `tf.function`, where only the first trace may
    create variables: the second asynchronous save fails. TF already keeps a
    host copy of the wrapped `tf.Variable` up to date, and the Keras variable
    saves exactly that value, so it can share that copy.
    """

    def copy_to_cpu(variable, object_map):
        variable.value._copy_trackable_to_cpu(object_map)
        object_map[variable] = object_map[variable.value]

    keras.Variable._copy_trackable_to_cpu = copy_to_cpu


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]
