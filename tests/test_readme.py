"""The commands of the README and the docs pages run as a user types them, and do what they say.

The commands are read from README.md and docs/*.md themselves, so this test follows
them: every command of every ```sh block is either run here (the pages of
`RUN_PAGES`) or named in `ELSEWHERE` with the test that runs it as written; a
block that is neither fails `test_every_command_block_is_exercised`. Each
command run here runs as written, under the default strategy unless it names
one, with this repository importable (as from a clone's top directory, where
`examples/` lives): the single-process commands all in one working directory,
in page order (README first, then the pages in `RUN_PAGES`' order), as a user
types the tour (so each must cope with the `runs/` the ones before it left);
each cluster command in a fresh one; a command written on several pages runs
once. Left out: `pip install` (`.ci/run` installs the package), `python -m
pytest tests` (this suite) and templates naming `my_pkg`, the docs' stand-in for
the user's own package and files. The cluster commands run as written too. A
command whose page states no result, and whose checks hold after fewer steps, runs
with fewer (`FEWER_STEPS`, each with why). Each command runs in a process of its own, but
the listing and a run on the 4 logical CPUs this process has: those go through
the command's flags, main and exit in this process.
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
from tests.helpers import LOGICAL_CPUS, REPO, assert_exit, cli_in_process, run_command

# The pages whose commands this test runs, in order (README.md first).
RUN_PAGES = (
    "README.md",
    "docs/index.md",
    "docs/getting-started.md",
    "docs/strategies.md",
    "docs/model-parallelism.md",
    "docs/recommendation.md",
    "docs/performance.md",
    "docs/sweeps.md",
)
# Commands of any page that another test runs as written (or, for a long one, at a
# smaller size), by how the command starts: the test that does.
ELSEWHERE = {
    "python -m trainer --config=examples/retrieval.py": (
        "tests/test_retrieval.py::test_each_documented_command_trains_evaluates_and_exports"
    ),
    "python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server "
    "--config=examples/retrieval.py": (
        "tests/test_retrieval.py::test_each_documented_command_trains_evaluates_and_exports"
    ),
    "python -m examples.penguins data/": "tests/test_data_labels.py::"
    "test_the_readme_penguins_command_trains_to_090",
    "towerflow --config.data.name=csv --config.data.train_files=data/penguins-train.csv": (
        "tests/test_data_labels.py::test_the_readme_penguins_command_trains_to_090"
    ),
    "towerflow --config.model.name=examples.compiled_model:build": (
        "tests/test_examples.py::test_the_compiled_model_example_needs_no_task_code"
    ),
    "towerflow --config=examples/": (
        "tests/test_examples.py::test_each_example_under_mirrored_and_on_a_parameter_server_cluster"
    ),
    "python -m trainer.check --strategies=": (
        "tests/test_check.py::test_the_readmes_check_command_runs_as_written"
    ),
    "python -m trainer --strategy=one_device --config.data.service=local:1": (
        "tests/test_data_service.py::test_a_killed_server_ends_the_run_with_one_line_and_exit_144"
    ),
    "python -m trainer.launch --workers=2 --data_workers=1": (
        "tests/test_data_service.py::test_a_local_cluster_trains_on_the_launchers_data_workers"
    ),
    "python -m trainer.launch --workers=2 --ps=1 --data_workers=2": (
        "tests/test_data_service.py::test_a_local_cluster_trains_on_the_launchers_data_workers"
    ),
    "python -m trainer.data_service --role=": (
        "tests/test_data_service.py::test_a_trainer_reads_from_a_data_worker_on_another_host"
    ),
    "python -m trainer --config.data.service=grpc://host0:5050": (
        "tests/test_data_service.py::test_a_trainer_reads_from_a_data_worker_on_another_host"
    ),
    "srun -n3 python -m trainer.data_service --cluster=slurm": (
        "tests/test_data_service.py::test_a_slurm_step_is_a_dispatcher_and_data_workers"
    ),
    "srun python -m trainer.elastic --workers=2:4": (
        "tests/test_slurm.py::test_docs_elastic_job_loses_a_slurm_task_and_ends_with_the_others"
    ),
    "kubectl apply -f deploy/volume.yaml -f deploy/jobset-data-service.yaml": (
        "tests/test_deploy.py::test_each_data_service_pod_derives_its_role_port_and_dispatcher"
    ),
    "python -m trainer.sweep --sweep.optimizer.learning_rate=1e-3,3e-3 --parallel=2 --share_input"
    "": ("tests/test_data_service.py::test_sweep_trials_with_one_pipeline_share_one_stream"),
    "python -m trainer.launch --workers=3 --ps=1 -- --strategy=parameter_server "
    "--config.strategy.parameter_server.sync_replicas=2": (
        "tests/test_ps_sync.py::test_no_gradient_is_applied_twice_or_at_another_step"
    ),
    "python -m trainer.launch --workers=3 --ps=1 -- --strategy=parameter_server "
    "--config.strategy.parameter_server.staleness=scale": (
        "tests/test_ps_sync.py::test_async_staleness_is_recorded_and_the_stalest_updates_dropped"
    ),
    "python -m trainer.bench --cases=": "tests/test_bench.py::test_every_case_reports_every_figure",
    "python -m trainer --strategy=mirrored --config=examples/recsys.py": (
        "tests/test_recsys.py::test_the_readme_commands_train_the_recsys_example"
    ),
    "python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server "
    "--config=examples/recsys.py": (
        "tests/test_recsys.py::test_the_readme_commands_train_the_recsys_example"
    ),
    "python -m trainer.launch --workers=2:3 -- --strategy=multi_worker --model_dir=runs/elastic": (
        "tests/test_elastic.py::"
        "test_a_lost_member_is_saved_around_and_rejoins_ending_where_an_uninterrupted_run_does"
    ),
    "python -m trainer.launch --workers=2:3 -- --strategy=multi_worker "
    "--model_dir=runs/per_replica": (
        "tests/test_elastic.py::"
        "test_a_per_replica_group_that_shrinks_keeps_each_replicas_batch_and_scales_the_rate"
    ),
    "python -m trainer.elastic --workers=2:3 --name=a": (
        "tests/test_elastic_agents.py::"
        "test_three_agents_go_on_without_a_lost_host_and_take_it_back_when_it_returns"
    ),
    "python -m trainer --config=configs/ctr.py --config.strategy.name=one_device "
    "--config.data.ctr.id_space=raw": (
        "tests/test_tables_docs.py::test_the_pages_training_command_runs_as_written"
    ),
    "python -m trainer --strategy=one_device --config=configs/ctr.py "
    "--config.model.embedding=dynamic --config.model.table_optimizer=adagrad": (
        "tests/test_table_training.py::test_the_pages_per_table_optimizer_command_runs_as_written"
    ),
    "python -m examples.ragged_padding": (
        "tests/test_table_training.py::test_the_pages_padding_measurement_runs_and_prints_each_case"
    ),
    "python -m examples.online ": (
        "tests/test_docs_online.py::"
        "test_the_served_version_advances_while_training_and_matches_its_checkpoint"
    ),
    "python -m trainer --config=examples/online.py": (
        "tests/test_docs_online.py::"
        "test_the_served_version_advances_while_training_and_matches_its_checkpoint"
    ),
    "python -m trainer.launch --workers=2 -- --strategy=multi_worker --config.train.steps=20 "
    "--model_dir=runs/local": (
        "tests/test_local_network.py::test_the_pages_command_runs_as_written_and_shows_its_line"
    ),
    "python -m trainer.launch --workers=2 --allow_network": (
        "tests/test_local_network.py::test_the_pages_command_runs_as_written_and_shows_its_line"
    ),
    "tensorboard --logdir runs/profiled": (
        "tests/test_profile.py::test_tensorboard_lists_the_run_under_its_profile_plugin"
    ),
    "tensorboard --logdir runs/sweep-lr": (
        "tests/test_sweep.py::test_the_hparams_dashboard_compares_the_trials"
    ),
}
# Commands run here with `--config.train.steps=N` appended, fewer steps than a user's run
# trains, by the command as written: the page states no result for them, and what this test
# checks of each (every flag as written, the strategy and its replicas, every step of the
# job, the final weights evaluated to DIGITS_ACCURACY, the export, the evaluator's lines)
# holds after 200 steps (0.97 here) as after the default job's 1,000, which the README's
# first command trains as written.
FEWER_STEPS = {
    # 4 logical CPUs: what the page shows is the 4 replicas; the 1,000 steps of `mirrored`
    # are the README's first command's.
    "python -m trainer --strategy=mirrored --config.devices.logical_cpus=4 "
    "--model_dir=runs/mirrored-4": 200,
    # The same job, one device / variables on the host: the replicas, not the steps.
    "python -m trainer --strategy=one_device": 200,
    "python -m trainer --strategy=central_storage": 200,
    # The steps it profiles, 200 to 205, are in the run.
    "python -m trainer --config.train.profile_steps=(200,205) --model_dir=runs/profiled": 300,
    # The local clusters of digits: what a cluster adds (its members start, join, train,
    # evaluate, export, end) is the same after 200 steps; about 10 s of CPU less each.
    "python -m trainer.launch --workers=2 -- --strategy=multi_worker": 200,
    "python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server": 200,
    "python -m trainer.launch --workers=2 --ps=1 --evaluator -- --strategy=parameter_server": 200,
    # The ctr cluster: eval AUC past CTR_AUC (0.79 here after 300 steps, 0.81 after its 600)
    # with one checkpoint of its 6.4M parameters, not two; about 10 s of CPU less.
    "python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server "
    "--config=configs/ctr.py": 300,
}
SKIPPED = (("pip", "install"), ("python", "-m", "pytest"))
PLACEHOLDER = "my_pkg"  # the user's own package in the docs' templates
SLOW = ("trainer.sweep",)  # commands of minutes: the slow tier runs them
DEFAULTS = configs.default.get_config()
# The README promises "about 0.98" for the MLP on digits; every digits model of the tour
# should learn as well (chance is 0.1).
DIGITS_ACCURACY = 0.9
CTR_AUC = 0.75  # configs/ctr.py: "reach eval AUC 0.82"


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of a page's ```sh block, as argv, with its claim and where it is written."""

    argv: tuple[str, ...]
    claim: tuple[str, float] | None  # what its comment says it reaches: (metric, value)
    page: str

    @property
    def text(self) -> str:
        return " ".join(self.argv)


