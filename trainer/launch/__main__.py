"""`python -m trainer.launch`: the command (`trainer.launch.main`)."""

import sys

from absl import app

import trainer.launch
from trainer import cli

# `--help` prints the main module's docstring: the command's own.
__doc__ = trainer.launch.__doc__  # noqa: A001

if __name__ == "__main__":
    app.run(trainer.launch.main, argv=sys.argv, flags_parser=cli.parse_own_flags)
