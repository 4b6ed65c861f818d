"""The command end to end: a real run in a subprocess, as a user runs it; the rest in-process."""

import hashlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from strategies import devices
from tests.helpers import assert_exit, cli_in_process, run_cli, tiny_config
from tests.steps_two_replicas import TWO_CPUS
from trainer import cli, data

FAST = [
    "--config.train.steps=150",
    "--config.eval.every=75",
    "--config.train.checkpoint_every=75",
]


def _snapshot(path) -> dict[str, str]:
    """Every file under `path` with a hash of its bytes."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                files[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return files


@pytest.fixture(scope="module")
def mirrored_run(tmp_path_factory):
    """One real run of the default config under `mirrored`, from a foreign directory."""
    cwd = tmp_path_factory.mktemp("cwd")
    result = run_cli("--strategy=mirrored", "--model_dir=run", *FAST, cwd=str(cwd))
    assert_exit(result)
    return cwd / "run", result


def test_default_job_writes_everything(mirrored_run):
    model_dir, result = mirrored_run
    assert "model_dir: run" in result.stdout
    cores = devices.host_cores()
    assert f"threads per op: {max(1, cores // 2)}" in result.stdout  # the cores shared by 2 towers
    assert "train | step: 150/150" in result.stdout
    results = json.loads((model_dir / "results.json").read_text())
    assert results["step"] == 150
    assert results["eval"]["accuracy"] >= 0.9
    assert results["eval"]["examples"] == 360
    assert results["placement"]["strategy"] == "mirrored"
    assert results["placement"]["replicas_in_sync"] == 2
    kernel = next(v for k, v in results["placement"]["variables"].items() if "kernel" in k)
    assert len(kernel) == 2  # a mirrored copy on each of the 2 logical CPUs
    assert json.loads((model_dir / "config.json").read_text())["strategy"]["name"] == "mirrored"
    assert tf.train.latest_checkpoint(str(model_dir / "checkpoints")).endswith("ckpt-150")


def test_tensorboard_events_hold_the_metrics(mirrored_run):
    model_dir, _ = mirrored_run
    from tensorboard.backend.event_processing import event_accumulator

    def tags(split):
        acc = event_accumulator.EventAccumulator(
            str(model_dir / split), size_guidance={event_accumulator.TENSORS: 0}
        )
        acc.Reload()
        return set(acc.Tags()["tensors"])

    assert {
        "loss",
        "accuracy",
        "learning_rate",
        "steps_per_sec",
        "examples_per_sec",
        "config",
    } <= tags("train")
    assert {"loss", "accuracy"} <= tags("eval")


def test_export_serves_predictions(mirrored_run):
    model_dir, _ = mirrored_run
    serve = tf.saved_model.load(str(model_dir / "export")).signatures["serving_default"]
    dataset = data.get(tiny_config().data)
    x, y = next(iter(dataset.eval_fn(64)(tf.distribute.InputContext())))
    out = serve(inputs=x)
    assert out["probabilities"].shape == (64, 10)
    assert np.mean(out["classes"].numpy() == y.numpy()) >= 0.85


def test_rerun_with_more_steps_resumes(mirrored_run, capsys):
    # In-process: the run above is the command's own process, from a foreign directory.
    # On the run's 2 replicas (2 of this process's 4 logical CPUs); training only, no
    # export: the resume is what is asserted (the run above evaluates and exports).
    model_dir, _ = mirrored_run
    code, out, err = cli_in_process(
        "--strategy=mirrored",
        f"--model_dir={model_dir}",
        "--mode=train",
        f"--config.strategy.mirrored.devices={TWO_CPUS}",
        *FAST[1:],
        "--config.train.steps=200",
        "--config.train.export=False",
        capsys=capsys,
    )
    assert code == 0, err[-3000:]
    assert "restored" in out and "at step 150" in out
    assert "train | step: 200/200" in out
    assert "step: 100/" not in out


@pytest.mark.slow  # two runs; tests/test_resume.py restarts at every moment
def test_resume_matches_a_straight_run(tmp_path):
    # A constant schedule: a cosine one depends on `train.steps`, which the rerun changes.
    common = [
        "--config.optimizer.schedule=constant",
        "--strategy=one_device",
        "--config.train.steps_per_loop=10",
        "--config.train.checkpoint_every=10",
        "--config.eval.every=0",
        "--config.train.export=False",
    ]
    straight = run_cli(
        *common, "--model_dir=straight", "--config.train.steps=40", cwd=str(tmp_path)
    )
    first = run_cli(*common, "--model_dir=resumed", "--config.train.steps=20", cwd=str(tmp_path))
    second = run_cli(*common, "--model_dir=resumed", "--config.train.steps=40", cwd=str(tmp_path))
    for r in (straight, first, second):
        assert_exit(r)
    a = tf.train.load_checkpoint(str(tmp_path / "straight" / "checkpoints"))
    b = tf.train.load_checkpoint(str(tmp_path / "resumed" / "checkpoints"))
    names = [n for n in a.get_variable_to_shape_map() if "VARIABLE_VALUE" in n]
    assert len(names) > 10  # model weights, optimizer slots and step
    for name in names:
        np.testing.assert_allclose(a.get_tensor(name), b.get_tensor(name), rtol=1e-6, atol=1e-7)


def test_list_strategies(capsys):
    # In-process; tests/test_readme.py runs `python -m trainer --list_strategies` as written.
    code, out, _ = cli_in_process("--list_strategies", capsys=capsys)
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert {"default", "one_device", "mirrored", "central_storage"} <= set(names)


# Bad input, one case each: (arguments, what the one line on stderr says). They run
# in-process (`cli_in_process`), through the same flag parsing and error handling as the
# command; `WIRING` runs a few as real subprocesses to prove the command's own exits.
BAD_INPUTS = [
    (["--strategy=mirorred"], "Unknown strategy `mirorred`; known strategies: central_storage"),
    (["--config.model.name=transformer"], "Unknown model `model.name` 'transformer'"),
    (["--config.data.name=imagenet"], "imagenet"),
    (["--config.train.global_batch_size=129"], "must be divisible by the 4 replicas"),
    (["--config.train.steps=0"], "`train.steps` (0) must be a positive integer"),
    (["--config.train.global_batch_size=-4"], "`train.global_batch_size` (-4) must be >= 1"),
    (
        ["--config.train.full_checkpoint_every=-1"],
        "`train.full_checkpoint_every` (-1) must be >= 0",
    ),
    (
        ["--config.data.name=csv", "--config.data.train_files=/nonexistent/*.csv"],
        "/nonexistent/*.csv",
    ),
    (["--config.train.stepz=5"], "Unknown config field `train.stepz`"),
    (["--config.train.steps=abc"], "`--config.train.steps` got 'abc'"),
    (["--config=configs/nope.py"], "nope.py"),
    (["--config={files}/broken.py"], "did not load"),
    (["--config.optimizer.name=adagradd"], "Unknown `optimizer.name` 'adagradd'"),
    (["--config.optimizer.schedule=linear"], "Unknown `optimizer.schedule` 'linear'"),
    (["--config.optimizer.learning_rate=-1.0"], "`optimizer.learning_rate` (-1.0) must be"),
    (["--config.optimizer.learning_rate=nan"], "`optimizer.learning_rate` (nan) must be finite"),
    (
        ["--strategy=central_storage", "--config.train.jit_compile=True"],
        "`train.jit_compile` does not work under `central_storage`",
    ),
    (
        ["--strategy=pipeline", "--config.train.jit_compile=True"],
        "`train.jit_compile` does not work under `pipeline`",
    ),
    (
        ["--strategy=central_storage", "--config.train.precision=mixed_float16"],
        "`train.precision` 'mixed_float16' (loss scaling) does not work under `central_storage`",
    ),
    (["--config.optimizer.learning_rate=inf"], "`optimizer.learning_rate` (inf) must be finite"),
    (["--config.optimizer.clip_global_norm=1e400"], "`optimizer.clip_global_norm` (inf) must"),
    (
        ["--config.train.global_batch_size=1000000000"],
        "`train.global_batch_size` (1000000000) is larger than the training split of `digits` "
        "(1437 examples)",
    ),
    (
        [
            "--config.data.name=synthetic",
            "--config.data.synthetic.input_shape=(10000000000,)",
            "--config.train.global_batch_size=128",
        ],
        "`train.global_batch_size` (128) needs 4768.4 GiB for one batch's inputs alone",
    ),
    (
        ["--strategy=one_device", "--config.strategy.one_device.device=garbage!!"],
        "`strategy.one_device.device` holds 'garbage!!', which is not a device name; set it to "
        "one of: /device:CPU:0, /device:CPU:1",
    ),
    (["--model_dir="], "`--model_dir` is empty"),
    (["stray"], "Unexpected argument 'stray'"),
    (["--config.devices.logical_cpus=-2"], "`devices.logical_cpus` (-2)"),
    (["--config.model.hidden_units=(16,)"], "holds checkpoint"),  # another model's checkpoint
    (
        [
            "--config.data.name=tfrecord",
            "--config.data.train_files={files}/x.tfrecord",
            "--config.data.eval_files={files}/x.tfrecord",
            "--config.data.features=x:float32:32",
            "--config.data.input_shape=(32,)",
        ],
        "make the spec match the files",
    ),
    (
        [
            "--config.data.name=tfrecord",
            "--config.data.train_files={files}/garbage.tfrecord",
            "--config.data.eval_files={files}/garbage.tfrecord",
        ],
        "garbage.tfrecord",
    ),
]
# One of each way the command ends in error: a flag that does not parse, a value refused
# by main (a name or a config value: the same path, `cli.guarded`; `BAD_INPUTS` has the
# rest in-process), a stray argument.
WIRING = [
    (["--config.train.steps=abc"], "`--config.train.steps` got 'abc'"),
    (["--strategy=mirorred"], "Unknown strategy `mirorred`"),
    (["stray"], "Unexpected argument 'stray'"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """A config file with a syntax error, a TFRecord of 64 floats per example, and garbage."""
    files = tmp_path_factory.mktemp("files")
    (files / "broken.py").write_text("def get_config(:\n")
    with tf.io.TFRecordWriter(str(files / "x.tfrecord")) as writer:
        for i in range(4):
            features = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5] * 64)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    (files / "garbage.tfrecord").write_bytes(b"this is not a TFRecord file at all" * 10)
    return files


def _assert_one_line(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in err + out


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_leaves_model_dir_alone(
    args, message, mirrored_run, bad_files, capsys
):
    model_dir, _ = mirrored_run
    before = _snapshot(model_dir)
    args = [a.format(files=bad_files) for a in args]
    _assert_one_line(*cli_in_process(f"--model_dir={model_dir}", *args, capsys=capsys), message)
    assert _snapshot(model_dir) == before


@pytest.mark.parametrize("args,message", WIRING, ids=[" ".join(a) for a, _ in WIRING])
def test_the_command_exits_2_with_one_line(args, message, mirrored_run, tmp_path):
    model_dir, _ = mirrored_run
    before = _snapshot(model_dir)
    result = run_cli(f"--model_dir={model_dir}", *args, cwd=str(tmp_path))
    _assert_one_line(result.returncode, result.stdout, result.stderr, message)
    assert _snapshot(model_dir) == before


@pytest.mark.parametrize("make", ["file", "under_file"])
def test_unusable_model_dir(make, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    model_dir = blocker if make == "file" else blocker / "run"
    _assert_one_line(*cli_in_process(f"--model_dir={model_dir}", capsys=capsys), "`--model_dir`")
    assert blocker.read_text() == "not a directory"


def test_help_lists_the_commands_flags():
    flag_values = flags.FlagValues()
    cli.define_flags(flag_values)
    text = flag_values.main_module_help()  # what `--help` prints for the program's own file
    for name in ("--config", "--strategy", "--model_dir", "--mode", "--[no]list_strategies"):
        assert name in text