def page_commands(page: str) -> list[Command]:
    """Each command of the ```sh blocks of `page`, in order, with its claim.

    A claim is what the command's comment says it reaches, `...: 0.98` (accuracy)
    or `...: AUC 0.80`, as (metric, value); None where the comment says nothing.
    """
    text = pathlib.Path(REPO, page).read_text()
    commands = []
    for block in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```", text, re.M | re.DOTALL):
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
                    commands.append(Command(tuple(part), claim, page))
    return commands


def all_pages() -> list[str]:
    """README.md and every page of docs/, README first."""
    return ["README.md", *sorted(f"docs/{p.name}" for p in pathlib.Path(REPO, "docs").glob("*.md"))]


def elsewhere(command: Command) -> str | None:
    """The test that runs `command` as written, if another test does."""
    for start, test in ELSEWHERE.items():
        if command.text.startswith(start):
            return test
    return None


def readme_commands() -> list[Command]:
    """The commands this test runs: those of `RUN_PAGES` not run elsewhere, each once."""
    commands, seen = [], set()
    for page in RUN_PAGES:
        for command in page_commands(page):
            if elsewhere(command) is None and command.argv not in seen:
                seen.add(command.argv)
                commands.append(command)
    return commands


def _split_at(words: list[str], separator: str) -> tuple[list[str], list[str]]:
    if separator in words:
        i = words.index(separator)
        return words[:i], words[i + 1 :]
    return words, []


_COMMANDS = readme_commands()
COMMANDS = [list(command.argv) for command in _COMMANDS]
CLAIMS = [command.claim for command in _COMMANDS]  # what each command's comment says it reaches
CLAIM_SLACK = 0.03  # the docs say "about"


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

    def run(self, index: int, capsys) -> Run:
        if index not in self._runs:
            argv = _as_run(COMMANDS[index])
            cwd = self._workdir(index, capsys)
            if _same_in_this_process(argv):
                result = _in_this_process(argv, cwd, capsys)
            else:
                result = run_command([_program(argv[0]), *argv[1:]], str(cwd))
            self._runs[index] = Run(argv, result, cwd)
        return self._runs[index]

    def writer(self, index: int, model_dir: str, capsys) -> Run:
        """The earliest earlier command that wrote `model_dir` (run if it was not yet)."""
        for earlier in range(index):
            run = self.run(earlier, capsys)
            if (run.cwd / model_dir / "checkpoints").is_dir():
                return run
        raise AssertionError(f"no command before {COMMANDS[index]} writes {model_dir}")

    def _workdir(self, index: int, capsys) -> pathlib.Path:
        model_dir = _flag(COMMANDS[index], "--model_dir")
        if model_dir is not None and _flag(COMMANDS[index], "--mode") == "eval":
            return self.writer(index, model_dir, capsys).cwd
        if "trainer.launch" in COMMANDS[index]:
            return _clone_top(self._tmp.mktemp("readme"))
        # The single-process commands run in one directory, in README order, as a user
        # types the tour: each must cope with what the ones before it left in `runs/`.
        if self._shared is None:
            self._shared = _clone_top(self._tmp.mktemp("readme"))
        return self._shared


def _as_run(argv: list[str]) -> list[str]:
    """`argv` as this test runs it: as written, or with `FEWER_STEPS`' steps appended."""
    steps = FEWER_STEPS.get(" ".join(argv))
    return argv if steps is None else [*argv, f"--config.train.steps={steps}"]


def _same_in_this_process(argv: list[str]) -> bool:
    """The trainer's listing, or a run on as many logical CPUs as this process splits its CPU
    into (tests/conftest.py): a process of its own would only import TensorFlow again."""
    if argv[:3] != ["python", "-m", "trainer"]:
        return False
    cpus = _flag(argv, "--config.devices.logical_cpus")
    return "--list_strategies" in argv or cpus == str(LOGICAL_CPUS)


def _in_this_process(argv: list[str], cwd: pathlib.Path, capsys) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` in `cwd`, through the command's flags, main and exit, here."""
    code, out, err = cli_in_process(*argv[3:], capsys=capsys, cwd=cwd)
    return subprocess.CompletedProcess(argv, code, out, err)


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
    """The value after `key: ` on the start-up lines (a cluster's lines carry `[member] `)."""
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


