"""What a sweep runs and where: its trials (grid or random) and one slot of devices per trial.

`python -m trainer.sweep` (see `trainer/sweep/__main__.py`) builds its plan here, before it
starts anything: `--sweep.<field>=v1,v2,...` values are checked against the
config with the parser that `--config.<field>=` overrides use, so a trial gets
exactly the value the sweep validated, and a bad field or value is one line.
Nothing here imports TensorFlow or touches a device.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import random
import re
import shutil
import subprocess
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from towerflow import renamed
from towerflow.errors import UserError
from trainer import cli

SWEEP_PREFIX = "--sweep."
SEARCHES = ("grid", "random")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of a sweep: an ordinary `python -m trainer` job with its own `model_dir`.

    Attributes:
      index: its place in the sweep (stable: the same command plans the same trials).
      name: its directory under the sweep's, from its index and values.
      overrides: `(field, value as typed)` pairs, each passed as `--config.<field>=<value>`.
      config: its resolved config (the config file, the trainer flags, its overrides).
      settings: more `(field, value)` overrides that are not swept values (e.g. where
        its input runs, `--share_input`).
    """

    index: int
    name: str
    overrides: tuple[tuple[str, str], ...]
    config: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def flags(self) -> list[str]:
        """Its overrides and settings as trainer flags."""
        return [f"--config.{field}={value}" for field, value in self.overrides + self.settings]


@dataclasses.dataclass(frozen=True)
class TrialSlot:
    """Where one trial runs: the GPUs it sees (CUDA ids; none without GPUs) and its cores."""

    gpus: tuple[str, ...]
    cores: tuple[int, ...]

    def env(self) -> dict[str, str]:
        """Environment of a trial in this slot: its GPUs and as many inter-op threads as cores."""
        env = {"TF_NUM_INTEROP_THREADS": str(len(self.cores))}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def describe(self) -> str:
        """e.g. "GPU 1, cores 4-7" or "cores 0"."""
        cores = f"cores {self.cores[0]}" + (f"-{self.cores[-1]}" if len(self.cores) > 1 else "")
        return f"GPU {','.join(self.gpus)}, {cores}" if self.gpus else cores


