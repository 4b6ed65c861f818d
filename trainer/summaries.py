"""TensorBoard event files: `model_dir/train` and `model_dir/eval`, chief only."""

from __future__ import annotations

import os

import tensorflow as tf


class Summaries:
    """Scalar and text summaries; writes nothing unless `enabled` (the chief)."""

    def __init__(self, model_dir: str, enabled: bool):
        self._model_dir = model_dir
        self._enabled = enabled
        self._writers = {}
        # One function call per loop, not one eager op per scalar: it is on every loop's path.
        self._write_scalars = tf.function(_write_scalars)

    def _writer(self, split: str):
        """The split's writer, made on first use (a sidecar evaluator writes only eval)."""
        if self._enabled and split not in self._writers:
            path = os.path.join(self._model_dir, split)
            self._writers[split] = tf.summary.create_file_writer(path)
        return self._writers.get(split)

    def scalars(self, split: str, step: int, values: dict[str, float]) -> None:
        """Writes each of `values` as a scalar at `step` under `split`."""
        writer = self._writer(split)
        if writer is None:
            return
        tensors = {name: tf.constant(value, tf.float32) for name, value in values.items()}
        self._write_scalars(writer, tf.constant(step, tf.int64), tensors)
        writer.flush()

    def text(self, name: str, text: str, step: int = 0) -> None:
        """Writes `text` (markdown) under the train split."""
        writer = self._writer("train")
        if writer is None:
            return
        with writer.as_default(step=step):
            tf.summary.text(name, text)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def _write_scalars(writer, step: tf.Tensor, values: dict[str, tf.Tensor]) -> None:
    with writer.as_default(step=step):
        for name, value in values.items():
            tf.summary.scalar(name, value)
