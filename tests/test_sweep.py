"""`python -m trainer.sweep`: trials planned from `--sweep.` values, run, ranked, resumed, stopped.

The plan (grid and random expansion, checks, slots) is tested in-process; the
command runs real trials (tiny: 20 steps) as a user would, in a subprocess.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pathlib
import signal
import time

import pytest
import tensorflow as tf

from tests.helpers import (
    REPO,
    TIMEOUT_S,
    assert_exit,
    descendants,
    one_line_error,
    run_cli,
    running,
    start_cli,
)
from tests.test_hparams import dashboard
from towerflow.errors import UserError
from trainer.sweep import plan as sweep_plan

CONFIG = os.path.join(REPO, "configs", "default.py")
TINY = [
    "--strategy=one_device",
    "--config.train.steps=20",
    "--config.train.steps_per_loop=10",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.model.hidden_units=(32,)",
]


def test_values_split_at_top_level_commas_only():
    assert sweep_plan.split_values("1e-3, 3e-3,1e-2") == ["1e-3", "3e-3", "1e-2"]
    assert sweep_plan.split_values("(128,),(256,256)") == ["(128,)", "(256,256)"]
    assert sweep_plan.split_values("'a,b',c") == ["'a,b'", "c"]


def test_sweep_flags_are_taken_out_before_the_separator_only():
    rest, sweeps = sweep_plan.split_sweep_args(
        ["prog", "--sweep.optimizer.name=adam,sgd", "--trials=2", "--", "--sweep.x=1"]
    )
    assert sweeps == {"optimizer.name": "adam,sgd"}
    assert rest == ["prog", "--trials=2", "--", "--sweep.x=1"]


def test_grid_is_every_combination_in_order_with_resolved_configs():
    trials = sweep_plan.plan_trials(
        CONFIG,
        {"optimizer.learning_rate": "1e-3,3e-3,1e-2", "model.hidden_units": "(128,),(256,256)"},
        ["--strategy=one_device", "--config.train.steps=7"],
    )
    assert [t.overrides for t in trials] == [
        (("optimizer.learning_rate", lr), ("model.hidden_units", units))
        for lr in ("1e-3", "3e-3", "1e-2")
        for units in ("(128,)", "(256,256)")
    ]
    assert trials[1].name == "01-learning_rate=1e-3,hidden_units=256_256"
    assert trials[5].config.optimizer.learning_rate == 1e-2
    assert trials[5].config.model.hidden_units == (256, 256)
    assert trials[5].config.train.steps == 7 and trials[5].config.strategy.name == "one_device"
    assert trials[1].flags == [
        "--config.optimizer.learning_rate=1e-3",
        "--config.model.hidden_units=(256,256)",
    ]
    assert len({t.name for t in trials}) == 6
    first_two = sweep_plan.plan_trials(CONFIG, {"optimizer.name": "adam,sgd,adamw"}, [], trials=2)
    assert [t.overrides[0][1] for t in first_two] == ["adam", "sgd"]


def test_random_search_draws_distinct_combinations_repeatably():
    sweeps = {"optimizer.learning_rate": "1e-4,1e-3,1e-2,1e-1", "optimizer.name": "adam,sgd"}

    def draw(seed):
        trials = sweep_plan.plan_trials(CONFIG, sweeps, [], "random", trials=5, seed=seed)
        return [t.overrides for t in trials]

    grid = [t.overrides for t in sweep_plan.plan_trials(CONFIG, sweeps, [])]
    drawn = draw(1)
    assert len(set(drawn)) == 5 and set(drawn) <= set(grid)
    assert draw(1) == drawn and draw(2) != drawn
    message = one_line_error(
        "more than the 8", sweep_plan.plan_trials, CONFIG, sweeps, [], "random", 9
    )
    assert "`--trials=8`" in message


@pytest.mark.parametrize(
    "sweeps, trainer_args, expected",
    [
        ({"optimizer.nosuch": "1,2"}, [], r"`--sweep.optimizer.nosuch`: the config has no field"),
        (
            {"optimizer.learning_rate": "1e-3,abc"},
            [],
            r"`--sweep.optimizer.learning_rate` got 'abc'",
        ),
        ({"train.steps": "10,1.5"}, [], r"`--sweep.train.steps` got '1.5'"),
        ({"train.steps": "10"}, ["--config.train.steps=5"], r"`--config.train.steps` is swept"),
        ({"train.steps": "10"}, ["--model_dir=x"], r"`--model_dir` is set by the sweep"),
        ({}, [], r"no `--sweep.<field>=v1,v2,...` flag"),
    ],
)
def test_bad_sweeps_are_one_line_naming_the_field(sweeps, trainer_args, expected):
    one_line_error(expected, sweep_plan.plan_trials, CONFIG, sweeps, trainer_args)


def test_slots_share_out_gpus_and_cores():
    cpu = sweep_plan.plan_slots("2", 1, [], [0, 1])
    assert [s.cores for s in cpu] == [(0,), (1,)] and all(not s.gpus for s in cpu)
    assert cpu[0].env() == {"TF_NUM_INTEROP_THREADS": "1"}
    assert [s.cores for s in sweep_plan.plan_slots("auto", 1, [], [0, 1])] == [(0, 1)]
    three = sweep_plan.plan_slots("3", 1, [], [0, 1])  # more trials than cores: shared
    assert [s.cores for s in three] == [(0,), (1,), (0,)]
    gpu = sweep_plan.plan_slots("auto", 2, ["0", "1", "2", "3"], list(range(16)))
    assert [s.gpus for s in gpu] == [("0", "1"), ("2", "3")]
    assert gpu[1].cores == tuple(range(8, 16))
    assert gpu[1].env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(UserError, match="need 6 GPUs"):
        sweep_plan.plan_slots("3", 2, ["0", "1", "2", "3"], [0])


def test_a_trial_of_a_strategy_over_two_gpus_gets_two():
    (trial,) = sweep_plan.plan_trials(
        CONFIG,
        {"optimizer.name": "adam"},
        ["--strategy=mirrored", "--config.strategy.mirrored.devices=/gpu:0,/gpu:1"],
    )
    assert sweep_plan.devices_per_trial(trial.config) == 2


def _sweep_args(sweep_dir: pathlib.Path) -> list[str]:
    return [
        f"--config={CONFIG}",
        "--sweep.optimizer.learning_rate=1e-3,3e-2",
        "--sweep.optimizer.name=adam,nosuch",
        "--trials=3",  # adam at 1e-3, nosuch at 1e-3 (fails), adam at 3e-2
        "--parallel=2",
        f"--sweep_dir={sweep_dir}",
        "--",
        *TINY,
    ]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 3-trial sweep, one trial with a bad value, 2 at a time; then the same command again."""
    cwd = tmp_path_factory.mktemp("sweep")
    sweep_dir = cwd / "sw"
    first = run_cli(*_sweep_args(sweep_dir), cwd=str(cwd), module="trainer.sweep")
    finished = sweep_dir / "00-learning_rate=1e-3,name=adam" / "results.json"
    mtime = finished.stat().st_mtime_ns
    again = run_cli(*_sweep_args(sweep_dir), cwd=str(cwd), module="trainer.sweep")
    return sweep_dir, first, again, finished.stat().st_mtime_ns == mtime


