"""A stand-in for `python -m trainer` in the launcher's tests: a member that does as it is told.

    python -m tests.fake_member --pid_dir=DIR --sleep=60 --exit=worker:1=3@0.5 --grandchild
    python -m tests.fake_member --pid_dir=DIR --listen

It prints its name (from `TF_CONFIG`'s `task`) and its arguments, one line
to stderr, records its pid (and its child's, with `--grandchild`) as
`DIR/<pid>.pid`, then sleeps and exits. `--exit=NAME=CODE@SECONDS` makes member NAME ("chief:0",
"worker:1", "ps:0", "evaluator:0") exit with CODE after SECONDS; a negative
CODE kills it with that signal. Other members exit 0 after `--sleep` seconds.
`--listen` listens on its `TF_CONFIG` address's port on every interface, as
TensorFlow's servers do, before it records its pid.
"""

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time


def _record(pid_dir: str | None, pid: int, text: str) -> None:
    if pid_dir:
        path = pathlib.Path(pid_dir, f"{pid}.pid")
        path.with_suffix(".tmp").write_text(text)
        path.with_suffix(".tmp").replace(path)  # whole files only, for tests that poll


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid_dir")
    parser.add_argument("--sleep", type=float, default=60.0)
    parser.add_argument("--exit", action="append", default=[], help="NAME=CODE@SECONDS")
    parser.add_argument("--grandchild", action="store_true", help="start a child that sleeps")
    parser.add_argument("--listen", action="store_true", help="listen as TF's servers do")
    parser.add_argument("--ignore_term", action="store_true", help="ignore SIGTERM")
    parser.add_argument(
        "--save_s",
        type=float,
        help="on SIGTERM: 'save' this long, exit 143; NAME.term and NAME.saved hold the times",
    )
    args, _ = parser.parse_known_args()

    entry = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{entry['type']}:{entry['index']}"
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild too
    if args.save_s is not None:

        def save_and_exit(sig, frame):
            pathlib.Path(args.pid_dir, f"{name}.term").write_text(repr(time.time()))
            time.sleep(args.save_s)
            pathlib.Path(args.pid_dir, f"{name}.saved").write_text(repr(time.time()))
            sys.exit(143)

        signal.signal(signal.SIGTERM, save_and_exit)
    print(f"member {name} args {sys.argv[1:]}")
    print(f"stderr of {name}", file=sys.stderr)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        _record(args.pid_dir, child.pid, f"{name} grandchild")
    if args.listen:  # accepts connections (the kernel completes them), reads nothing
        address = json.loads(os.environ["TF_CONFIG"])["cluster"][entry["type"]][entry["index"]]
        server = socket.create_server(("0.0.0.0", int(address.rsplit(":", 1)[1])))  # noqa: F841
    _record(args.pid_dir, os.getpid(), name)

    code, seconds = 0, args.sleep
    for spec in args.exit:
        who, _, what = spec.partition("=")
        if who == name:
            code, seconds = int(what.split("@")[0]), float(what.split("@")[1])
    time.sleep(seconds)
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
