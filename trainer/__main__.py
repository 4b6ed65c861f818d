"""`towerflow` (or `python -m trainer`): train and evaluate any model under any strategy.

towerflow --strategy=mirrored
towerflow --config=configs/default.py --config.train.steps=3000
towerflow --list_strategies
"""

import functools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags  # noqa: E402

from trainer import cli  # noqa: E402

cli.own_packages_first()  # before anything imports `strategies`
_FLAGS = cli.define_flags(flags.FLAGS)


def run() -> None:
    """The `towerflow` command: parses the flags and trains (see `cli.main`)."""
    app.run(
        cli.guarded(functools.partial(cli.main, _FLAGS)),
        argv=sys.argv,
        flags_parser=functools.partial(cli.parse_flags, _FLAGS),
    )


if __name__ == "__main__":
    run()