def split_sweep_args(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Takes the `--sweep.<field>=<values>` arguments out of the sweep's own (before `--`).

    Returns:
      The other arguments, and `{field: values as typed}` in command-line order.

    Raises:
      UserError: a `--sweep.` argument without `=values`, or a field given twice.
    """
    rest, sweeps = [], {}
    for position, arg in enumerate(argv):
        if arg == "--":
            return rest + list(argv[position:]), sweeps
        if not arg.startswith(SWEEP_PREFIX):
            rest.append(arg)
            continue
        field, equals, values = arg[len(SWEEP_PREFIX) :].partition("=")
        if not field or not equals or not values.strip():
            raise UserError(
                f"`{arg}` gives no values; write `--sweep.<field>=v1,v2,...`, "
                "e.g. `--sweep.optimizer.learning_rate=1e-3,3e-3`."
            )
        if field in sweeps:
            raise UserError(f"`--sweep.{field}` is given twice; give all its values in one flag.")
        sweeps[field] = values
    return rest, sweeps


def split_values(text: str) -> list[str]:
    """`1e-3,3e-3` -> ["1e-3", "3e-3"]; `(128,),(256,256)` -> ["(128,)", "(256,256)"].

    Commas inside brackets or quotes belong to one value.
    """
    values, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def load_config(config_path: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """The config a trial with these `--config.` (and `--strategy=`) flags resolves to.

    The same loading and override parsing as `python -m trainer`.

    Raises:
      UserError: the file does not load, a field does not exist, a value does not parse.
    """
    strategy = [a.split("=", 1)[1] for a in overrides if a.startswith("--strategy=")]
    argv = cli.resolve_config_arg(
        ["sweep", f"--config={config_path}", *(a for a in overrides if a.startswith("--config."))]
    )
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", None, "", flag_values=values, lock_config=True, sys_argv=argv
    )
    try:
        values(argv)
        config = holder.value
    except Exception as e:  # config files and overrides raise plain errors, not flags.Error
        raise UserError(cli.flag_error(e, argv)) from None
    if strategy:
        config.strategy.name = strategy[-1]
    return config


def plan_trials(
    config_path: str,
    sweeps: dict[str, str],
    trainer_args: Sequence[str],
    search: str = "grid",
    trials: int = 0,
    seed: int = 0,
) -> list[Trial]:
    """The sweep's trials, each with its resolved config.

    Args:
      config_path: the `--config` file every trial runs.
      sweeps: `{field: "v1,v2,..."}` from `split_sweep_args`.
      trainer_args: the trainer flags after `--`, the same for every trial.
      search: "grid": every combination, in order (`trials` > 0 keeps the first
        `trials`); "random": `trials` distinct combinations drawn with `seed`.
      trials: how many trials (0: the whole grid).
      seed: the random search's seed.

    Raises:
      UserError: no `--sweep.` field, a field not in the config or also in the
        trainer flags, a value of the wrong type, or a bad `--trials`/`--search`.
    """
    _check_flags(sweeps, trainer_args, search, trials)
    base = load_config(config_path, trainer_args)
    choices = {
        field: _field_values(base, config_path, field, text) for field, text in sweeps.items()
    }
    grid = list(itertools.product(*choices.values()))
    if search == "random":
        if trials > len(grid):
            raise UserError(
                f"`--trials` ({trials}) is more than the {len(grid)} distinct combinations of "
                f"the swept values; pass `--trials={len(grid)}` or fewer, or add values."
            )
        grid = random.Random(seed).sample(grid, trials)
    elif trials:
        grid = grid[:trials]
    fields = list(choices)
    return [
        _trial(index, tuple(zip(fields, values, strict=True)), config_path, trainer_args)
        for index, values in enumerate(grid)
    ]


def _check_flags(
    sweeps: dict[str, str], trainer_args: Sequence[str], search: str, trials: int
) -> None:
    """The sweep's own flags, and trainer flags that would clash with them.

    Raises:
      UserError: no `--sweep.` field, a bad `--search` or `--trials`, or a trainer
        flag the sweep sets (`--model_dir`, `--config`, a swept field).
    """
    if not sweeps:
        raise UserError(
            "no `--sweep.<field>=v1,v2,...` flag: give at least one field to sweep, "
            "e.g. `--sweep.optimizer.learning_rate=1e-3,3e-3`."
        )
    if search not in SEARCHES:
        raise UserError(f"`--search` '{search}' is not one of: {', '.join(SEARCHES)}.")
    if trials < 0 or (search == "random" and trials == 0):
        rule = "at least 1 with `--search=random`" if trials == 0 else "0 (all) or more"
        raise UserError(f"`--trials` ({trials}) must be {rule}; e.g. `--trials=4`.")
    for arg in trainer_args:
        name = arg.split("=", 1)[0]
        if name in ("--model_dir", "--config"):
            raise UserError(
                f"`{name}` is set by the sweep for each trial; drop it from the trainer flags "
                "(the sweep's own `--config` and `--sweep_dir` set them)."
            )
        if name.removeprefix("--config.") in sweeps:
            raise UserError(
                f"`{name}` is swept (`--sweep.{name.removeprefix('--config.')}`); "
                "drop it from the trainer flags."
            )


def _field_values(
    base: ml_collections.ConfigDict, config_path: str, field: str, text: str
) -> list[str]:
    """Checks that `field` exists and that each of its values parses as the field's type."""
    section, path = base, []
    for key in field.split("."):
        if not isinstance(section, ml_collections.ConfigDict) or key not in section:
            known = list(section.keys()) if isinstance(section, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(key, known, n=1)
            fix = (
                f"did you mean `--sweep.{'.'.join([*path, close[0]])}`?"
                if close
                else f"name a field of `{config_path}`, e.g. `--sweep.optimizer.learning_rate`."
            )
            raise UserError(
                f"`--sweep.{field}`: the config has no field `{field}` (no `{key}` there); {fix}"
            )
        section = section[key]
        path.append(key)
    values = split_values(text)
    for value in values:
        try:
            load_config(config_path, [f"--config.{field}={value}"])
        except UserError as e:
            raise UserError(str(e).replace("`--config.", "`--sweep.")) from None
    return values


def _trial(
    index: int, overrides: tuple[tuple[str, str], ...], config_path: str, trainer_args
) -> Trial:
    flags_ = [*trainer_args, *(f"--config.{f}={v}" for f, v in overrides)]
    leaves = [field.rsplit(".", 1)[-1] for field, _ in overrides]
    unique = len(set(leaves)) == len(leaves)
    parts = [
        f"{leaf if unique else field}={_slug(value)}"
        for leaf, (field, value) in zip(leaves, overrides, strict=True)
    ]
    name = f"{index:02d}-" + ",".join(parts)
    return Trial(index, name[:100], overrides, load_config(config_path, flags_))


def _slug(value: str) -> str:
    """A value as a file name's part: `(256, 256)` -> `256_256`."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", value).strip("_") or "_"


def devices_per_trial(config: ml_collections.ConfigDict) -> int:
    """GPUs one trial needs: as many as its strategy's `devices` option lists, else 1.

    A trial sees its GPUs renumbered from 0 (`CUDA_VISIBLE_DEVICES`), so
    `strategy.mirrored.devices="/gpu:0,/gpu:1"` asks for two.
    """
    options = config.strategy.get(config.strategy.name) or {}
    spec = options.get("devices", "") if hasattr(options, "get") else ""
    return max(1, len([d for d in str(spec).split(",") if "gpu" in d.lower()]))


def visible_gpus() -> list[str]:
    """CUDA ids of this machine's GPUs, as the sweep may hand them out (no TensorFlow needed).

    `CUDA_VISIBLE_DEVICES`, when set, limits them (its ids are used as given);
    otherwise `nvidia-smi` lists them; no `nvidia-smi` means no GPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def plan_slots(
    parallel: str, per_trial: int, gpus: Sequence[str], cores: Sequence[int]
) -> list[TrialSlot]:
    """One slot per trial that runs at once.

    Args:
      parallel: "auto" or a count. auto is one trial per `per_trial` GPUs, and on
        a machine without GPUs one trial (with every core): on CPUs, trials side
        by side only share the same cores (see docs/sweeps.md's measurements).
      per_trial: GPUs one trial needs (`devices_per_trial`).
      gpus: CUDA ids to hand out (`visible_gpus`); none on a CPU-only machine.
      cores: the CPU cores this process may use, shared out evenly among the slots
        (with more slots than cores, slots share cores round-robin).

    Raises:
      UserError: `parallel` is not auto or a positive count, or there are not
        enough GPUs for that many trials.
    """
    if parallel == "auto":
        count = len(gpus) // per_trial if gpus else 1
    elif parallel.isdigit() and int(parallel) > 0:
        count = int(parallel)
    else:
        raise UserError(f"`--parallel` ('{parallel}') must be auto or a positive count, e.g. 2.")
    if gpus and count * per_trial > len(gpus):
        raise UserError(
            f"`--parallel` ({count}) trials of {per_trial} GPU(s) each need {count * per_trial} "
            f"GPUs, and {len(gpus)} are visible ({', '.join(gpus)}); pass "
            f"`--parallel={max(1, len(gpus) // per_trial)}` or fewer."
        )
    if gpus and per_trial > len(gpus):
        raise UserError(
            f"a trial needs {per_trial} GPUs (its strategy's `devices`) and {len(gpus)} are "
            "visible; list fewer devices."
        )
    share = max(1, len(cores) // count)
    slots = []
    for i in range(count):
        mine = tuple(cores[i * share : (i + 1) * share]) or (cores[i % len(cores)],)
        slots.append(TrialSlot(tuple(gpus[i * per_trial : (i + 1) * per_trial]), mine))
    return slots


__getattr__ = renamed.old_names(__name__, {"Slot": "TrialSlot"}, globals())
