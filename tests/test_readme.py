"""The README's commands run to completion as a user types them, and do what it says.

The commands are read from README.md itself, so this test follows the README:
every command of the ```sh blocks at the top, in "A short tour" (with its
subsections), in "Clusters" and in "Recommendation models". Each runs as written, under the default
strategy unless it names one, with this repository importable (as from a
clone's top directory, where `examples/` lives): the single-process commands
all in one working directory, in README order, as a user types the tour (so
each must cope with the `runs/` the ones before it left); each cluster
command in a fresh one. Left
out: `pip install` (`.ci/run` installs the package), `python -m pytest tests`
(this suite) and templates naming `my_pkg`, the README's stand-in for the
user's own package and files. The cluster commands run as written too: each
takes well under a minute here.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import configs.default
import strategies
from tests.helpers import REPO, assert_exit, run_command

SECTIONS = ("", "A short tour", "Clusters", "Recommendation models")  # "": above the first
SKIPPED = (("pip", "install"), ("python", "-m", "pytest"))
PLACEHOLDER = "my_pkg"  # the user's own package in the README's templates
DEFAULTS = configs.default.get_config()
# The README promises "about 0.98" for the MLP on digits; every digits model of the tour
# should learn as well (chance is 0.1).
DIGITS_ACCURACY = 0.9
CTR_AUC = 0.75  # configs/ctr.py: "reach eval AUC 0.82"


def readme_commands(text: str) -> list[tuple[list[str], tuple[str, float] | None]]:
    """Each command to run, from the ```sh blocks of `SECTIONS`, in order, with its claim.

    A claim is what the command's comment says it reaches, `...: 0.98` (accuracy)
    or `...: AUC 0.80`, as (metric, value); None where the comment says nothing.
    """
    commands = []
    for title, body in _sections(text):
        if title not in SECTIONS:
            continue
        for block in re.findall(r"^```sh\n(.*?)^```", body, re.MULTILINE | re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():  # continued lines joined
                words = shlex.split(line, comments=True)
                claim = re.search(r"#.*:\s*(AUC )?(0\.\d+)\s*$", line)
                if claim:
                    claim = ("auc" if claim[1] else "accuracy", float(claim[2]))
                while words:  # `a && b`: each part on its own
                    part, words = _split_at(words, "&&")
                    if any(part[: len(s)] == list(s) for s in SKIPPED):
                        continue
                    if part and not any(PLACEHOLDER in word for word in part):
                        commands.append((part, claim))
    return commands


def _sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each `## ` section; the text above the first has the title ""."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2])]


def _split_at(words: list[str], separator: str) -> tuple[list[str], list[str]]:
    if separator in words:
        i = words.index(separator)
        return words[:i], words[i + 1 :]
    return words, []


_COMMANDS = readme_commands(pathlib.Path(REPO, "README.md").read_text())
COMMANDS = [argv for argv, _ in _COMMANDS]
CLAIMS = [claim for _, claim in _COMMANDS]  # what each command's comment says it reaches
CLAIM_SLACK = 0.03  # the README says "about"


@dataclasses.dataclass
class Run:
    """One command run: its result, its working directory and what it printed (both streams)."""

    argv: list[str]
    result: subprocess.CompletedProcess
    cwd: pathlib.Path

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr

    def results_json(self, model_dir: str) -> dict:
        return json.loads((self.cwd / model_dir / "results.json").read_text())


class Runner:
    """Runs the README's commands, each once, in README order where one needs another."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._runs: dict[int, Run] = {}
        self._shared: pathlib.Path | None = None

    def run(self, index: int) -> Run:
        if index not in self._runs:
            argv = COMMANDS[index]
            cwd = self._workdir(index)
            result = run_command([_program(argv[0]), *argv[1:]], str(cwd))
            self._runs[index] = Run(argv, result, cwd)
        return self._runs[index]

    def writer(self, index: int, model_dir: str) -> Run:
        """The earliest earlier command that wrote `model_dir` (run if it was not yet)."""
        for earlier in range(index):
            run = self.run(earlier)
            if (run.cwd / model_dir / "checkpoints").is_dir():
                return run
        raise AssertionError(f"no command before {COMMANDS[index]} writes {model_dir}")

    def _workdir(self, index: int) -> pathlib.Path:
        model_dir = _flag(COMMANDS[index], "--model_dir")
        if model_dir is not None and _flag(COMMANDS[index], "--mode") == "eval":
            return self.writer(index, model_dir).cwd
        if "trainer.launch" in COMMANDS[index]:
            return _clone_top(self._tmp.mktemp("readme"))
        # The single-process commands run in one directory, in README order, as a user
        # types the tour: each must cope with what the ones before it left in `runs/`.
        if self._shared is None:
            self._shared = _clone_top(self._tmp.mktemp("readme"))
        return self._shared


def _clone_top(directory: pathlib.Path) -> pathlib.Path:
    """`directory` made to look like a clone's top directory: `examples/` is there."""
    (directory / "examples").symlink_to(pathlib.Path(REPO, "examples"))
    return directory


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Runner:
    return Runner(tmp_path_factory)


