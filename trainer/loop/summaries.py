"""TensorBoard event files: `model_dir/train` and `model_dir/eval`, chief only.

`model_dir` itself holds the run's hyper-parameters for the HParams dashboard:
`model_dir` is one session, and the scalars of its `train` and `eval` runs are
the session's metrics (`loss` in group `train`, `accuracy` in group `eval`, ...),
so `tensorboard --logdir <sweep dir>` compares the trials of a sweep.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import ml_collections
import numpy as np
import tensorflow as tf
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.hparams import api as hp

HPARAMS_SPLIT = ""  # the session's own run: `model_dir`, the parent of `train` and `eval`


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
        # The step and the values in one tensor (float64 holds steps up to 2**53 exactly): one
        # eager op and one call after every loop, where each eager op costs.
        packed = tf.constant([step, *values.values()], tf.float64)
        self._write_scalars(writer, tuple(values), packed)
        writer.flush()

    def histograms(self, split: str, step: int, counts: dict[str, np.ndarray]) -> None:
        """Writes each of `counts` (counts of the values 0, 1, 2, ...) as a histogram at `step`."""
        writer = self._writer(split) if counts else None
        if writer is None:
            return
        # The histogram plugin's own form, one bucket per value: rows (left, right, count).
        metadata = histogram_metadata.create_summary_metadata(display_name="", description="")
        with writer.as_default(step=step):
            for name, bucket_counts in counts.items():
                values = np.arange(len(bucket_counts), dtype=np.float64)
                buckets = np.stack([values - 0.5, values + 0.5, bucket_counts], axis=1)
                tf.summary.write(name, tf.constant(buckets, tf.float64), metadata=metadata)
        writer.flush()

    def hparams(self, config: ml_collections.ConfigDict, trial_id: str) -> None:
        """Writes the whole resolved `config`, flattened, as the run's hyper-parameters.

        Call once, at the start of a run: each start of a run writes them again,
        and TensorBoard shows the first.

        Args:
          config: the run's config; see `flat_hparams`.
          trial_id: the session's name in the dashboard (e.g. the trial's directory name).
        """
        writer = self._writer(HPARAMS_SPLIT)
        if writer is None:
            return
        with writer.as_default():
            hp.hparams(flat_hparams(config), trial_id=trial_id)
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
        """Flushes and closes every writer."""
        for writer in self._writers.values():
            writer.close()


def flat_hparams(
    config: ml_collections.ConfigDict | Mapping, prefix: str = ""
) -> dict[str, bool | int | float | str]:
    """`config` as `{"optimizer.learning_rate": 0.001, ...}`: HParams take only scalars.

    Numbers, strings and booleans stay as they are; anything else (tuples such
    as `model.hidden_units`, None) becomes its `repr`, as it would be typed in
    a `--config.a.b=` override.
    """
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict | Mapping):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = repr(value)
    return flat


def _write_scalars(writer, names: tuple[str, ...], packed: tf.Tensor) -> None:
    """Writes `packed[1:]` as float32 scalars `names` at step `packed[0]`."""
    with writer.as_default(step=tf.cast(packed[0], tf.int64)):
        for i, name in enumerate(names):
            tf.summary.scalar(name, tf.cast(packed[i + 1], tf.float32))
