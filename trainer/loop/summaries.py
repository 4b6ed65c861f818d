"""TensorBoard event files: `model_dir/train` and `model_dir/eval`, chief only.

`model_dir` itself holds the run's hyper-parameters for the HParams dashboard:
`model_dir` is one session, and the scalars of its `train` and `eval` runs are
the session's metrics (`loss` in group `train`, `accuracy` in group `eval`, ...),
so `tensorboard --logdir <sweep dir>` compares the trials of a sweep.

The events are built as protocol buffers in Python (TensorBoard's own
`*_pb` helpers and its scalar form: a float32 tensor with the `scalars`
plugin's metadata, as `tf.summary.scalar` writes it) and appended with
`tf.io.TFRecordWriter`, the event file's record format: a loop's scalars
cost no TensorFlow op and no traced call. They are on every loop's path:
after a loop of `dense_large` (`python -m trainer.bench`) the summaries and
the progress line take 0.3 ms, where `tf.summary` made them 2.1 ms.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping

import ml_collections
import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.util import tensor_util

HPARAMS_SPLIT = ""  # the session's own run: `model_dir`, the parent of `train` and `eval`

_SCALAR = scalar_metadata.create_summary_metadata(display_name="", description="")
_HISTOGRAM = histogram_metadata.create_summary_metadata(display_name="", description="")
_FILES = itertools.count()  # tells apart the event files one process opens in one second


class Summaries:
    """Scalars, histograms, text and hyper-parameters; writes nothing unless `enabled` (chief)."""

    def __init__(self, model_dir: str, enabled: bool):
        self._model_dir = model_dir
        self._enabled = enabled
        self._writers: dict[str, EventFile] = {}

    def _writer(self, split: str) -> EventFile | None:
        """The split's event file, made on first use (a sidecar evaluator writes only eval)."""
        if self._enabled and split not in self._writers:
            self._writers[split] = EventFile(os.path.join(self._model_dir, split))
        return self._writers.get(split)

    def scalars(self, split: str, step: int, values: dict[str, float]) -> None:
        """Writes each of `values` as a scalar at `step` under `split`."""
        writer = self._writer(split)
        if writer is None:
            return
        writer.write(step, [_scalar(name, value) for name, value in values.items()])

    def histograms(self, split: str, step: int, counts: dict[str, np.ndarray]) -> None:
        """Writes each of `counts` (counts of the values 0, 1, 2, ...) as a histogram at `step`."""
        writer = self._writer(split) if counts else None
        if writer is None:
            return
        summary = []
        for name, bucket_counts in counts.items():
            # The histogram plugin's own form, one bucket per value: rows (left, right, count).
            values = np.arange(len(bucket_counts), dtype=np.float64)
            buckets = np.stack([values - 0.5, values + 0.5, bucket_counts], axis=1)
            tensor = tensor_util.make_tensor_proto(buckets)
            summary.append(summary_pb2.Summary.Value(tag=name, metadata=_HISTOGRAM, tensor=tensor))
        writer.write(step, summary)

    def hparams(self, config: ml_collections.ConfigDict, trial_id: str) -> None:
        """Writes the whole resolved `config`, flattened, as the run's hyper-parameters.

        Call once, at the start of a run: each start of a run writes them again,
        and TensorBoard shows the first.

        Args:
          config: the run's config; see `flat_hparams`.
          trial_id: the session's name in the dashboard (e.g. the trial's directory name).
        """
        writer = self._writer(HPARAMS_SPLIT)
        if writer is not None:
            writer.write(0, hp.hparams_pb(flat_hparams(config), trial_id=trial_id).value)

    def text(self, name: str, text: str, step: int = 0) -> None:
        """Writes `text` (markdown) under the train split."""
        writer = self._writer("train")
        if writer is not None:
            writer.write(step, text_summary.text_pb(name, text).value)

    def close(self) -> None:
        """Flushes and closes every event file."""
        for writer in self._writers.values():
            writer.close()


class EventFile:
    """One event file in `directory`: the file version first, then one event per `write`.

    Named as TensorFlow's writers name theirs, so TensorBoard reads it as one
    of the directory's files (a restarted run adds a file; the newest is
    the one TensorBoard follows). Each `write` is flushed: a reader sees whole
    events as they come.
    """

    def __init__(self, directory: str):
        tf.io.gfile.makedirs(directory)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_FILES)}.v2"
        )
        self._records = tf.io.TFRecordWriter(os.path.join(directory, name))
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, step: int, values) -> None:
        """One event at `step` holding the summary `values` (`Summary.Value`s)."""
        summary = summary_pb2.Summary(value=values)
        self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: event_pb2.Event) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def close(self) -> None:
        self._records.close()


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


def _scalar(name: str, value: float) -> summary_pb2.Summary.Value:
    """`value` as `tf.summary.scalar` writes it: a float32 scalar tensor, the scalars plugin's."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value])
    tensor.tensor_shape.SetInParent()  # a scalar: a shape with no dimensions
    return summary_pb2.Summary.Value(tag=name, metadata=_SCALAR, tensor=tensor)