def test_a_sweep_ranks_its_trials_and_a_bad_value_fails_only_its_row(swept):
    sweep_dir, first, _, _ = swept
    assert_exit(first, 1)  # a trial failed; the sweep went on
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    rows = summary["trials"]
    assert [r["status"] for r in rows] == ["finished", "finished", "failed"]
    accuracies = [r["eval"]["accuracy"] for r in rows[:2]]
    assert accuracies == sorted(accuracies, reverse=True)  # eval/accuracy, max first
    assert summary["best"] == rows[0]["trial"] == "02-learning_rate=3e-2,name=adam"
    assert rows[2]["overrides"] == {"optimizer.learning_rate": "1e-3", "optimizer.name": "nosuch"}
    assert rows[2]["error"].startswith("Unknown `optimizer.name` 'nosuch'")
    for row in rows[:2]:  # each row holds its trial's own results.json
        results = json.loads((pathlib.Path(row["model_dir"]) / "results.json").read_text())
        assert row["eval"] == results["eval"] and row["step"] == results["step"] == 20
    with open(sweep_dir / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["trial"] for r in table] == [r["trial"] for r in rows]
    assert float(table[0]["eval/accuracy"]) == pytest.approx(accuracies[0])
    assert f"best: {summary['best']}" in first.stdout
    # Two trials at once share the cores out: each trial's ops get its half.
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    log = (sweep_dir / "logs" / f"{rows[0]['trial']}.log").read_text()
    assert f"threads per op: {share}" in log
    assert "failed: Unknown `optimizer.name` 'nosuch'" in first.stdout


def test_rerunning_the_sweep_skips_finished_trials(swept):
    sweep_dir, first, again, untouched = swept
    assert_exit(again, 1)
    assert untouched  # the finished trial's results.json was not written again
    assert again.stdout.count("not run again") == 2
    assert "starting 01-" in again.stdout and "starting 00-" not in again.stdout
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["status"] for r in summary["trials"]] == ["finished", "finished", "failed"]