def _program(name: str) -> str:
    """`python` is this interpreter; a console script (`towerflow`) is the one beside it."""
    if name == "python":
        return sys.executable
    script = pathlib.Path(sys.executable).parent / name
    assert script.is_file(), f"`{name}` is not installed beside {sys.executable}"
    return str(script)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `--name=value` in `argv` (the last one), or None."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")]
    return values[-1] if values else None


def _printed(output: str, key: str) -> str:
    """The value after `key: ` on the start-up lines (a cluster's lines carry a `[task] `)."""
    match = re.search(rf"^(?:\[\S+\] )?{key}: (\S+)", output, re.MULTILINE)
    assert match, f"no `{key}:` line in:\n{output[-3000:]}"
    return match.group(1)


def _evals(output: str) -> list[dict[str, float]]:
    """Every `eval | step: N | loss: ... | accuracy: ...` line, as numbers."""
    evals = []
    for line in re.findall(r"^(?:\[\S+\] )?eval +\| (.*)$", output, re.MULTILINE):
        pairs = (field.split(": ") for field in line.split(" | "))
        evals.append({key: float(value) for key, value in pairs})
    return evals


def test_the_readme_has_commands_in_every_section():
    assert ["python", "-m", "trainer", "--strategy=mirrored"] in COMMANDS  # the first one
    assert any(argv[:3] == ["python", "-m", "trainer.launch"] for argv in COMMANDS)
    assert any(_flag(argv, "--mode") == "eval" for argv in COMMANDS)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[" ".join(c) for c in COMMANDS])
def test_readme_command(index, runner):
    run = runner.run(index)
    argv, output = run.argv, run.output
    assert_exit(run.result, output=f"{' '.join(argv)}:\n{output[-3000:]}")
    if "--list_strategies" in argv:
        listed = [line.split()[0] for line in run.result.stdout.splitlines() if line.strip()]
        assert sorted(listed) == sorted(strategies.available())
    elif _flag(argv, "--mode") == "eval":
        _check_evaluation(runner, index, run)
    else:
        _check_training(run, CLAIMS[index])


def _check_training(run: Run, claim: tuple[str, float] | None) -> None:
    """It trained every step of the job, evaluated, exported and said where."""
    argv, output = run.argv, run.output
    strategy = _flag(argv, "--strategy") or DEFAULTS.strategy.name
    assert _printed(output, "strategy") == strategy
    logical_cpus = int(
        _flag(argv, "--config.devices.logical_cpus") or DEFAULTS.devices.logical_cpus
    )
    replicas = int(re.search(r"^(?:\[\S+\] )?strategy: .*\| replicas: (\d+)", output, re.M)[1])
    if strategy in ("mirrored", "central_storage"):  # a replica per logical CPU
        assert replicas == logical_cpus
    if strategy == "one_device":
        assert replicas == 1
    if model := _flag(argv, "--config.model.name"):
        assert _printed(output, "model") == model
    model_dir = _printed(output, "model_dir")
    results = run.results_json(model_dir)
    steps = int(_flag(argv, "--config.train.steps") or re.search(r"steps: (\d+)", output)[1])
    assert results["step"] == steps
    assert (run.cwd / model_dir / "export" / "saved_model.pb").is_file()
    final = _evals(output)[-1]
    assert final["step"] == steps, "it evaluated the final weights"
    if claim:  # what the README's comment says it reaches
        metric, value = claim
        accuracy = next((k for k in final if k.endswith("accuracy")), "accuracy")
        assert final[accuracy if metric == "accuracy" else metric] >= value - CLAIM_SLACK, final
    elif "auc" in final:  # click-through: configs/ctr.py's promise
        assert final["auc"] >= CTR_AUC, final
    else:
        assert final["accuracy"] >= DIGITS_ACCURACY, final
    if "--evaluator" in argv:
        assert re.search(r"^\[evaluator\] eval +\|", output, re.MULTILINE), output[-3000:]


def _check_evaluation(runner: Runner, index: int, run: Run) -> None:
    """It evaluated the newest checkpoint of the earlier command, and trained nothing."""
    model_dir = _flag(run.argv, "--model_dir")
    written = runner.writer(index, model_dir).results_json(model_dir)
    evals = _evals(run.output)
    assert len(evals) == 1 and not re.search(r"^train +\|", run.output, re.MULTILINE)
    assert evals[0]["step"] == written["step"]
    assert evals[0]["accuracy"] == pytest.approx(written["eval"]["accuracy"], abs=1e-4)
