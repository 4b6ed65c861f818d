"""Command-line plumbing for `python -m trainer`: config paths, defaults, errors.

Kept apart from `__main__.py` so that it can be imported and tested.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import configs
from strategies.errors import UserError

EXIT_USER_ERROR = 2


def resolve_config_arg(argv: list[str]) -> list[str]:
    """Lets `--config=configs/NAME.py` find a built-in config from any directory.

    A path that does not exist relative to the working directory but names a
    file in the installed `configs` package is rewritten to that file.
    """
    resolved = []
    for arg in argv:
        if arg.startswith("--config="):
            path, colon, rest = arg[len("--config="):].partition(":")
            builtin = os.path.join(configs.CONFIG_DIR, os.path.basename(path))
            if not os.path.exists(path) and os.path.exists(builtin):
                arg = f"--config={builtin}{colon}{rest}"
        resolved.append(arg)
    return resolved


def default_model_dir(config_path: str, strategy: str) -> str:
    """`runs/<config>-<strategy>` under the working directory: stable, so reruns resume."""
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("runs", f"{name}-{strategy}")


def fail(message: str) -> None:
    """Prints one line for a user mistake and exits with status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def one_line(error: BaseException) -> str:
    """The first line of an error's message, without absl's flag-parsing preamble."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def guarded(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl `main` so a `UserError` becomes one line and exit status 2."""

    def wrapper(argv: list[str]) -> None:
        try:
            main(argv)
        except UserError as e:
            fail(one_line(e))

    return wrapper