def test_the_hparams_dashboard_compares_the_trials(swept):
    sweep_dir, _, _, _ = swept
    experiment, sessions = dashboard(str(sweep_dir))
    assert set(sessions) == {"00-learning_rate=1e-3,name=adam", "02-learning_rate=3e-2,name=adam"}
    rates = {s["hparams"]["optimizer.learning_rate"] for s in sessions.values()}
    assert rates == {1e-3, 3e-2}
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    for row in summary["trials"][:2]:
        shown = sessions[row["trial"]]["metrics"]["eval/accuracy"]
        assert shown == pytest.approx(row["eval"]["accuracy"])
    differing = {i.name for i in experiment.hparam_infos if i.differs}
    assert "optimizer.learning_rate" in differing


def test_a_bad_sweep_flag_is_one_line_exit_2_and_writes_nothing(tmp_path):
    result = run_cli(
        "--sweep.optimizer.learning_rat=1e-3,1e-2",
        "--sweep_dir=sw",
        "--",
        *TINY,
        cwd=str(tmp_path),
        module="trainer.sweep",
    )
    assert_exit(result, 2)
    assert result.stderr.strip().splitlines() == [
        "error: `--sweep.optimizer.learning_rat`: the config has no field "
        "`optimizer.learning_rat` (no `learning_rat` there); did you mean "
        "`--sweep.optimizer.learning_rate`?"
    ]
    assert not os.listdir(tmp_path)


@pytest.mark.slow  # a second sweep: the default tier's forks its trials
def test_with_nofork_trials_each_trial_is_an_interpreter_of_its_own(tmp_path):
    sweep_dir = tmp_path / "sw"
    args = [f"--config={CONFIG}", "--sweep.optimizer.learning_rate=1e-3,3e-3"]
    args += ["--nofork_trials", f"--sweep_dir={sweep_dir}", "--", *TINY]
    proc = start_cli(*args, cwd=str(tmp_path), module="trainer.sweep")
    commands = []
    for line in proc.stdout:
        if "] train |" in line and not commands:  # a trial runs: its command line, seen
            for pid in descendants({proc.pid}):
                with contextlib.suppress(OSError):
                    commands.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes())
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert_exit(proc, output=out[-3000:])
    # Its own command line: a forked trial's would be its server's.
    assert any(f"--model_dir={sweep_dir}".encode() in c for c in commands), commands
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["status"] for r in summary["trials"]] == ["finished", "finished"]


@pytest.mark.slow  # a sweep interrupted, then rerun
def test_ctrl_c_saves_every_trial_and_a_rerun_resumes_them(tmp_path):
    sweep_dir = tmp_path / "sw"
    args = [
        f"--config={CONFIG}",
        "--sweep.optimizer.learning_rate=1e-3,3e-3",
        "--parallel=2",
        f"--sweep_dir={sweep_dir}",
        "--grace_s=120",  # generous: saving is quick, a loaded machine is slow
        "--",
        *TINY,
        "--config.train.steps=1000000",  # runs until stopped
        "--config.train.checkpoint_every=1000000",
    ]
    proc = start_cli(*args, cwd=str(tmp_path), module="trainer.sweep")
    training = set()
    for line in proc.stdout:  # both trials are past their first block
        if "] train |" in line:
            training.add(line[:4])
        if len(training) == 2:
            break
    trials = descendants({proc.pid})  # (forked, they show the server's command line)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert_exit(proc, 128 + signal.SIGINT, output=out[-3000:])
    deadline = time.monotonic() + 60  # the sweep reaped them: nothing should be left at all
    while [pid for pid in trials if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert trials and not [pid for pid in trials if running(pid)]
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["status"] for r in summary["trials"]] == ["interrupted", "interrupted"]
    steps = {}
    for row in summary["trials"]:
        checkpoint = tf.train.latest_checkpoint(os.path.join(row["model_dir"], "checkpoints"))
        steps[row["trial"]] = int(checkpoint.rsplit("-", 1)[1])
        assert steps[row["trial"]] > 10, "SIGTERM saved the step reached"
    assert out.count("preempted") == 2, out[-3000:]

    # The same sweep again (here with fewer steps, to end at once): each trial resumes
    # from its checkpoint, with nothing left to train.
    resumed = run_cli(*args, "--config.train.steps=10", cwd=str(tmp_path), module="trainer.sweep")
    assert_exit(resumed)
    for trial, step in steps.items():
        assert "restored" in (sweep_dir / "logs" / f"{trial}.log").read_text()
        results = json.loads((sweep_dir / trial / "results.json").read_text())
        assert results["step"] == step
