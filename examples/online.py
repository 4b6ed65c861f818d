"""The online loop: clicks keep arriving, training follows them, a server follows the exports.

Three processes, each its own command (docs/online.md runs them; `latency`
writes files one at a time and times each from landing to its export):

    python -m examples.online write --dir=online/clicks --files=1
    python -m examples.online write --dir=online/clicks --start=1 --files=5 --every_secs=2 &
    python -m examples.online serve --export_dir=online/run/export --seconds=120 &
    python -m trainer --config=examples/online.py --model_dir=online/run

`write` writes files of 512 clicks, one every few seconds, into `DIR/train/`
(`clicks-00000.csv`, ...), each under a hidden name (`.clicks-00003.csv`)
renamed into place when complete; file 0 comes after the eval file
`DIR/eval.csv`. The clicks are of the `ctr` source's kind (8 categorical
fields of 2,000 values each, Zipf-popular, hashed into one vocabulary of
20,000 ids; a hidden logistic click model), drawn with numpy so that the
writer starts at once (it never imports TensorFlow): example `i` alone fixes
its draws, examples `k * 512` on are in file `k`, so the files are the same
on every run.

This config (`configs/ctr.py` under `mirrored`, reading those files with
`data.follow`) trains on each file once as it arrives, `train.steps=0`: until
stopped (SIGTERM saves and exits 143; the next run goes on with the next
record), and exports a SavedModel every 8 steps to `model_dir/export/<step>/`.

`serve` loads the newest version each time one appears and answers
`POST /predict` on 127.0.0.1 (`{"inputs": [[8 ids], ...]}` -> `{"version": N,
"probabilities": [...]}`, the click probability of each example), printing
`serving version N` as it switches; `--port_file` gets the port it listens on.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import threading
import time

import ml_collections
import numpy as np

from configs import ctr

ROWS = 512  # clicks per file
FIELDS = 8  # id columns of a file
IDS_PER_FIELD = 2_000  # values of each field
VOCAB = 20_000  # ids of all fields together: the table's rows
EVAL_ROWS = 2048
EVAL_FIRST = 900_000  # the eval file's first example: after every train file's
_SEED = 4321  # fixes the draws, the hashing and the hidden click model
_WEIGHT_SCALE, _BIAS = 0.7, -1.0  # the hidden click model's per-id weights and bias (logits)


def get_config() -> ml_collections.ConfigDict:
    """`configs/ctr.py` on `mirrored`, following the files of `write`, exporting every 8 steps."""
    c = ctr.get_config()
    c.data.ctr.ids_per_field = IDS_PER_FIELD
    c.data.ctr.vocab_size = VOCAB  # the table's rows follow it
    c.strategy.name = "mirrored"
    c.data.name = "csv"
    # Relative to where the trainer runs, as `write --dir=online/clicks` makes them.
    c.data.train_files = "online/clicks/train/*.csv"
    c.data.eval_files = "online/clicks/eval.csv"
    c.data.input_shape = (FIELDS,)
    c.data.num_classes = 2
    c.data.follow = True
    c.data.follow_poll_secs = 0.5
    c.train.steps = 0  # until stopped
    c.train.global_batch_size = 128
    c.train.steps_per_loop = 4  # a file of 512 clicks is one block
    c.train.checkpoint_every = 8
    c.export.every_steps = 8
    c.export.keep = 5
    c.eval.every = 0
    return c


def clicks(first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples `first, ..., first + count - 1`: 8 ids each (float32) and a click (0 or 1).

    Each field's value of popularity rank r is drawn with a probability about
    1/(r + 1) (the `ctr` source's Zipf(1) draw); a fixed permutation hashes
    every (field, value) into the vocabulary; the click is a Bernoulli draw of
    the sigmoid of the ids' hidden weights summed, plus a bias.
    """
    draws = np.stack(
        [np.random.default_rng([_SEED, i]).random(FIELDS + 1) for i in range(first, first + count)]
    )
    ranks = np.minimum(np.exp(draws[:, :FIELDS] * np.log(IDS_PER_FIELD)).astype(np.int64) - 1,
                       IDS_PER_FIELD - 1)  # fmt: skip
    ids = np.random.RandomState(_SEED).permutation(VOCAB)[ranks * FIELDS + np.arange(FIELDS)]
    weights = np.random.RandomState(_SEED + 1).normal(0.0, _WEIGHT_SCALE, size=VOCAB)
    logits = weights[ids].sum(axis=1) + _BIAS
    labels = (draws[:, FIELDS] < 1.0 / (1.0 + np.exp(-logits))).astype(np.int32)
    return ids.astype(np.float32), labels


