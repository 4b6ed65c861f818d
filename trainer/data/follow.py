"""Training files that keep arriving (`data.follow=true`): read once each, in name order.

With `data.follow` a file source (`csv`, `tfrecord`, or a user's `dataset_fn`
that takes `files`, `trainer.data.user`) trains on the files of
`data.train_files` as they appear, through `tf.io.gfile` (so a bucket works):

- *ready*: a file counts once its name matches `data.train_files` and its
  base name does not start with `.` or `_`. A writer writes `.name` or
  `_name` (or anywhere outside the glob) and renames it into place when it
  is complete; a rename is atomic on a local disk and on object stores, so a
  half-written file is never read.
- *order*: files are trained on in name order, each exactly once, unshuffled
  (shuffle when writing them). A file that appears with a name sorting before
  the one being trained on is never read (name the files by time, e.g.
  `clicks-20261127-2110.csv`).
- *position*: the file being trained on and the records of it already
  trained on are two variables (`Position`) saved in every checkpoint, so a
  restarted run goes on with the next record. The position at a step is
  where the batches of the steps so far end: `records trained = steps x
  global batch`, counted along the files' record counts (each file is
  counted once when it is found, by reading it).
- *waiting*: training runs whole blocks (`train.steps_per_loop` steps); a
  block starts once the ready files hold its examples (`Follower.wait`),
  polled every `data.follow_poll_secs`. SIGTERM while waiting saves and
  exits as always.

The backlog (records and files waiting, and how far the file being trained
on is behind the newest: the difference of their modification times) is
added to each block's metrics (`Follower.figures`).

Strategies whose steps take their batches in order (`Traits.ordered_input`):
`one_device`, `mirrored`, and `multi_worker`, where each worker's input
pipeline follows the same files and keeps its share of each global batch of
the one record stream (its per-replica batches of it, `Dataset.shard`), so a
step trains on the next global batch whatever the number of workers, and the
position (the same on every worker) is the chief's to save and every
worker's to restore. A block starts once the files hold its examples on
every worker (`Follower.wait`'s `everyone`: a worker whose view of the files
lags holds the others back). Asynchronous workers (`parameter_server`) take
batches as they come: refused (`trainer.loop.train`). The sources' start-up
checks (a CSV's every value) cover the files there at start, later ones are
read with the spec found then.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data import user
from trainer.data.base import (
    Dataset,
    DatasetFn,
    Decode,
    TrainStreamWrapper,
    file_split,
    ready,
)

ReadFile = Callable[[tf.Tensor], tf.data.Dataset]  # one file name -> its records


class Position(tf.Module):
    """Where training is in the files: a file's name and the records of it trained on."""

    def __init__(self):
        super().__init__(name="follow")
        self.file = tf.Variable("", dtype=tf.string, trainable=False, name="file")
        self.offset = tf.Variable(0, dtype=tf.int64, trainable=False, name="offset")


@dataclasses.dataclass
class _File:
    name: str
    records: int
    mtime: float  # seconds since the epoch


class Follower:
    """The files of one glob as they appear, and the position of training in them.

    Args:
      pattern: `data.train_files`.
      read: one file name -> its records (the source's own reader).
      poll_secs: seconds between looks for new files while waiting.
    """

    def __init__(self, pattern: str, read: ReadFile, poll_secs: float):
        self.pattern, self.read, self.poll_secs = pattern, read, poll_secs
        self.position = Position()
        self._files: list[_File] = []  # from the file being trained on, in name order
        self._offset = 0  # records of `_files[0]` trained on
        self._found = threading.Condition()  # guards the two above; notified as files come
        self._closed = False
        self._last_look = 0.0  # time.monotonic() of the last `refresh`

    def start(self) -> None:
        """Reads the (restored) position and finds the files from there on."""
        with self._found:
            self._files, self._offset = [], int(self.position.offset.numpy())
            self._closed = False
        self.refresh(first=self.position.file.numpy().decode())

    def close(self) -> None:
        """Ends the stream's wait for files (the loop is over)."""
        with self._found:
            self._closed = True
            self._found.notify_all()

    def refresh(self, first: str = "") -> None:
        """Adds the ready files that sort after the last one known (from `first` at the start)."""
        self._last_look = time.monotonic()
        with self._found:
            last = self._files[-1].name if self._files else None
        found = sorted(p for p in tf.io.gfile.glob(self.pattern) if ready(p))
        if last is not None:
            found = [p for p in found if p > last]
        elif first:
            found = [p for p in found if p >= first]
        new = [_File(p, self._count(p), tf.io.gfile.stat(p).mtime_nsec / 1e9) for p in found]
        with self._found:
            if last is None and first and (not new or new[0].name != first):
                self._offset = 0  # the file of the position is gone: its next one from the start
            self._files.extend(new)
            self._drop_done()
            self._found.notify_all()

    def look_if_due(self) -> None:
        """`refresh` if `poll_secs` have passed since the last look (keeps the backlog current)."""
        if time.monotonic() - self._last_look >= self.poll_secs:
            self.refresh()

    def _count(self, path: str) -> int:
        return int(self.read(tf.constant(path)).reduce(tf.constant(0, tf.int64), _plus_one))

    def waiting(self) -> int:
        """Records in the ready files not trained on yet."""
        with self._found:
            return sum(f.records for f in self._files) - self._offset

    def advance(self, records: int) -> None:
        """Moves the position on by `records` trained on; writes it to `position`."""
        with self._found:
            self._offset += records
            self._drop_done()
            name = self._files[0].name if self._files else ""
            self.position.file.assign(name)
            self.position.offset.assign(self._offset)

    def _drop_done(self) -> None:
        """Forgets the files trained on whole, while a later one is known (under the lock)."""
        while len(self._files) > 1 and self._offset >= self._files[0].records:
            self._offset -= self._files.pop(0).records

    def wait(
        self,
        records: int,
        still_waiting: Callable[[], None],
        everyone: Callable[[bool], bool] = bool,
    ) -> None:
        """Returns once the ready files hold `records` not trained on.

        `still_waiting()` is called between looks (on the main thread, so it
        may act on SIGTERM: raise to stop waiting). `everyone(ready)` says
        whether every worker that steps with this one is ready (it is this
        one's `ready` alone): all of them look, and call `still_waiting`, the
        same number of times, as a coordinated preemption watch needs.
        """
        while not everyone(self.waiting() >= records):
            still_waiting()
            time.sleep(self.poll_secs)
            self.refresh()

    def figures(self) -> dict[str, float]:
        """The backlog: `files_waiting`, `records_waiting` and `seconds_behind` the newest file."""
        with self._found:
            files = list(self._files)
            offset = self._offset
        left = sum(f.records for f in files) - offset
        # Not started: the files after the current one, and the current one if untouched.
        unread = [f for i, f in enumerate(files) if (i > 0 or offset == 0) and f.records]
        behind = files[-1].mtime - files[0].mtime if files and left else 0.0
        return {
            "files_waiting": float(len(unread)),
            "records_waiting": float(left),
            "seconds_behind": max(0.0, behind),
        }

    def names(self):
        """The stream's files from the position on: (name, records to skip), waiting for more.

        Runs on a tf.data thread: it only reads the files that `refresh` found.
        """
        handed, skip = None, None
        while True:
            with self._found:
                if skip is None:  # the first file: the records trained on are skipped
                    skip = self._offset
                pending = [f.name for f in self._files if handed is None or f.name > handed]
                while not pending and not self._closed:
                    self._found.wait()
                    pending = [f.name for f in self._files if handed is None or f.name > handed]
                if self._closed:
                    return
            for name in pending:
                yield name, skip if handed is None else 0
                handed = name