def test_every_command_block_is_exercised():
    unexercised = [
        f"{command.page}: {command.text}"
        for page in all_pages()
        for command in page_commands(page)
        if page not in RUN_PAGES and elsewhere(command) is None
    ]
    assert not unexercised, (
        "commands that no test runs (add their page to RUN_PAGES, or the test that runs "
        "them to ELSEWHERE):\n" + "\n".join(unexercised)
    )


def test_each_test_named_elsewhere_exists_and_runs_a_documented_command():
    documented = [command for page in all_pages() for command in page_commands(page)]
    for start, test in ELSEWHERE.items():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", pathlib.Path(REPO, path).read_text(), re.M), test
        assert any(c.text.startswith(start) for c in documented), f"no page runs `{start}`"


def test_each_command_run_with_fewer_steps_is_one_a_page_writes():
    assert set(FEWER_STEPS) <= {" ".join(argv) for argv in COMMANDS}, (
        "a page's command changed: update FEWER_STEPS"
    )


def _params():
    for index, command in enumerate(COMMANDS):
        slow = any(word in command for word in SLOW)
        marks = [pytest.mark.slow] if slow else []
        yield pytest.param(index, marks=marks, id=" ".join(command))


@pytest.mark.parametrize("index", list(_params()))
def test_readme_command(index, runner, capsys):
    run = runner.run(index, capsys)
    argv, output = run.argv, run.output
    assert_exit(run.result, output=f"{' '.join(argv)}:\n{output[-3000:]}")
    if "trainer.sweep" in argv:
        _check_sweep(run)
    elif "--list_strategies" in argv:
        listed = [line.split()[0] for line in run.result.stdout.splitlines() if line.strip()]
        assert sorted(listed) == sorted(strategies.available())
    elif _flag(argv, "--mode") == "eval":
        _check_evaluation(runner, index, run, capsys)
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


def _check_sweep(run: Run) -> None:
    """Every trial of the sweep trained, ranked in `sweep.json`, the best one first."""
    summary = json.loads((run.cwd / _flag(run.argv, "--sweep_dir") / "sweep.json").read_text())
    assert [t["status"] for t in summary["trials"]] == ["finished"] * 6, summary["trials"]
    assert summary["best"] == summary["trials"][0]["trial"]


def _check_evaluation(runner: Runner, index: int, run: Run, capsys) -> None:
    """It evaluated the newest checkpoint of the earlier command, and trained nothing."""
    model_dir = _flag(run.argv, "--model_dir")
    written = runner.writer(index, model_dir, capsys).results_json(model_dir)
    evals = _evals(run.output)
    assert len(evals) == 1 and not re.search(r"^train +\|", run.output, re.MULTILINE)
    assert evals[0]["step"] == written["step"]
    assert evals[0]["accuracy"] == pytest.approx(written["eval"]["accuracy"], abs=1e-4)
