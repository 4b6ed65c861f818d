"""Checkpoints: written in the background, restored to the same values; a full disk."""

import pathlib
import re
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from tests.fresh_process import run_script
from tests.helpers import IN_PROCESS_CLUSTER, assert_exit, run_cli, tiny_config
from towerflow.errors import NO_SPACE_EXIT_CODE
from trainer.loop import deltas, train
from trainer.loop.checkpoints import Checkpointer, NoSpace

# The default strategy (`mirrored`) over 2 logical CPUs: its variables mirrored, at half the
# tracing of 4 replicas.
TWO_REPLICAS = {"strategy.mirrored.devices": "CPU:0,CPU:1"}


def _values(job) -> list[np.ndarray]:
    return [v.numpy() for v in job.model.variables + job.optimizer.variables]


def test_async_training_checkpoint_restores_the_same_values(tmp_path, capsys):
    # Incremental checkpoints asked for, but no dynamic table: every one full, and a note.
    config = tiny_config(
        **TWO_REPLICAS, **{"train.async_checkpoint": True, "train.full_checkpoint_every": 100}
    )
    job = train.build(config, str(tmp_path))
    train.run(job, "train")  # saves at steps 0, 10 and 20 in the background
    assert "note: `train.full_checkpoint_every` has no dynamic table" in capsys.readouterr().out
    for step in (0, 10, 20):
        assert deltas.base_step(str(tmp_path / "checkpoints" / f"ckpt-{step}")) is None
    fresh = train.build(config, str(tmp_path))
    checkpointer = Checkpointer(str(tmp_path), True, 3, **train.checkpointed(fresh))
    assert checkpointer.restore().endswith("ckpt-20")
    for got, want in zip(_values(fresh), _values(job), strict=True):
        np.testing.assert_array_equal(got, want)


def test_repeated_async_saves_each_hold_their_values(tmp_path):
    job = train.build(tiny_config(**TWO_REPLICAS), str(tmp_path))
    checkpointer = Checkpointer(str(tmp_path), True, 5, async_save=True, **train.checkpointed(job))
    assert checkpointer.asynchronous, "this process holds every variable"
    kernel = job.model.trainable_variables[0]
    saved = {}
    for step in (1, 2, 3):
        kernel.assign(np.full(kernel.shape, float(step), np.float32))
        saved[step] = checkpointer.save(step)
    assert checkpointer.latest == saved[3]
    checkpointer.restore(saved[2])
    np.testing.assert_array_equal(kernel.numpy(), np.full(kernel.shape, 2.0, np.float32))
    checkpointer.close()


# A full disk: one line, the last good checkpoint kept.


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB file system (tmpfs) to train into: a disk that fills up. Needs root, as CI has."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


DATA = "data-00000-of-00001"
# About 1 MiB a checkpoint (model and Adam's slots): two or three fit in 3 MiB, not four.
FILLS_UP = {"model.hidden_units": (256, 256), "train.steps": 40, "train.checkpoint_every": 10}


def _committed_checkpoints_are_whole(directory: pathlib.Path) -> str:
    """Checks the state file names only whole checkpoints and nothing else is left; the newest."""
    state = tf.train.get_checkpoint_state(str(directory))
    kept = [pathlib.Path(p).name for p in state.all_model_checkpoint_paths]
    files = {p.name for p in directory.iterdir()}
    whole = (
        {"checkpoint"} | {f"{k}.index" for k in kept} | {f"{k}.data-00000-of-00001" for k in kept}
    )
    assert files == whole, "partial files of the failed write are removed"
    return state.model_checkpoint_path


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.usefixtures("iterators_end_with_the_test")
def test_a_full_disk_stops_with_one_line_and_keeps_the_last_good_checkpoint(small_disk, async_save):
    model_dir = small_disk / "run"
    config = tiny_config(**FILLS_UP, **TWO_REPLICAS, **{"train.async_checkpoint": async_save})
    with pytest.raises(NoSpace) as full:
        train.train_and_evaluate(config, str(model_dir))
    message = str(full.value)
    said = re.match(
        rf"no space left in `model_dir` {model_dir} for checkpoint ckpt-(\d+): it needs about "
        r"1\.\d MiB, \d+\.\d MiB free; the last good checkpoint (\S+ckpt-(\d+)) is kept\. ",
        message,
    )
    assert said and "\n" not in message, message
    failed, kept, kept_step = int(said[1]), said[2], int(said[3])
    assert failed == kept_step + 10 and kept_step >= 10
    assert _committed_checkpoints_are_whole(model_dir / "checkpoints") == kept
    job = train.build(config, str(model_dir))
    assert Checkpointer(str(model_dir), True, 3, **train.checkpointed(job)).restore() == kept
    assert job.step() == kept_step


