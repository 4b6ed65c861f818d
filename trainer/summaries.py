"""TensorBoard event files: `model_dir/train` and `model_dir/eval`, chief only."""

from __future__ import annotations

import os

import tensorflow as tf


class Summaries:
    """Scalar and text summaries; writes nothing unless `enabled` (the chief)."""

    def __init__(self, model_dir: str, enabled: bool):
        self._writers = {}
        if enabled:
            for split in ("train", "eval"):
                self._writers[split] = tf.summary.create_file_writer(os.path.join(model_dir, split))

    def scalars(self, split: str, step: int, values: dict[str, float]) -> None:
        """Writes each of `values` as a scalar at `step` under `split`."""
        writer = self._writers.get(split)
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)
        writer.flush()

    def text(self, name: str, text: str, step: int = 0) -> None:
        """Writes `text` (markdown) under the train split."""
        writer = self._writers.get("train")
        if writer is None:
            return
        with writer.as_default(step=step):
            tf.summary.text(name, text)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