def write_csv(path: str, first: int, count: int) -> None:
    """A CSV file of clicks, written under a hidden name and renamed into place."""
    ids, labels = clicks(first, count)
    lines = [",".join([*(f"f{i}" for i in range(FIELDS)), "label"])]
    for row, label in zip(ids.astype(int), labels):
        lines.append(",".join(map(str, [*row, int(label)])))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    hidden = os.path.join(directory, "." + name)
    with open(hidden, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.rename(hidden, path)  # complete: now `data.follow` may read it


def write(directory: str, start: int, files: int, every_secs: float) -> None:
    """`files` files of clicks into `directory/train` from file `start` on, one every `every_secs`.

    From file 0: the eval file first.
    """
    if start == 0:
        write_csv(os.path.join(directory, "eval.csv"), EVAL_FIRST, EVAL_ROWS)
    for k in range(start, start + files):
        if k > start:
            time.sleep(every_secs)
        path = os.path.join(directory, "train", f"clicks-{k:05d}.csv")
        write_csv(path, k * ROWS, ROWS)
        print(f"wrote {path}", flush=True)


def landing_to_export(
    directory: str, export_dir: str, start: int, files: int, timeout: float
) -> list[float]:
    """Writes `files` files one at a time; the seconds from each landing to its first export.

    The first waits for the trainer's first export (of the files before
    `start`), and each file is written once the trainer has exported the one
    before (it is caught up and waiting), so the first version that appears
    after a file lands is the first export that trained it. Prints a line per file.

    Raises:
      TimeoutError: no export within `timeout` seconds of the start or of a landing.
    """
    deadline = time.time() + timeout
    while not _versions(export_dir):  # the files before `start` trained: it is caught up
        if time.time() > deadline:
            raise TimeoutError(f"no export in {export_dir} within {timeout:g} s")
        time.sleep(0.05)
    seconds = []
    for k in range(start, start + files):
        newest = max(_versions(export_dir), default=-1)
        path = os.path.join(directory, "train", f"clicks-{k:05d}.csv")
        write_csv(path, k * ROWS, ROWS)
        landed, deadline = time.time(), time.time() + timeout
        while max(_versions(export_dir), default=-1) <= newest:
            if time.time() > deadline:
                raise TimeoutError(f"no export within {timeout:g} s of {path} landing")
            time.sleep(0.05)
        seconds.append(time.time() - landed)
        version = max(_versions(export_dir))
        print(f"{path}: version {version} {seconds[-1]:.2f} s after it landed", flush=True)
    return seconds


def median_and_p95(seconds: list[float]) -> tuple[float, float]:
    """The median and the 95th percentile (the nearest rank) of `seconds`."""
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return ordered[len(ordered) // 2], p95


def latency(directory: str, export_dir: str, start: int, files: int, timeout: float) -> None:
    """`landing_to_export`, then the median and the 95th percentile."""
    try:
        seconds = landing_to_export(directory, export_dir, start, files, timeout)
    except TimeoutError as e:
        raise SystemExit(str(e)) from None
    median, p95 = median_and_p95(seconds)
    print(f"landing to export: median {median:.2f} s, p95 {p95:.2f} s")


def _versions(export_dir: str) -> list[int]:
    """The versions in `export_dir` (a staging directory is hidden until renamed)."""
    names = os.listdir(export_dir) if os.path.isdir(export_dir) else []
    return [int(name) for name in names if name.isdigit()]


class Server:
    """The newest SavedModel under `export_dir`, reloaded as versions appear."""

    def __init__(self, export_dir: str):
        self.export_dir = export_dir
        self.version, self._serve = None, None
        self._lock = threading.Lock()

    def follow(self, poll_secs: float, stop: threading.Event) -> None:
        """Loads each new newest version until `stop` is set."""
        import tensorflow as tf

        from trainer.loop.export import versions

        while not stop.is_set():
            newest = (versions(self.export_dir) or [None])[-1]
            if newest is not None and newest != self.version:
                loaded = tf.saved_model.load(os.path.join(self.export_dir, str(newest)))
                with self._lock:
                    self.version, self._serve = newest, loaded.signatures["serving_default"]
                print(f"serving version {newest}", flush=True)
            stop.wait(poll_secs)

    def predict(self, inputs: list[list[float]]) -> dict:
        """The click probability of each example, and the version that gave it."""
        import tensorflow as tf

        with self._lock:
            version, serve = self.version, self._serve
        if serve is None:
            return {"version": None, "probabilities": []}
        probabilities = serve(inputs=tf.constant(inputs, tf.float32))["probabilities"]
        return {"version": version, "probabilities": probabilities[:, 1].numpy().tolist()}


def serve(export_dir: str, poll_secs: float, port_file: str, seconds: float) -> None:
    """Answers `POST /predict` on 127.0.0.1 with the newest export, for `seconds` (0: ever)."""
    import tensorflow  # noqa: F401 - once, before the first request waits for it

    server = Server(export_dir)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps(server.predict(body["inputs"])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):  # quiet: one line per version, not per request
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    print(f"answering POST http://127.0.0.1:{port}/predict", flush=True)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(port_file + ".tmp", port_file)
    stop = threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    if seconds:
        threading.Timer(seconds, stop.set).start()
    try:
        server.follow(poll_secs, stop)
    finally:
        httpd.shutdown()


def main(argv: list[str] | None = None) -> None:
    """`write` or `serve` (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write", help="write click files as they would arrive")
    writer.add_argument("--dir", default="online/clicks")
    writer.add_argument("--start", type=int, default=0, help="the first file's number")
    writer.add_argument("--files", type=int, default=6)
    writer.add_argument("--every_secs", type=float, default=3.0)
    server = commands.add_parser("serve", help="serve the newest export")
    server.add_argument("--export_dir", default="online/run/export")
    server.add_argument("--poll_secs", type=float, default=0.5)
    server.add_argument("--port_file", default="")
    server.add_argument(
        "--seconds", type=float, default=0.0, help="stop after this long (0: never)"
    )
    timing = commands.add_parser("latency", help="seconds from a file landing to its export")
    timing.add_argument("--dir", default="online/clicks")
    timing.add_argument("--export_dir", default="online/run/export")
    timing.add_argument("--start", type=int, default=1, help="the first file's number")
    timing.add_argument("--files", type=int, default=10)
    timing.add_argument("--timeout", type=float, default=300.0, help="seconds to wait a version")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    if args.command == "write":
        write(args.dir, args.start, args.files, args.every_secs)
    elif args.command == "latency":
        latency(args.dir, args.export_dir, args.start, args.files, args.timeout)
    else:
        serve(args.export_dir, args.poll_secs, args.port_file, args.seconds)


if __name__ == "__main__":
    main()
