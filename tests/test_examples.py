"""The examples in `examples/`, each end to end through the command line, as the README runs them.

Under `one_device` with the example's own settings (so what the README says
it reaches is checked), under `mirrored` over 2 of the test process's
logical CPUs (replicas at half the tracing of 4), and on a local
parameter-server cluster (2 workers, 1 ps) with fewer steps (all but the
image model, whose cluster path is the others'). The single-process runs go
through the command in this process (`helpers.cli_in_process`: its flags,
main and exit); a process of their own would only import TensorFlow again.
"""

import json

import pytest

from tests import helpers
from tests.fresh_process import run_script

# example: (metrics the run must report, {metric: lowest value} after the full run)
EXAMPLES = {
    "census": (("auc", "accuracy"), {"auc": 0.77}),
    "multi_output": (
        ("digit_accuracy", "ink_mae", "digit_loss", "ink_loss"),
        {"digit_accuracy": 0.93},
    ),
    "images": (("accuracy",), {}),
    "custom_step": (("accuracy",), {"accuracy": 0.95}),
}
SHORT = ["--config.train.steps=40", "--config.eval.every=0", "--config.train.checkpoint_every=20"]
TWO_CPUS = "CPU:0,CPU:1"  # `mirrored`'s replicas
# The image model is slow to trace on a CPU: a few steps, and its export is checked once.
TINY = ["--config.train.steps=10", "--config.eval.every=0", "--config.train.export=False"]


def _short(example: str) -> list[str]:
    return TINY if example == "images" else SHORT


def _results(model_dir) -> dict:
    return json.loads((model_dir / "results.json").read_text())


def _run(*args: str, capsys) -> None:
    """`towerflow ARGS` from the repository's top directory (where `examples/` is), in-process."""
    code, out, err = helpers.cli_in_process(*args, capsys=capsys, cwd=helpers.REPO)
    assert code == 0, f"exit {code}:\n{out[-4000:]}{err[-3000:]}"


def _check(args, model_dir, example: str) -> dict:
    results = _results(model_dir)
    reported, _ = EXAMPLES[example]
    assert set(reported) <= set(results["eval"]), results["eval"]
    if "--config.train.export=False" not in args:
        assert (model_dir / "export" / "saved_model.pb").exists()
    return results


# The image model takes a minute to trace on a CPU: its runs are in the slow tier.
def _slow_images(example: str):
    return pytest.param(example, marks=pytest.mark.slow) if example == "images" else example


@pytest.mark.parametrize("example", [_slow_images(e) for e in sorted(EXAMPLES)])
def test_each_example_as_the_readme_runs_it(example, tmp_path, capsys):
    extra = TINY[:-1] if example == "images" else []  # the README's run exports
    model_dir = tmp_path / "run"
    args = [
        f"--config=examples/{example}.py",
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        *extra,
    ]
    _run(*args, capsys=capsys)
    results = _check(args, model_dir, example)
    for metric, lowest in EXAMPLES[example][1].items():
        assert results["eval"][metric] >= lowest, results["eval"]


# On a parameter-server cluster, the other examples' tasks (their own pipelines, losses,
# steps) stand for the image model. In the default tier: census (its vocabulary layer,
# served) under both; the rest in the slow tier.
PLACES = [
    (example, where)
    if example == "census"
    else pytest.param(example, where, marks=pytest.mark.slow)
    for example in sorted(EXAMPLES)
    for where in ("mirrored", "parameter_server")
    if (example, where) != ("images", "parameter_server")
]


@pytest.mark.parametrize("example, where", PLACES)
def test_each_example_under_mirrored_and_on_a_parameter_server_cluster(
    example, where, tmp_path, capsys
):
    model_dir = tmp_path / "run"
    args = [f"--config=examples/{example}.py", f"--model_dir={model_dir}", *_short(example)]
    if where == "mirrored":  # over 2 of the test process's logical CPUs
        devices = f"--config.strategy.mirrored.devices={TWO_CPUS}"  # after `--config`
        _run("--strategy=mirrored", *args, devices, capsys=capsys)
    else:  # 2 workers and 1 ps, local processes
        launcher = ["--workers=2", "--ps=1", "--", "--strategy=parameter_server"]
        helpers.assert_exit(helpers.launch(*launcher, *args, cwd=helpers.REPO))
    results = _check(args, model_dir, example)
    assert results["step"] >= 10
    replicas = 2 if where == "mirrored" else 1
    assert results["placement"]["replicas_in_sync"] == replicas
    if example == "census" and where == "parameter_server":  # its StringLookup, served
        _serves_raw_rows(model_dir / "export")


# Two census rows as a client sends them, the second with a region the vocabulary lacks.
SERVE_CENSUS = """
import sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
out = serve(
    age=tf.constant([39.0, 51.0]), hours_per_week=tf.constant([29.0, 41.0]),
    education=tf.constant(["Masters", "Some-college"]),
    occupation=tf.constant(["Tech-support", "Protective"]), region=tf.constant(["North", "Mars"]),
)
print("SERVED", sorted(out), sorted({int(value.shape[0]) for value in out.values()}))
"""


def _serves_raw_rows(export_dir) -> None:
    """The export, loaded in a fresh process, takes raw strings (an unknown region too)."""
    served = run_script(SERVE_CENSUS, str(export_dir), cwd=export_dir)
    helpers.assert_exit(served)
    line = next(x for x in served.stdout.splitlines() if x.startswith("SERVED"))
    assert line.endswith("[2]"), line  # every output: one row per row sent


def test_the_compiled_model_example_needs_no_task_code(tmp_path, capsys):
    # 300 of the default 1,000 steps: what is checked is that its own loss and metrics train.
    model_dir = tmp_path / "run"
    _run(
        "--config.model.name=examples.compiled_model:build",
        "--strategy=one_device",
        "--config.train.steps=300",
        f"--model_dir={model_dir}",
        capsys=capsys,
    )
    results = _results(model_dir)
    assert results["eval"]["accuracy"] > 0.95 and results["eval"]["top3"] > 0.98
