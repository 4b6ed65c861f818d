"""How many records a file of `data.follow` holds, reading as little as its format allows.

A followed file is counted when it is found, before it is trained (a block is
planned from the records waiting, `trainer.data.follow`):

- TFRecord: from its length headers alone. Each record is an 8-byte length,
  its 4-byte CRC, the data and the data's 4-byte CRC: 12 bytes are read a
  record and the data is skipped by a seek. A file whose framing does not end
  at its size (compressed, or not TFRecord) is counted through its reader.
- CSV: a scan of its bytes for line ends, less the header. CSV has no framing
  to skip by; nothing is parsed.
- A source that drops incomplete records (`data.incomplete=drop`) may hold
  fewer than its framing says, and a user's `dataset_fn` given `files` alone
  knows its records: counted through the reader, a second read of the file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import ml_collections
import tensorflow as tf

CountFile = Callable[[str], int]  # one file name -> how many records it holds
_READ_AT_ONCE = 1 << 20  # bytes read at a time when a CSV file's lines are counted


def count_records(records: tf.data.Dataset) -> int:
    """How many elements `records` yields: a whole read."""
    return int(records.reduce(tf.constant(0, tf.int64), _plus_one))


def _plus_one(count: tf.Tensor, _) -> tf.Tensor:
    return count + 1


def tfrecord_count(path: str) -> int | None:
    """Records of a TFRecord file from its length headers alone; None if its framing is off.

    Each record is an 8-byte little-endian length, its 4-byte CRC, the data and
    the data's 4-byte CRC: the data is skipped by a seek, never read.
    """
    size, at, records = tf.io.gfile.stat(path).length, 0, 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while at < size:
            header = f.read(12)
            if len(header) < 12:
                return None
            (length,) = struct.unpack("<Q", header[:8])
            at += 12 + length + 4
            if at > size:
                return None
            f.seek(at)
            records += 1
    return records if at == size else None


def csv_count(path: str) -> int:
    """Records of a CSV file with a header: its lines less one, counted without parsing."""
    lines, last = 0, b"\n"
    with tf.io.gfile.GFile(path, "rb") as f:
        while chunk := f.read(_READ_AT_ONCE):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    lines += last != b"\n"  # a last line without its end still counts
    return max(0, lines - 1)


def counter(config: ml_collections.ConfigDict) -> CountFile | None:
    """How the source of `config` counts a file without reading it; None: through its reader.

    A source that drops incomplete records (`data.incomplete=drop`) may hold fewer
    than its framing says: only its reader tells.
    """
    if config.get("incomplete", "error") == "drop":
        return None
    if config.name == "csv":
        return csv_count
    if config.name == "tfrecord":
        return _framed_or_read
    return None


def _framed_or_read(path: str) -> int:
    counted = tfrecord_count(path)
    if counted is None:  # not framed as TFRecord (compressed?): the reader says why
        return count_records(tf.data.TFRecordDataset(path))
    return counted
