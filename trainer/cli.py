"""Command-line plumbing for `towerflow` and `python -m trainer`: flags, config paths, errors.

Kept apart from `__main__.py` so that it can be imported and tested: the flags
can be defined on a fresh `flags.FlagValues` and parsed in-process. It does
not import TensorFlow at module level, so flag errors come back at once.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import traceback
from collections.abc import Callable, Iterator

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from towerflow import registry
from towerflow.processes import native_stderr_silenced

# towerflow's own configs, found from this file, never by `import configs`: a user's
# project often has a `configs` package of its own.
CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
# What a `python -m trainer` process imports before it trains (about 0.4 s of CPU): a
# launcher's or a sweep's fork server imports them once for all its members
# (`towerflow.forkserver.Client`'s `preload`).
MEMBER_MODULES = ("trainer.cli", "trainer.loop.train")


def own_packages_first() -> None:
    """Imports towerflow's own `strategies` ahead of the working directory's; then puts it first.

    `python -m trainer` puts the working directory first on `sys.path`, and a
    user's project may hold packages named like ours (`strategies`, `configs`).
    Our `strategies` is imported with the working directory left out, so
    `sys.modules` holds ours (as it holds `trainer`); towerflow never imports
    `configs` by name. The directory then goes first on `sys.path`, as
    `python -m` has it, also for the `towerflow` command: the user's modules
    (`my_pkg.models:build`, their own `configs`) import from there.
    """
    # `strategies` stays in `sys.modules`: every later import gets ours.
    cwd = registry.own_imported(["strategies"])
    if cwd is not None:  # not towerflow's own checkout, whose packages are the directory's
        sys.path[:] = [cwd, *(p for p in sys.path if os.path.realpath(p or ".") != cwd)]


@dataclasses.dataclass(frozen=True)
class Flags:
    """The command's flags, defined by `define_flags` on `values`."""

    values: flags.FlagValues
    config: flags.FlagHolder
    strategy: flags.FlagHolder
    cluster: flags.FlagHolder
    model_dir: flags.FlagHolder
    mode: flags.FlagHolder
    list_strategies: flags.FlagHolder


def define_flags(flag_values: flags.FlagValues, argv: list[str] | None = None) -> Flags:
    """Defines the command's flags on `flag_values`.

    Args:
      flag_values: `flags.FLAGS` for the command, a fresh `flags.FlagValues` in a test.
      argv: the arguments that will be parsed (ml_collections finds the
        `--config.a.b` overrides there); None reads `sys.argv` when parsing.
    """
    from strategies.cluster import discovery  # after `own_packages_first`: towerflow's own

    defined = Flags(
        values=flag_values,
        # No default: `resolve_config_arg` supplies configs/default.py, found from any
        # directory.
        config=config_flags.DEFINE_config_file(
            "config",
            None,
            "Config file with `get_config()` (default: configs/default.py); fields "
            "override as --config.train.steps=500.",
            flag_values=flag_values,
            lock_config=True,
            sys_argv=argv,
        ),
        strategy=flags.DEFINE_string(
            "strategy", None, "Shorthand for --config.strategy.name.", flag_values=flag_values
        ),
        cluster=flags.DEFINE_enum(
            "cluster",
            None,
            list(discovery.SOURCES),
            "Where the cluster comes from (default auto: TF_CONFIG, else a Slurm step, JobSet "
            "or SageMaker job of several members, else one process). Shorthand for "
            "--config.cluster.source.",
            flag_values=flag_values,
        ),
        model_dir=flags.DEFINE_string(
            "model_dir",
            None,
            "Checkpoints, TensorBoard events, results and export. "
            "Default: runs/<config>-<strategy>.",
            flag_values=flag_values,
        ),
        mode=flags.DEFINE_enum(
            "mode",
            "train_and_eval",
            ["train", "eval", "train_and_eval"],
            "What to run.",
            flag_values=flag_values,
        ),
        list_strategies=flags.DEFINE_bool(
            "list_strategies", False, "List the strategies and exit.", flag_values=flag_values
        ),
    )
    _refuse_no_config(flag_values["config"])
    for field in dataclasses.fields(Flags)[1:]:
        # `--help` lists the flags of the program's own file (`sys.argv[0]`: the
        # `towerflow` script, or trainer/__main__.py), not those of this module.
        flag_values.register_key_flag_for_module(sys.argv[0], flag_values[field.name])
    return defined