def _plus_one(count: tf.Tensor, _) -> tf.Tensor:
    return count + 1


@dataclasses.dataclass(frozen=True)
class FollowedDataset(TrainStreamWrapper):
    """A file source whose training stream follows its files (`data.follow`)."""

    follower: Follower | None = None
    decode: Decode | None = None

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The files from the checkpointed position on, in order; `seed`, `start_*` unused.

        Every pipeline reads the whole stream of records in per-replica batches
        and keeps batches `p, p + P, ...` (pipeline `p` of `P`): each step takes
        the stream's next `global_batch_size` records over all pipelines.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            self.follower.start()
            names = tf.data.Dataset.from_generator(
                self.follower.names,
                output_signature=(tf.TensorSpec((), tf.string), tf.TensorSpec((), tf.int64)),
            )
            records = names.flat_map(lambda name, skip: self.follower.read(name).skip(skip))
            batch = context.get_per_replica_batch_size(global_batch_size)
            batches = records.batch(batch, drop_remainder=True)
            if context.num_input_pipelines > 1:  # this pipeline's share of each global batch
                batches = batches.shard(context.num_input_pipelines, context.input_pipeline_id)
            batches = batches.map(self.decode, num_parallel_calls=tf.data.AUTOTUNE)
            return self.settings.apply(batches.prefetch(tf.data.AUTOTUNE))

        return dataset_fn


def wrap(dataset: Dataset, config: ml_collections.ConfigDict) -> Dataset:
    """`dataset` with its training stream following its files when `data.follow` is set.

    Raises:
      UserError: `data.follow` with a source that reads no files, or a poll interval <= 0.
    """
    if not config.get("follow", False):
        return dataset
    reader = _reader(dataset)
    if reader is None:
        raise UserError(
            f"`data.follow` trains on files as they arrive, and `data.name` '{config.name}' "
            "reads no files; use `csv` or `tfrecord` with `data.train_files` (or give your "
            "`dataset_fn` a `files` parameter), or set `--config.data.follow=false`."
        )
    poll = config.follow_poll_secs
    if poll <= 0:
        raise UserError(
            f"`data.follow_poll_secs` ({poll}) must be > 0 (seconds between looks for new "
            "files); set e.g. `--config.data.follow_poll_secs=1`."
        )
    read, decode = reader
    return FollowedDataset(dataset, Follower(config.train_files, read, poll), decode)


def _reader(dataset: Dataset) -> tuple[ReadFile, Decode] | None:
    """How `dataset` reads one training file's records and decodes a batch; None if it cannot."""
    split = file_split(dataset)
    if split is not None:
        return split.read, split.decode
    if isinstance(dataset, user.PipelineDataset) and dataset.files is not None:
        return dataset.read_file, _as_is  # its examples are decoded already
    return None


def _as_is(*batch):
    return batch  # `(features, labels[, sample_weights])`, which `Dataset.map` unpacks


def follower_of(dataset: Dataset) -> Follower | None:
    """The `Follower` of a `FollowedDataset`, else None."""
    return dataset.follower if isinstance(dataset, FollowedDataset) else None
