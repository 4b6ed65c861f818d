"""`model_dir` through `tf.io.gfile`: whole runs on TensorFlow's in-memory file system.

`ram://` stands in for a bucket (`gs://`, `s3://`): a path with a scheme that
only TensorFlow's file systems can open, and no network. A local file-system
call (`open`, `os.makedirs`, `os.replace`, ...) on such a path either fails or
writes a local folder named `ram:`; an audit hook records every one the
trainer makes, and the working directory must stay empty. `ram://` belongs to
one process, so everything here runs in-process.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import inspect
import io
import json
import os
import sys
import sysconfig
import uuid
from collections.abc import Iterator

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import REPO, one_line_error, tiny_config
from towerflow import processes, storage
from trainer.loop import checks, train
from trainer.loop.export import export
from trainer.sweep import __main__ as sweep
from trainer.sweep import plan as sweep_plan
from trainer.sweep import results as sweep_results

# Python's audit events for calls that open, create, move or delete local files.
_FILE_EVENTS = {
    "open",
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.listdir",
    "os.scandir",
    "os.chmod",
    "os.truncate",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_OURS = tuple(
    os.path.join(REPO, package) + os.sep for package in ("towerflow", "trainer", "strategies")
)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_recorded: list[tuple[str, tuple, str]] | None = None  # set while `_local_file_calls` runs


def _record(event: str, args: tuple) -> None:
    """Records `event` on a `ram://` path when towerflow's code made the call.

    The caller is the nearest frame outside Python's standard library (which
    `glob`, `shutil` and `open` go through): towerflow's, or a library's.
    TensorFlow itself globs a checkpoint's files with Python's `glob` to log
    their size, which on a remote path finds nothing and harms nothing.
    """
    if _recorded is None or event not in _FILE_EVENTS:
        return
    paths = [os.fsdecode(a) for a in args if isinstance(a, (str, bytes, os.PathLike))]
    if not any("ram:" in p for p in paths):
        return
    frame = inspect.currentframe().f_back
    while frame is not None and _in_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    caller = frame.f_code.co_filename if frame else ""
    if caller.startswith(_OURS):
        _recorded.append((event, args, f"{caller}:{frame.f_lineno}"))


sys.addaudithook(_record)  # hooks stay for the process's life: this one records only when asked


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" + os.sep not in filename


@contextlib.contextmanager
def _local_file_calls() -> Iterator[list[tuple[str, tuple, str]]]:
    """Records every local file-system call on a `ram://` path made in the block."""
    global _recorded
    _recorded = calls = []
    try:
        yield calls
    finally:
        _recorded = None


def _ram_dir() -> str:
    """A new directory of `ram://`, named so that no other one is a prefix of it."""
    return f"ram://towerflow-test-{uuid.uuid4().hex}"


def _read(path: str) -> str:
    with tf.io.gfile.GFile(path) as f:
        return f.read()


@dataclasses.dataclass
class RamRun:
    model_dir: str
    results: dict
    cwd: str
    calls: list


@pytest.fixture(scope="module")
def ram_run(tmp_path_factory) -> Iterator[RamRun]:
    """One run of 20 steps with its export, `model_dir` on `ram://`, from an empty directory."""
    cwd = str(tmp_path_factory.mktemp("cwd"))
    root = _ram_dir()
    with contextlib.chdir(cwd), _local_file_calls() as calls:
        results = train.train_and_evaluate(tiny_config(**{"train.export": True}), root + "/run")
    yield RamRun(root + "/run", results, cwd, calls)
    tf.io.gfile.rmtree(root)


def test_a_run_writes_everything_through_gfile(ram_run):
    assert ram_run.calls == [], "local file-system calls on a ram:// path"
    assert os.listdir(ram_run.cwd) == [], "nothing local (a folder named `ram:`)"
    names = set(tf.io.gfile.listdir(ram_run.model_dir))
    assert {"checkpoints", "config.json", "results.json", "export", "train", "eval"} <= names
    assert not [n for n in names if n.endswith(".tmp")] and "towerflow.lock" not in names
    results = json.loads(_read(ram_run.model_dir + "/results.json"))
    assert results["step"] == ram_run.results["step"] == 20
    assert results["eval"]["examples"] == 360
    config = json.loads(_read(ram_run.model_dir + "/config.json"))
    assert config["train"]["steps"] == 20
    assert tf.train.latest_checkpoint(ram_run.model_dir + "/checkpoints").endswith("ckpt-20")


def test_the_export_loads_back_from_ram(ram_run):
    loaded = tf.saved_model.load(ram_run.model_dir + "/export")
    digits = np.random.default_rng(0).uniform(0, 16, (3, 64)).astype(np.float32)
    outputs = loaded.signatures["serving_default"](inputs=tf.constant(digits))
    assert outputs["probabilities"].shape == (3, 10)
    np.testing.assert_allclose(outputs["probabilities"].numpy().sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.slow  # about 75 s; the run on ram:// and its export stay in the default tier
def test_a_second_run_resumes_from_ram_and_eval_mode_reads_it(ram_run, capsys):
    config = tiny_config(**{"train.steps": 30})
    with contextlib.chdir(ram_run.cwd), _local_file_calls() as calls:
        resumed = train.train_and_evaluate(config, ram_run.model_dir)
        assert f"restored {ram_run.model_dir}/checkpoints/ckpt-20 at step 20" in (
            capsys.readouterr().out
        )
        evaluated = train.train_and_evaluate(config, ram_run.model_dir, mode="eval")
    assert resumed["step"] == evaluated["step"] == 30
    assert evaluated["eval"]["loss"] == pytest.approx(resumed["eval"]["loss"], rel=1e-5)
    assert calls == [] and os.listdir(ram_run.cwd) == []


def test_model_dir_mistakes_on_ram_are_one_line_and_write_nothing():
    root = _ram_dir()
    tf.io.gfile.makedirs(root)
    with tf.io.gfile.GFile(root + "/file", "w") as f:
        f.write("not a directory")
    try:
        one_line_error("is a file, not a directory", checks.check_model_dir, root + "/file")
        one_line_error(
            f"cannot be created: '{root}/file' is a file",
            checks.check_model_dir,
            root + "/file/run",
        )
        one_line_error(
            "is a file, not a directory", train.train_and_evaluate, tiny_config(), root + "/file"
        )
        one_line_error(
            r"no file system for `nosuchfs://` here \(it has `gs://`, `ram://` and local",
            checks.check_model_dir,
            "nosuchfs://bucket/run",
        )
        checks.check_model_dir(root + "/new/run")  # may be created: no error, nothing made
        assert sorted(tf.io.gfile.listdir(root)) == ["file"]
        assert _read(root + "/file") == "not a directory"
    finally:
        tf.io.gfile.rmtree(root)


def test_an_export_on_ram_replaces_the_one_before_whole():
    root = _ram_dir()
    try:
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        export(model, root + "/export", None, 2)
        tf.io.gfile.makedirs(root + "/export/assets/stale")  # left by an earlier export
        export(model, root + "/export", None, 2)
        assert sorted(tf.io.gfile.listdir(root)) == ["export"]
        assert not tf.io.gfile.exists(root + "/export/assets/stale")
        loaded = tf.saved_model.load(root + "/export")
        outputs = loaded.signatures["serving_default"](inputs=tf.ones((1, 3)))
        np.testing.assert_allclose(outputs["logits"], model(tf.ones((1, 3))), rtol=1e-6)
    finally:
        tf.io.gfile.rmtree(root)


def test_a_sweep_directory_on_ram_holds_logs_rows_and_results(tmp_path):
    sweep_dir = _ram_dir() + "/sweep"
    trials = sweep_plan.plan_trials(
        os.path.join(REPO, "configs", "default.py"),
        {"optimizer.learning_rate": "1e-3,1e-2"},
        ["--config.train.steps=20"],
    )
    # The first trial finished in an earlier run; the second fails at once (a bad flag).
    tf.io.gfile.makedirs(f"{sweep_dir}/{trials[0].name}")
    storage.write_json(
        f"{sweep_dir}/{trials[0].name}/results.json", {"step": 20, "eval": {"accuracy": 0.5}}
    )
    console = processes.Console(io.StringIO(), own="sweep")
    with contextlib.chdir(tmp_path), _local_file_calls() as calls:
        sweep.check_sweep_dir(sweep_dir)
        rows = sweep.run_sweep(
            trials,
            ["--no_such_flag=1"],
            os.path.join(REPO, "configs", "default.py"),
            sweep_dir,
            [sweep_plan.TrialSlot((), (0,))],
            console,
            processes.Interrupt(),
        )
        rows = sweep_results.ranked(rows, "eval/accuracy", "max")
        sweep_results.write(sweep_dir, rows, "eval/accuracy", "max")
    assert calls == [] and os.listdir(tmp_path) == []
    assert [(r.trial, r.status) for r in rows] == [
        (trials[0].name, sweep_results.FINISHED),
        (trials[1].name, sweep_results.FAILED),
    ]
    assert "no_such_flag" in rows[1].error
    assert "no_such_flag" in _read(f"{sweep_dir}/logs/{trials[1].name}.log")
    assert json.loads(_read(sweep_dir + "/sweep.json"))["best"] == trials[0].name
    table = list(csv.DictReader(io.StringIO(_read(sweep_dir + "/sweep.csv"))))
    assert [row["status"] for row in table] == ["finished", "failed"]
    assert sweep_results.read_results(f"{sweep_dir}/{trials[1].name}") is None
    with tf.io.gfile.GFile(sweep_dir + "/file", "w") as f:
        f.write("")
    one_line_error("is a file, not a directory", sweep.check_sweep_dir, sweep_dir + "/file")
    tf.io.gfile.rmtree(sweep_dir)


def test_a_non_chief_member_names_an_unknown_scheme_in_one_line(monkeypatch):
    """Only the chief checks that model_dir can be written; every member checks its scheme."""
    config = tiny_config(**{"strategy.name": "one_device"})
    strategy = train.make_strategy(config)
    monkeypatch.setattr(type(strategy.membership), "is_chief", property(lambda self: False))
    one_line_error(
        "no file system for `nosuchfs://`", train.build, config, "nosuchfs://b/run", strategy
    )