def parse_flags(defined: Flags, argv: list[str]) -> list[str]:
    """Parses `argv` into `defined`; a mistake is one line and exit status 2.

    Returns:
      `argv[:1]`: the command takes no positional arguments.
    """
    argv = resolve_config_arg(argv)
    try:
        rest = defined.values(argv)
        defined.config.value.get("seed")  # a config file that failed to load raises here
    except Exception as e:  # config files and overrides raise plain errors, not flags.Error
        fail(config_file_error(e, defined, argv) or flag_error(e, argv))
    if len(rest) > 1:
        fail(
            f"Unexpected argument '{rest[1]}': the command takes only flags; "
            "give values as `--name=value` (e.g. `--strategy=mirrored`)."
        )
    local_service_on_loopback(defined)
    return rest


def local_service_on_loopback(defined: Flags) -> None:
    """`data.service=local:N`: the trainer and its servers move to a loopback-only network.

    Done here, before TensorFlow starts a thread (`towerflow.netns`). A member
    of a cluster stays on the host's network, which its peers need; its own
    server listens there already (the security page: a private network).
    """
    from strategies.cluster import discovery
    from towerflow import netns
    from towerflow.errors import UserError, one_line

    config = defined.config.value
    data = config.get("data") or {}
    if not str(data.get("service", "")).startswith("local:"):
        return
    source = defined.cluster.value or (config.get("cluster") or {}).get("source", "auto")
    if (discovery.detect(os.environ) if source == "auto" else source) != "local":
        print("input: the local tf.data service listens on the cluster's network", flush=True)
        return
    values = [str(defined.model_dir.value or ""), *_strings(config)]
    accept = "`--config.data.service_allow_network=True`"
    allowed = bool(data.get("service_allow_network", False))
    try:
        netns.loopback_only("`data.service=local:N`", accept, values, allowed, print)
    except UserError as e:
        fail(one_line(e))


def _strings(config: ml_collections.ConfigDict) -> Iterator[str]:
    """Every string value in `config`, nested sections included."""
    for value in config.values():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _strings(value)
        elif isinstance(value, str):
            yield value


def main(defined: Flags, argv: list[str]) -> None:
    """Lists the strategies, or trains and evaluates the parsed config.

    Raises:
      UserError: a bad flag or config value; nothing in `model_dir` is written.
    """
    del argv  # `parse_flags` refused positional arguments
    import strategies  # loaded (quietly) by `guarded`

    logging.set_verbosity(logging.WARNING)  # progress lines, not TensorFlow's INFO chatter
    if defined.list_strategies.value:
        for name, description in strategies.available().items():
            print(f"{name:<16} {description}")
        return
    from strategies import tf_patches
    from trainer.loop.train import train_and_evaluate

    # A member may end through `os._exit` (lost, forked): AutoGraph's files would stay in /tmp.
    tf_patches.autograph_leaves_no_files()
    config = defined.config.value
    if defined.strategy.value:
        config.strategy.name = defined.strategy.value
    if defined.cluster.value:
        set_cluster_source(config, defined.cluster.value)
    model_dir = defined.model_dir.value
    if model_dir is None:  # given but empty, `check_model_dir` refuses it
        config_path = config_flags.get_config_filename(defined.values["config"])
        model_dir = default_model_dir(config_path, config.strategy.name)
    train_and_evaluate(config, model_dir, defined.mode.value)


def set_cluster_source(config: ml_collections.ConfigDict, source: str) -> None:
    """`--cluster`: sets `cluster.source`, adding the section to a config file that has none."""
    from strategies.cluster import discovery

    if "cluster" not in config:
        with config.unlocked():
            config.cluster = ml_collections.ConfigDict(discovery.settings(None))
    config.cluster.source = source


def resolve_config_arg(argv: list[str]) -> list[str]:
    """Supplies `--config=configs/default.py` and finds built-in configs from any directory.

    A path that does not exist relative to the working directory but names a
    file of towerflow's own configs is rewritten to that file.
    """
    if not any(arg.startswith("--config=") for arg in argv):
        argv = [argv[0], f"--config={CONFIG_DIR / 'default.py'}", *argv[1:]]
    resolved = []
    for arg in argv:
        if arg.startswith("--config="):
            path, colon, rest = arg[len("--config=") :].partition(":")
            builtin = os.path.join(CONFIG_DIR, os.path.basename(path))
            if not os.path.exists(path) and os.path.exists(builtin):
                arg = f"--config={builtin}{colon}{rest}"
        resolved.append(arg)
    return resolved


