"""Training files that keep arriving (`data.follow=true`): each record once, in arrival order.

With `data.follow` a file source (`csv`, `tfrecord`, or a user's `dataset_fn`
that takes `files`, `trainer.data.user`) trains on the files of
`data.train_files` as they appear, through `tf.io.gfile` (so a bucket works).
docs/online.md states the rules for users; here is how they hold.

- *ready*: a file counts once its name matches `data.train_files` and its
  base name does not start with `.` or `_` (`base.ready`: written under such
  a name, renamed into place whole). With `data.follow_marker` (e.g.
  `_SUCCESS`, as Spark and Hive write last) a file counts only once its
  directory holds the marker: a partition is complete when its marker lands.
- *arrival order*: a file's key is (modification time, name); in marker mode
  the time is the later of the file's and its marker's. Each look's new files
  join the stream after those found before, in key order, whatever their
  names: parallel writers and late partitions are trained once each. A file
  found whose key is below the newest already found is *late*: one line names
  it, and it trains once like any other.
- *position* (`Position`, in every checkpoint): which files are done, not a
  place in name order. Every file whose key is at or below the *watermark* is
  done; so is every file named in `done` (keys above it); a file partly
  trained has its trained record ranges in `partial`. Memory stays bounded:
  once `done` names more than `data.follow_horizon_files` files, the oldest
  leave it and the watermark rises to their keys (never past a file found but
  not done). A file found later with a key at or below the watermark cannot be
  told from one trained long ago: it is refused in one line (at a restart the
  first look counts them in one line: taken as trained).
- *units*: a range of a file (file, first record, records). The synchronous
  stream (`one_device`, `mirrored`, `multi_worker`) admits each file's
  not-done ranges in order; `advance` marks the records of the steps trained
  done. For workers that take work as they are free (a parameter-server
  coordinator), `take_unit` hands out the next range not done and not out, and
  `unit_done` marks it done; a unit handed out but not done at a checkpoint is
  not in it, so a restart hands it out again.
- *counting*: a block is planned from the records waiting, so each file is
  counted when found, reading as little as its format allows
  (`trainer.data.counting`).
- *fresh*: a block runs on the whole global batches waiting (a short block if
  they do not fill one). A remainder short of a global batch waits for more
  records at most `data.follow_max_wait_secs` after its file was found, then
  trains as one step padded to the global batch with records of weight 0: the
  step's loss and gradient weigh what it holds.
- *removed*: a file found, or partly trained, that disappears before it is
  trained whole: one line says how many of its records never trained.

Under `multi_worker` every worker's pipeline follows the same files and
keeps its share of each global batch of the one record stream
(`Dataset.shard`); the workers agree (the membership's `agree` and
`everyone`) on which files join the stream, and on padding a remainder, so
all streams stay one. A block starts once the files hold its records on
every worker.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data import counting, user
from trainer.data.base import (
    Dataset,
    DatasetFn,
    Decode,
    TrainStreamWrapper,
    file_split,
    ready,
)

ReadFile = Callable[[tf.Tensor], tf.data.Dataset]  # one file name -> its records
Agree = Callable[[int], int]  # the chief's value on every worker (`Membership.agree`)
Key = tuple[int, str]  # a file's arrival: (modification time in ns, name)


def _same(value: int) -> int:
    return value  # one process: its own value is everyone's


class Position(tf.Module):
    """Which files are done, and the record ranges trained of those partly done (checkpointed).

    Two string variables hold it as JSON: `state`, {"watermark": [time in ns,
    name] (every file whose key is at or below it is done), "partial": {name:
    [[first, records], ...]} (the ranges trained of files partly done)}, written
    after every block; and `done`, [[name, time in ns], ...] (the done files
    above the watermark, up to `data.follow_horizon_files` of them), written only
    when a file is done. Scalars: their size is known to whatever sizes
    checkpoints, and they read the same in any version of TF.
    """

    def __init__(self):
        super().__init__(name="follow")
        self.state = tf.Variable("", dtype=tf.string, trainable=False, name="state")
        self.done = tf.Variable("", dtype=tf.string, trainable=False, name="done")
        # An earlier version's position, read from its checkpoints (`Follower.start`): the
        # file being trained on, in name order, and the records of it trained.
        self.file = tf.Variable("", dtype=tf.string, trainable=False, name="file")
        self.offset = tf.Variable(0, dtype=tf.int64, trainable=False, name="offset")

    def read(self) -> dict:
        """The state held (`watermark`, `partial`, and `done` as {name: time in ns})."""
        text, done = self.state.numpy().decode(), self.done.numpy().decode()
        state = json.loads(text) if text else {"watermark": [-1, ""], "partial": {}}
        return {**state, "done": dict(json.loads(done) if done else state.get("done", {}))}


@dataclasses.dataclass
class _File:
    name: str
    records: int
    mtime_ns: int  # arrival time: the file's (or its partition marker's) modification time
    found: float  # time.monotonic() of the look that found it

    @property
    def key(self) -> Key:
        return (self.mtime_ns, self.name)


@dataclasses.dataclass(frozen=True)
class UnitOut:
    """Records `first, ..., first + records - 1` of `file`, handed out as unit `id` and not done.

    The follower's record of a `strategies.units.Unit` it gave to a worker.
    """

    id: int
    file: str
    first: int
    records: int


@dataclasses.dataclass
class _Segment:
    """A stretch of the synchronous stream: records of a file, or padding of weight 0."""

    file: str
    first: int
    records: int
    real: bool = True


class Follower:
    """The files of one glob as they arrive, and which of their records are trained.

    Args:
      pattern: `data.train_files`.
      read: one file name -> its records (the source's own reader).
      poll_secs: seconds between looks for new files while waiting.
      count: one file name -> its records (default: counted through `read`; see
        `trainer.data.counting`).
      max_wait_secs: how long a remainder short of a global batch waits before it
        trains padded (`data.follow_max_wait_secs`).
      horizon_files: files named in the position after its watermark, at most.
      marker: a file that marks its directory complete ("" = none).
    """

    def __init__(
        self,
        pattern: str,
        read: ReadFile,
        poll_secs: float,
        count: counting.CountFile | None = None,
        max_wait_secs: float = 60.0,
        horizon_files: int = 10_000,
        marker: str = "",
    ):
        self.pattern, self.read, self.poll_secs = pattern, read, poll_secs
        self.count = count or self._count_by_reading
        self.max_wait_secs, self.horizon_files, self.marker = max_wait_secs, horizon_files, marker
        self.position = Position()
        self.say: Callable[[str], None] = _say  # the loop points it at the chief's lines
        self._lock = threading.Condition()  # guards the state below; notified as segments come
        self._reset()
        self._closed = False
        self._last_look = 0.0  # time.monotonic() of the last `refresh`

    def _reset(self) -> None:
        self._watermark: Key = (-1, "")
        self._done: dict[str, int] = {}  # done files after the watermark: name -> mtime_ns
        self._done_json: dict[str, str] = {}  # each one's entry in `position.done`
        self._done_changed = True  # `position.done` is to be written
        self._state_written = None  # what `position.state` was last given
        self._ranges: dict[str, list[tuple[int, int]]] = {}  # partly done: trained (first, n)
        self._known: dict[str, _File] = {}  # found, not done
        self._candidates: list[_File] = []  # found, not admitted yet
        self._admitted: list[_File] = []  # admitted, not done, in stream order
        self._stream: collections.deque[_Segment] = collections.deque()  # not trained yet
        self._head_trained = 0  # records of `_stream[0]` trained
        self._head_seq = 0  # the sequence number of `_stream[0]`
        self._out: dict[int, UnitOut] = {}  # units handed out, not done
        self._next_unit = 0
        self._markers: dict[str, int] = {}  # directory -> its marker's mtime_ns, once landed
        self._ignored: set[str] = set()  # listed at or below the watermark: done, or refused
        self._newest: Key = (-1, "")  # the newest key found or done
        self._looked = False

    # --- the position ----------------------------------------------------------------

    def start(self) -> None:
        """Reads the (restored) position and looks for the files not done."""
        state = self.position.read()
        if not self.position.state.numpy() and self.position.file.numpy():  # an older version's
            state = self._from_name_order()
        with self._lock:
            self._reset()
            self._watermark = tuple(state["watermark"])
            self._done = dict(state["done"])
            self._done_json = {name: json.dumps([name, t]) for name, t in self._done.items()}
            self._ranges = {name: [tuple(r) for r in rs] for name, rs in state["partial"].items()}
            self._newest = max([self._watermark, *((t, n) for n, t in self._done.items())])
            self._closed = False
        self.refresh()
        with self._lock:  # partly trained at the checkpoint, and gone since
            for name in [n for n in self._ranges if n not in self._known]:
                trained = sum(n for _, n in self._ranges.pop(name))
                self.say(
                    f"file {name} was removed before it was trained whole: only {trained} of "
                    "its records trained"
                )

    def _from_name_order(self) -> dict:
        """The state of an earlier version's position: the files before its file, by name, done."""
        file, offset = self.position.file.numpy().decode(), int(self.position.offset.numpy())
        before = [p for p in tf.io.gfile.glob(self.pattern) if ready(p) and p < file]
        self.say(
            f"position of an earlier version: the {len(before)} files before {file} in name "
            f"order taken as trained, and {offset} records of it"
        )
        done = {name: self._mtime_ns(name) for name in before}
        partial = {file: [[0, offset]]} if offset else {}
        return {"watermark": [-1, ""], "done": done, "partial": partial}

    def _write(self) -> None:
        """The state into `position` (under the lock); the done files where they changed."""
        if self.position.state.numpy().decode() != self._state_written:
            self._done_changed = True  # restored since it was written (a recovery): both again
        self._state_written = json.dumps({"watermark": self._watermark, "partial": self._ranges})
        self.position.state.assign(self._state_written)
        if self._done_changed:  # thousands of names: each one's entry is kept made
            self.position.done.assign("[" + ",".join(self._done_json.values()) + "]")
            self._done_changed = False

    def _mark_done(self, name: str, first: int, records: int) -> None:
        """Records `first` to `first + records - 1` of `name` trained (under the lock)."""
        file = self._known.get(name)
        if file is None or records <= 0:
            return
        ranges = _merged([*self._ranges.get(name, []), (first, records)])
        if ranges != [(0, file.records)]:
            self._ranges[name] = ranges
            return
        self._ranges.pop(name, None)
        del self._known[name]
        self._admitted = [f for f in self._admitted if f.name != name]
        self._done[name] = file.mtime_ns
        self._done_json[name] = json.dumps([name, file.mtime_ns])
        self._done_changed = True
        self._raise_watermark()

    def _raise_watermark(self) -> None:
        """Forgets the oldest done names beyond `horizon_files`, below every file not done."""
        excess = len(self._done) - self.horizon_files
        if excess <= 0:
            return
        floor = min((f.key for f in self._known.values()), default=None)
        for mtime_ns, name in heapq.nsmallest(excess, ((t, n) for n, t in self._done.items())):
            if floor is not None and (mtime_ns, name) >= floor:
                return  # a file found but not done is older: the watermark stays below it
            self._watermark = max(self._watermark, (mtime_ns, name))
            del self._done[name], self._done_json[name]
            self._ignored.add(name)

    # --- finding files -----------------------------------------------------------------

    def refresh(self) -> None:
        """Looks for new ready files; says which are late, refused or removed."""
        self._last_look = time.monotonic()
        listed_now = self._listed()
        with self._lock:
            first_look, self._looked = not self._looked, True
            self._ignored &= listed_now  # a name gone from the listing is forgotten
            unseen = listed_now - self._known.keys() - self._done.keys() - self._ignored
            gone = [f for f in self._known.values() if f.name not in listed_now]
        new = sorted((self._mtime_ns(name), name) for name in unseen)  # a stat per new file
        below = [key for key in new if key <= self._watermark]
        now = time.monotonic()
        found = [_File(n, self.count(n), t, now) for t, n in new if (t, n) > self._watermark]
        with self._lock:
            self._ignored.update(n for _, n in below)
            for file in gone:
                self._forget_removed(file)
            for file in found:
                if file.key < self._newest and file.name not in self._ranges:
                    self.say(
                        f"late file {file.name}: modified before {self._newest[1]}, which was "
                        "found earlier; trained once, after the files found before it"
                    )
                self._newest = max(self._newest, file.key)
                self._known[file.name] = file
                self._candidates.append(file)
            self._lock.notify_all()
        self._refuse(below, first_look)

    def _listed(self) -> set[str]:
        """The ready files of the pattern now: in marker mode, those of complete directories."""
        paths = [path for path in tf.io.gfile.glob(self.pattern) if ready(path)]
        if not self.marker:
            return set(paths)
        directories = {os.path.dirname(path) for path in paths}
        # A marker once landed stays: each directory is asked until it has one.
        self._markers = {d: t for d, t in self._markers.items() if d in directories}
        for directory in directories - self._markers.keys():
            marker = os.path.join(directory, self.marker)
            if tf.io.gfile.exists(marker):
                self._markers[directory] = int(tf.io.gfile.stat(marker).mtime_nsec)
        return {path for path in paths if os.path.dirname(path) in self._markers}

    def _refuse(self, below: list[Key], first_look: bool) -> None:
        """One line for the files at or below the watermark (a summary at the first look)."""
        if not below:
            return
        horizon = (
            f"the position names the last {self.horizon_files} files trained "
            "(`data.follow_horizon_files`)"
        )
        if first_look:
            self.say(
                f"{len(below)} files of `data.train_files` are as old as the position's "
                f"watermark ({_when(self._watermark[0])}) or older: taken as trained; {horizon}"
            )
            return
        for mtime_ns, name in below:
            self.say(
                f"refused late file {name}: modified {_when(mtime_ns)}, at or before the "
                f"watermark ({_when(self._watermark[0])}), so it cannot be told from a file "
                f"trained; {horizon}: raise it to take files this late"
            )

    def _forget_removed(self, file: _File) -> None:
        """A file found but not trained whole is gone (under the lock): one line."""
        if any(s.file == file.name for s in self._stream):
            return  # its reader has it open or will fail naming it; the stream keeps its place
        trained = sum(n for _, n in self._ranges.pop(file.name, []))
        self.say(
            f"file {file.name} was removed before it was trained: {file.records - trained} "
            f"of its {file.records} records never trained"
        )
        del self._known[file.name]
        self._candidates = [f for f in self._candidates if f.name != file.name]
        self._admitted = [f for f in self._admitted if f.name != file.name]

    def _mtime_ns(self, path: str) -> int:
        """A file's arrival time: its modification time, or its marker's where later."""
        mtime = int(tf.io.gfile.stat(path).mtime_nsec)
        return max(mtime, self._markers.get(os.path.dirname(path), mtime))

    def _count_by_reading(self, path: str) -> int:
        return counting.count_records(self.read(tf.constant(path)))

    def look_if_due(self) -> None:
        """`refresh` if `poll_secs` have passed since the last look (keeps the backlog current)."""
        if time.monotonic() - self._last_look >= self.poll_secs:
            self.refresh()

    # --- the synchronous stream ----------------------------------------------------------

    def admit(self, agree: Agree = _same, everyone: Callable[[bool], bool] = bool) -> None:
        """The files found join the stream, in key order, once every worker has found them.

        The chief's newest found key bounds what joins; the workers compare a
        fingerprint of their files up to it (`agree`, `everyone`: the same number
        of collectives on every worker, whatever each found). Also hands their
        units to `take_unit`.
        """
        with self._lock:  # files partly trained first: a restart goes on where it stopped
            mine = sorted(self._candidates, key=lambda f: (f.name not in self._ranges, f.key))
        newest = agree(max((f.mtime_ns for f in mine), default=-1))
        if newest < 0:  # nothing new on the chief, so on every worker alike: no more to ask
            return
        joining = [f for f in mine if f.mtime_ns <= newest]
        fingerprint = _fingerprint(joining)
        if not everyone(agree(fingerprint) == fingerprint) or not joining:
            return
        with self._lock:
            names = {f.name for f in joining}
            self._candidates = [f for f in self._candidates if f.name not in names]
            for file in joining:
                if file.name not in self._known:
                    continue  # removed meanwhile (said so)
                self._admitted.append(file)
                for first, n in _free(file.records, self._ranges.get(file.name, [])):
                    self._stream.append(_Segment(file.name, first, n))
            self._lock.notify_all()

    def waiting(self) -> int:
        """Records admitted to the stream and not trained yet (padding included)."""
        with self._lock:
            return sum(s.records for s in self._stream) - self._head_trained

    def steps_ready(
        self,
        most: int,
        global_batch: int,
        agree: Agree = _same,
        everyone: Callable[[bool], bool] = bool,
    ) -> int:
        """Admits what was found, pads a remainder that waited long enough; the whole batches.

        Returns how many global batches of `global_batch` records wait, at most `most`.
        Where the stream already holds `most` (so on every worker: it is one), the files
        found wait to join it until it runs short: they would join behind those records
        anyway, and no worker need ask the others.
        """
        if most and self.waiting() >= most * global_batch:
            return most
        self.admit(agree, everyone)
        self._pad_if_due(global_batch, everyone)
        return min(most, self.waiting() // global_batch)

    def _pad_if_due(self, global_batch: int, everyone: Callable[[bool], bool]) -> None:
        """Pads the remainder past the whole global batches once it has waited `max_wait_secs`.

        The remainder is the same on every worker (their streams are one); whether
        it waited long enough is agreed (`everyone`: every worker's clock says so).
        """
        with self._lock:
            left = sum(s.records for s in self._stream) - self._head_trained
            remainder = left % global_batch
            if not remainder:
                return
            oldest, tail = time.monotonic(), self._stream[-1].file
            for segment in reversed(self._stream):  # the segments holding the remainder
                oldest = min(oldest, self._known[segment.file].found)
                remainder -= segment.records
                if remainder <= 0:
                    break
            short = global_batch - left % global_batch
        if everyone(time.monotonic() - oldest >= self.max_wait_secs):
            with self._lock:
                self._stream.append(_Segment(tail, 0, short, real=False))
                self._lock.notify_all()

    def wait(
        self,
        records: int,
        global_batch: int,
        still_waiting: Callable[[], None],
        everyone: Callable[[bool], bool] = bool,
        agree: Agree = _same,
    ) -> None:
        """Returns once the stream holds `records` not trained on, on every worker.

        Between looks it admits what was found and pads a remainder that waited
        `max_wait_secs`. `still_waiting()` is called between looks (on the main
        thread, so it may act on SIGTERM: raise to stop waiting); every worker
        makes the same collectives (`everyone`, `agree`) the same number of times.
        """
        if self.waiting() >= records:  # the stream is one on every worker: all return here
            return
        while True:
            self.steps_ready(0, global_batch, agree, everyone)
            if everyone(self.waiting() >= records):
                return
            still_waiting()
            time.sleep(self.poll_secs)
            self.refresh()

    def advance(self, records: int) -> int:
        """The next `records` of the stream are trained: marks them done; writes `position`.

        Returns how many of them are the files' (not padding).
        """
        real = 0
        with self._lock:
            while records > 0 and self._stream:
                head = self._stream[0]
                n = min(records, head.records - self._head_trained)
                if head.real:
                    self._mark_done(head.file, head.first + self._head_trained, n)
                    real += n
                records -= n
                self._head_trained += n
                if self._head_trained == head.records:
                    self._stream.popleft()
                    self._head_seq += 1
                    self._head_trained = 0
            self._write()
        return real

    def segments(self) -> Iterator[tuple[str, int, int, bool]]:
        """The stream's segments from the position on: (file, first, records, real), waiting.

        Runs on a tf.data thread: it only hands out what `admit` put in the stream.
        """
        with self._lock:
            seq = self._head_seq
        while True:
            with self._lock:
                while seq - self._head_seq >= len(self._stream) and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                segment = self._stream[seq - self._head_seq]
            yield segment.file, segment.first, segment.records, segment.real
            seq += 1

    def records(self, file: tf.Tensor, first: tf.Tensor, n: tf.Tensor, real: tf.Tensor):
        """One segment's records, each with its weight: 1, or 0 for padding (a record repeated)."""
        one = tf.constant(1, tf.int64)
        taken = self.read(file).skip(first).take(tf.where(real, n, one))
        weight = tf.cast(real, tf.float32)
        return taken.repeat(tf.where(real, one, n)).map(lambda *record: (record, weight))

    def close(self) -> None:
        """Ends the stream's wait for segments (the loop is over)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # --- units, for workers that take work when free --------------------------------------

    def take_unit(self, most: int = 0) -> UnitOut | None:
        """The next range of an admitted file neither done nor out, of `most` records (0: all).

        None while every admitted record is done or out (`admit` adds files). A run
        takes its records as units or as the synchronous stream (`segments`), not both.
        """
        with self._lock:
            for file in self._admitted:
                free = self._not_taken(file)
                if free:
                    first, n = free[0]
                    unit = UnitOut(self._next_unit, file.name, first, min(n, most) if most else n)
                    self._next_unit += 1
                    self._out[unit.id] = unit
                    return unit
        return None

    def unit_done(self, unit_id: int) -> None:
        """Unit `unit_id` is trained: its records are done; writes `position`."""
        with self._lock:
            unit = self._out.pop(unit_id)
            self._mark_done(unit.file, unit.first, unit.records)
            self._write()

    def unit_returned(self, unit_id: int) -> None:
        """Unit `unit_id` did not train (its block failed): its records are handed out again."""
        with self._lock:
            self._out.pop(unit_id)

    def unit_steps(self, global_batch: int) -> int:
        """Steps of `global_batch` the records neither done nor out make, a file's tail its own."""
        with self._lock:
            ranges = [r for file in self._admitted for r in self._not_taken(file)]
        return sum(-(-n // global_batch) for _, n in ranges)

    def _not_taken(self, file: _File) -> list[tuple[int, int]]:
        """The ranges of `file` neither done nor out (under the lock)."""
        out = [(u.first, u.records) for u in self._out.values() if u.file == file.name]
        return _free(file.records, self._ranges.get(file.name, []) + out)

    # --- the backlog ---------------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        """The backlog: `files_waiting`, `records_waiting` and `seconds_behind` the newest file."""
        with self._lock:
            files = list(self._known.values())
            trained = {name: sum(n for _, n in r) for name, r in self._ranges.items()}
        left = sum(f.records - trained.get(f.name, 0) for f in files)
        unread = [f for f in files if f.records and not trained.get(f.name)]
        behind = 0.0
        if files and left:
            times = [f.mtime_ns for f in files if f.records > trained.get(f.name, 0)]
            behind = (self._newest[0] - min(times)) / 1e9
        return {
            "files_waiting": float(len(unread)),
            "records_waiting": float(left),
            "seconds_behind": max(0.0, behind),
        }


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges (first, n) sorted, touching ones joined."""
    out: list[tuple[int, int]] = []
    for first, n in sorted(ranges):
        if out and first <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], first + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((first, n))
    return out


def _free(records: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges of `0, ..., records - 1` outside the `taken` ones."""
    free, at = [], 0
    for first, n in _merged(taken):
        if first > at:
            free.append((at, first - at))
        at = max(at, first + n)
    return free + ([(at, records - at)] if at < records else [])


def _fingerprint(files: list[_File]) -> int:
    """A number the same on every worker that found the same files (names and records)."""
    text = "\n".join(f"{f.name}\t{f.records}" for f in files).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mtime_ns / 1e9))


def _say(line: str) -> None:
    print(line, flush=True)


# --- the dataset and its checks -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FollowedDataset(TrainStreamWrapper):
    """A file source whose training stream follows its files (`data.follow`)."""

    follower: Follower | None = None
    decode: Decode | None = None

    def train_fn(
        self, global_batch_size: int, seed: int, start_step: int = 0, start_batch: int | None = None
    ) -> DatasetFn:
        """The records not trained, in arrival order; `seed`, `start_*` unused.

        Every pipeline reads the whole stream of records in per-replica batches
        and keeps batches `p, p + P, ...` (pipeline `p` of `P`): each step takes
        the stream's next `global_batch_size` records over all pipelines. Each
        example carries its weight (0 for padding) as its sample weight.
        """

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            self.follower.start()
            segments = tf.data.Dataset.from_generator(
                self.follower.segments,
                output_signature=(
                    tf.TensorSpec((), tf.string),
                    tf.TensorSpec((), tf.int64),
                    tf.TensorSpec((), tf.int64),
                    tf.TensorSpec((), tf.bool),
                ),
            )
            records = segments.flat_map(self.follower.records)
            batch = context.get_per_replica_batch_size(global_batch_size)
            batches = records.batch(batch, drop_remainder=True)
            if context.num_input_pipelines > 1:  # this pipeline's share of each global batch
                batches = batches.shard(context.num_input_pipelines, context.input_pipeline_id)
            batches = batches.map(self._weighted, num_parallel_calls=tf.data.AUTOTUNE)
            return self.settings.apply(batches.prefetch(tf.data.AUTOTUNE))

        return dataset_fn

    def _weighted(self, records: tuple, weights: tf.Tensor) -> tuple:
        """`(x, y, weights)`: the batch decoded, its sample weights times the records' weights."""
        x, y, *given = self.decode(*records)
        return (x, y, given[0] * tf.cast(weights, given[0].dtype) if given else weights)


def wrap(dataset: Dataset, config: ml_collections.ConfigDict) -> Dataset:
    """`dataset` with its training stream following its files when `data.follow` is set.

    Raises:
      UserError: `data.follow` with a source that reads no files, or a `data.follow_*`
        field out of its range, or a marker with files that are not in partitions.
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
    poll, wait, horizon, marker = check_fields(config)
    read, decode = reader
    count = counting.counter(config) if file_split(dataset) is not None else None
    follower = Follower(config.train_files, read, poll, count, wait, horizon, marker)
    return FollowedDataset(dataset, follower, decode)


def check_fields(config: ml_collections.ConfigDict) -> tuple[float, float, int, str]:
    """`data.follow_poll_secs`, `_max_wait_secs`, `_horizon_files` and `_marker`, checked.

    Raises:
      UserError: a poll interval <= 0, a max wait < 0, a horizon <= 0, or a marker
        with `data.train_files` that has no wildcard in its directories.
    """
    poll = config.follow_poll_secs
    if poll <= 0:
        raise UserError(
            f"`data.follow_poll_secs` ({poll}) must be > 0 (seconds between looks for new "
            "files); set e.g. `--config.data.follow_poll_secs=1`."
        )
    wait = config.get("follow_max_wait_secs", 60.0)
    if wait < 0:
        raise UserError(
            f"`data.follow_max_wait_secs` ({wait}) must be >= 0 (seconds a remainder short of "
            "a global batch waits before it trains padded); set e.g. "
            "`--config.data.follow_max_wait_secs=60`, or 0 to train it at once."
        )
    horizon = config.get("follow_horizon_files", 10_000)
    if horizon <= 0:
        raise UserError(
            f"`data.follow_horizon_files` ({horizon}) must be > 0 (the files trained that the "
            "position names after its watermark; a later file older than them is refused); "
            "set e.g. `--config.data.follow_horizon_files=10000`."
        )
    marker = config.get("follow_marker", "")
    directory = os.path.dirname(config.train_files)
    if marker and not any(c in directory for c in "*?["):
        raise UserError(
            f"`data.follow_marker` '{marker}' marks a partition directory complete, and "
            f"`data.train_files` '{config.train_files}' has no wildcard in its directories, so "
            "it holds no partitions; give e.g. `--config.data.train_files='/data/dt=*/hour=*/"
            "part-*'`, or `--config.data.follow_marker=''`."
        )
    return poll, wait, horizon, marker


def _reader(dataset: Dataset) -> tuple[ReadFile, Decode] | None:
    """How `dataset` reads one training file's records and decodes a batch; None if it cannot."""
    split = file_split(dataset)
    if split is not None:
        return split.read, split.decode
    if isinstance(dataset, user.PipelineDataset) and dataset.files is not None:
        return dataset.read_file, _as_is  # its examples are decoded already
    return None


def _as_is(*batch):
    return batch  # `(features, labels[, sample_weights])`


def follower_of(dataset: Dataset) -> Follower | None:
    """The `Follower` of a `FollowedDataset`, else None."""
    return dataset.follower if isinstance(dataset, FollowedDataset) else None
