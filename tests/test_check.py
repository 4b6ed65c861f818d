"""`python -m trainer.check`: the user's job under several strategies, compared, with causes."""

import pathlib
import re
import shlex
import sys

import pytest

from tests.helpers import REPO, assert_exit, run_cli, run_command
from tests.steps_two_replicas import TWO_CPUS
from towerflow.errors import UserError
from trainer import check

STEPS = 6
SMALL = ["--config.train.global_batch_size=32", "--config.devices.logical_cpus=4"]


def _check(model: str, strategies: list[str], tmp_path, capsys, *flags: str):
    config = check.trainer_config([f"--config.model.name={model}", *SMALL, *flags])
    code = check.check(config, strategies, STEPS, 1e-4, str(tmp_path))
    return code, capsys.readouterr().out


def _row(out: str, strategy: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"{strategy} "))


def test_keras_dropout_differs_and_is_named_as_the_cause(tmp_path, capsys):
    code, out = _check(
        "tests.check_models:keras_dropout",
        ["one_device", "mirrored"],
        tmp_path,
        capsys,
        f"--config.strategy.mirrored.devices={TWO_CPUS}",  # 2 replicas: Keras's draws differ
    )
    assert code == 1, out
    assert _row(out, "mirrored").endswith("DIFFERS")
    assert "mirrored: likely cause: Keras's own `Dropout` (dropout" in out, out
    assert "`trainer.layers.Dropout`" in out
    assert "nondeterministic" not in out, "the reference agrees with itself"
    assert "check: a strategy differs from one_device" in out


def test_a_reference_that_disagrees_with_itself_is_named_nondeterministic():
    run = check.StrategyRun("one_device", 1, ["w"], [], 1.0, {}, [], [])
    drifted = check.Comparison(run, 0.5, "dense/kernel", 0.1, 0.0, "")
    differs = check.Comparison(
        check.StrategyRun("mirrored", 4, ["w"], [], 1.1, {}, [], []), 0.5, "w", 0.1, 0, ""
    )
    causes = check.likely_causes(differs, drifted, 1e-4)
    assert causes[0].startswith("the reference (one_device) does not agree with a second run")


def test_a_metric_that_differs_while_the_weights_agree_is_named_non_additive():
    run = check.StrategyRun("mirrored", 4, ["w"], [], 1.0, {"auc": 0.7}, [], [])
    same = check.Comparison(run, 0.0, "", 0.0, 0.0, "")
    metric = check.Comparison(run, 1e-7, "w", 0.0, 0.05, "eval auc")
    (cause,) = check.likely_causes(metric, same, 1e-4)
    assert "eval auc does not: that metric is not additive over replicas" in cause


def test_batchnorm_statistics_that_differ_are_named():
    run = check.StrategyRun("mirrored", 4, ["w"], [], 1.0, {}, [], ["batch_normalization"])
    same = check.Comparison(run, 0.0, "", 0.0, 0.0, "")
    stats = check.Comparison(run, 0.2, "batch_normalization/moving_variance", 0.0, 0.0, "")
    (cause,) = check.likely_causes(stats, same, 1e-4)
    assert cause.startswith("BatchNorm statistics (batch_normalization/moving_variance)")


@pytest.mark.parametrize(
    "names,message",
    [
        (["one_device"], "needs at least two strategies"),
        (["one_device", "mirorred"], "`mirorred`, which is not a strategy"),
        (["one_device", "parameter_server"], "which needs a cluster"),
    ],
)
def test_bad_strategies_are_one_line(names, message):
    with pytest.raises(UserError, match=message):
        check.check_strategies(names)


def test_the_command_exits_2_with_one_line_on_a_bad_flag(tmp_path):
    result = run_cli("--strategies=one_device", "--", cwd=str(tmp_path), module="trainer.check")
    assert_exit(result, 2)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs at least two strategies" in lines[0], result.stderr


def test_the_readmes_check_command_runs_as_written(tmp_path):
    text = pathlib.Path(REPO, "docs", "checking.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.DOTALL)[1]
    argv = shlex.split(block.replace("\\\n", " "), comments=True)
    assert argv[:4] == [
        "python",
        "-m",
        "trainer.check",
        "--strategies=one_device,mirrored,multi_worker",
    ]
    result = run_command([sys.executable, *argv[1:]], cwd=str(tmp_path))
    assert_exit(result)
    out = result.stdout
    assert _row(out, "one_device").endswith("reference")
    assert " 2 " in _row(out, "mirrored"), "a replica per logical CPU (2 by default)"
    assert "likely cause" not in out
    assert _row(out, "mirrored").endswith("agrees") and _row(out, "multi_worker").endswith(
        "agrees"
    ), out
    assert "check: every strategy agrees with one_device" in out