def test_a_full_disk_under_the_command_line_is_one_line_and_exit_4(small_disk):
    """Asynchronous saves (the default): the failure is the same line, no thread's traceback."""
    result = run_cli(
        "--strategy=one_device",
        "--model_dir=run",
        "--config.train.steps=40",
        "--config.train.checkpoint_every=10",
        "--config.train.steps_per_loop=5",
        "--config.eval.every=0",
        "--config.train.export=False",
        cwd=str(small_disk),
    )
    assert_exit(result, NO_SPACE_EXIT_CODE)
    tf_log = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWEF]\d{4} )")
    lines = [line for line in result.stderr.splitlines() if not tf_log.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: no space left in `model_dir` run"), (
        result.stderr[-3000:]
    )
    kept = re.search(r"the last good checkpoint (\S+) is kept", lines[0])[1]
    newest = _committed_checkpoints_are_whole(small_disk / "run" / "checkpoints")
    assert newest == str(small_disk / kept)


# Saves under a bare `tf.distribute` ParameterServerStrategy over in-process servers on
# 127.0.0.1, 120 of each kind into `model_dir/<kind>`; the memory they added after the 20th,
# a line "<kind> <MB>" each. "full": 40 variables on 2 ps members and one more made after the
# first save; "deltas": a dynamic table of 2 parts, full at the first save and deltas of it
# after. One process for both (it starts the cluster once): what the first kind made stays
# held, so the second's growth is its own.
_SAVES_ON_PS_MEMBERS = (
    IN_PROCESS_CLUSTER
    + """
import os, sys, types
import keras
from trainer.layers import DynamicEmbedding
from trainer.loop import optim, train
from trainer.loop.checkpoints import Checkpointer

strategy = bare_parameter_server()
held = []  # each kind's objects, kept to the end: nothing of the first is freed for the second

def saves(kind, model_dir):
    if kind == "full":
        with strategy.scope():
            variables = [tf.Variable(tf.fill([3], float(i))) for i in range(40)]
        later = tf.Module()
        later.made = []
        checkpointer = Checkpointer(model_dir, True, 2, variables, later=later)
    else:
        with strategy.scope():
            inputs = keras.Input((3,), dtype="int64")
            model = keras.Model(inputs, DynamicEmbedding(4, combiner="sum", capacity=20)(inputs))
            optimizer = optim.OPTIMIZERS["adam"](0.05, None)
            optimizer.build(model.trainable_variables)
        job = types.SimpleNamespace(model=model, optimizer=optimizer)
        checkpointer = Checkpointer(model_dir, True, 2, full_every=1000, **train.checkpointed(job))
        assert checkpointer.incremental
    held.append(checkpointer)
    checkpointer.save(1)
    if kind == "full":
        with strategy.scope():
            later.made.append(tf.Variable(7.0))  # after the first save, as an optimizer's slots
    for step in range(2, 121):
        if kind == "full":
            variables[0].assign_add(tf.ones([3]))
        checkpointer.save(step)
        if step == 20:
            before = rss_mb()
    print(kind, rss_mb() - before)

for kind in ("full", "deltas"):
    saves(kind, os.path.join(sys.argv[1], kind))
"""
)


@pytest.fixture(scope="module")
def saved_on_ps_members(tmp_path_factory) -> tuple[pathlib.Path, dict[str, float]]:
    """The directory of both kinds' saves, and the MB each kind's last 100 saves added."""
    directory = tmp_path_factory.mktemp("ps_saves")
    result = run_script(_SAVES_ON_PS_MEMBERS, str(directory), cwd=directory)
    assert_exit(result)
    lines = [line.split() for line in result.stdout.strip().splitlines()[-2:]]
    return directory, {kind: float(mb) for kind, mb in lines}


@pytest.mark.parametrize("kind", ["full", "deltas"])
def test_saves_with_variables_on_other_members_do_not_grow_their_memory(saved_on_ps_members, kind):
    """Each save under `parameter_server` reuses one traced write (`trainer.loop.writes`).

    TensorFlow's own eager write traces a new function at every save where
    the variables live on several members, and each member keeps every one:
    here 100 full saves of 40 variables grew the process by about 100 MB,
    100 deltas of a table by 45-65 MB, against 10 MB or less traced once.
    """
    directory, growth = saved_on_ps_members
    model_dir = directory / kind
    assert growth[kind] < 30, f"100 saves grew memory by {growth[kind]:.0f} MB"
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / "ckpt-120"))
    if kind == "full":
        np.testing.assert_array_equal(
            reader.get_tensor("variables/0/.ATTRIBUTES/VARIABLE_VALUE"), [119] * 3
        )
        assert reader.get_tensor("later/made/0/.ATTRIBUTES/VARIABLE_VALUE") == 7.0
    else:
        assert deltas.base_step(str(model_dir / "checkpoints" / "ckpt-120")) == 1
    # A shard for each member, as an eager write makes them.
    assert len(list(model_dir.glob("checkpoints/ckpt-120.data-*"))) == 3