def default_model_dir(config_path: str, strategy: str) -> str:
    """`runs/<config>-<strategy>` under the working directory: stable, so reruns resume."""
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("runs", f"{name}-{strategy}")


def parse_own_flags(argv: list[str]) -> list[str]:
    """absl parsing of a command that passes the flags after `--` to its children.

    A mistake is one line and exit status 2; an unknown flag is most likely a
    trainer flag put before the `--`.
    """
    from towerflow import errors  # after `own_packages_first`, as everywhere here

    try:
        return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        fail(f"{errors.one_line(e)}; put the trainer's flags after `--`.")
    except flags.Error as e:
        fail(errors.one_line(e))


def fail(message: str) -> None:
    """Prints one line for a user mistake and exits with status 2."""
    # Imported here: this module must not import `strategies` before `own_packages_first`.
    from towerflow.errors import USER_ERROR_EXIT_CODE

    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)


def config_file_error(error: BaseException, defined: Flags, argv: list[str]) -> str | None:
    """One line for a config file whose `get_config()` failed or returned no config, else None.

    An exception raised by the file's own code is the user's bug: its
    traceback is printed first, and the line names the file and the error.
    """
    path = _config_arg(argv).partition(":")[0]
    original = _raised_in(error, path)
    if original is not None:
        traceback.print_exception(original, file=sys.stderr)
        where = "its `get_config()`" if _in_get_config(original) else "its code"
        return (
            f"`--config` file '{path}': {where} failed with {type(original).__name__}: "
            f"{original} (the traceback above shows where)."
        )
    if isinstance(error, AttributeError) and "attribute 'get_config'" in str(error):
        return (
            f"`--config` file '{path}' has no `get_config()`; define one that returns "
            "the ConfigDict, as configs/default.py does."
        )
    if isinstance(error, NoConfig):
        return (
            f"`--config` file '{path}': its `get_config()` returned None, not a ConfigDict; "
            "end it with `return config`."
        )
    return None


class NoConfig(Exception):
    """A config file's `get_config()` returned None."""


def _refuse_no_config(flag: flags.Flag) -> None:
    """The `--config` flag raises `NoConfig` where a file's `get_config()` returns None.

    ml_collections only logs it; the first override or read of the config then
    fails on None with a lookup error that names neither the file nor the function.
    """
    parse = flag.parser.parse

    def parse_config(path: str):
        config = parse(path)
        if config is None:
            raise NoConfig(path)
        return config

    flag.parser.parse = parse_config


def _config_arg(argv: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))


def _raised_in(error: BaseException, path: str) -> BaseException | None:
    """The exception in `error`'s chain whose traceback passes through file `path`, if any."""
    seen, target = set(), os.path.realpath(path)
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = traceback.extract_tb(error.__traceback__)
        if any(os.path.realpath(frame.filename) == target for frame in frames):
            return error
        error = error.__cause__ or error.__context__
    return None


def _in_get_config(error: BaseException) -> bool:
    return any(frame.name == "get_config" for frame in traceback.extract_tb(error.__traceback__))


def flag_error(error: BaseException, argv: list[str]) -> str:
    """One line for a flag or config-file mistake, with the fix."""
    text = " ".join(str(error).replace("\\n", "\n").replace("\\'", "'").split())
    config = _config_arg(argv)
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
        f"configs/{p.name}" for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_")
    )


def guarded(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl `main` so a `UserError` becomes one line and exit status 2."""

    def wrapper(argv: list[str]) -> None:
        with native_stderr_silenced():
            # Importing `strategies` imports TensorFlow, whose runtime logs start-up
            # chatter to stderr; the device probe starts its CUDA layer, which does too.
            from strategies import devices

            devices.physical()
        from towerflow import errors
        from towerflow.errors import UserError
        from trainer.loop import faults
        from trainer.loop.checkpoints import NoSpace

        try:
            main(argv)
        except UserError as e:
            fail(errors.one_line(e))
        except faults.Preempted:
            sys.exit(errors.PREEMPTED_EXIT_CODE)
        except faults.Diverged as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(errors.DIVERGED_EXIT_CODE)
        except NoSpace as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(errors.NO_SPACE_EXIT_CODE)
        except faults.MemberLost as e:  # or `Reform`: elastic, saved for the group to re-form
            print(e if isinstance(e, faults.Reform) else f"error: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # No interpreter teardown: TensorFlow's would log connection errors to the
            # lost member for a while, or wait on it.
            os._exit(e.exit_code)

    return wrapper
