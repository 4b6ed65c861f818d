"""Command-line plumbing for `python -m trainer`: config paths, defaults, errors.

Kept apart from `__main__.py` so that it can be imported and tested. It does
not import TensorFlow at module level, so flag errors come back at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator

import configs

EXIT_USER_ERROR = 2


def resolve_config_arg(argv: list[str]) -> list[str]:
    """Supplies `--config=configs/default.py` and finds built-in configs from any directory.

    A path that does not exist relative to the working directory but names a
    file in the installed `configs` package is rewritten to that file.
    """
    if not any(arg.startswith("--config=") for arg in argv):
        argv = [argv[0], f"--config={configs.path('default')}", *argv[1:]]
    resolved = []
    for arg in argv:
        if arg.startswith("--config="):
            path, colon, rest = arg[len("--config=") :].partition(":")
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
    """The first line of an error's message."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def flag_error(error: BaseException, argv: list[str]) -> str:
    """One line for a flag or config-file mistake, with the fix."""
    text = " ".join(str(error).replace("\\n", "\n").replace("\\'", "'").split())
    config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    if "No such file or directory" in text:
        return (
            f"`--config` file '{config.partition(':')[0]}' does not exist; give a path to a "
            f"config file, or a built-in one: {', '.join(builtin_configs())}."
        )
    if isinstance(error, SyntaxError) or "Failed loading config file" in text:
        return f"`--config` file '{config}' did not load: {text[-300:]}"
    bad_type = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text)
    if bad_type:
        field, value, reason = bad_type.groups()
        return (
            f"`--config.{field}` got '{value}' ({reason}); give a value of the field's type, "
            "as in configs/default.py."
        )
    key = re.search(r"'(\w+)'", text)
    overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
    override = next((o for o in overrides if key and key.group(1) in o.split(".")), None)
    if override:
        hint = re.search(r'Did you mean "(\w+)"', text)
        fix = f"did you mean `{hint.group(1)}`?" if hint else "see configs/default.py."
        field = override.removeprefix("--config.")
        return f"Unknown config field `{field}` (no `{key.group(1)}` there); {fix}"
    return text.removeprefix("FATAL Flags parsing error: ")


def builtin_configs() -> list[str]:
    """Paths of the configs shipped in the package, as the user would type them."""
    return sorted(
        f"configs/{p.name}" for p in configs.CONFIG_DIR.glob("*.py") if not p.name.startswith("_")
    )


def guarded(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl `main` so a `UserError` becomes one line and exit status 2."""

    def wrapper(argv: list[str]) -> None:
        with native_stderr_silenced():
            # Importing `strategies` imports TensorFlow, whose runtime logs start-up
            # chatter to stderr; the device probe starts its CUDA layer, which does too.
            from strategies import devices
            from strategies.errors import UserError

            devices.physical()
        from trainer import faults
        from trainer.checkpoints import NO_SPACE_EXIT_CODE, NoSpace

        try:
            main(argv)
        except UserError as e:
            fail(one_line(e))
        except faults.Preempted:
            sys.exit(faults.PREEMPTED_EXIT_CODE)
        except faults.Diverged as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(faults.DIVERGED_EXIT_CODE)
        except NoSpace as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(NO_SPACE_EXIT_CODE)
        except faults.TaskLost as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # No interpreter teardown: TensorFlow's would log connection errors to the
            # lost task for a while, or wait on it.
            os._exit(faults.TASK_LOST_EXIT_CODE)

    return wrapper


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Silences file descriptor 2 while TensorFlow loads and probes devices.

    Its C++ runtime prints start-up chatter (no CUDA driver found, ...) before
    any setting can stop it. Python errors still surface: they are raised, not
    printed, inside the block. `TF_CPP_MIN_LOG_LEVEL=0` or `1` keeps the chatter.
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2") < "2":
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
