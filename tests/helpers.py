"""Small shared pieces for the tests: a tiny config and the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import configs.default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
    """The default config made small and fast; `overrides` are "a.b": value pairs."""
    config = configs.default.get_config()
    config.devices.logical_cpus = 4
    config.train.steps = 20
    config.train.steps_per_loop = 5
    config.train.checkpoint_every = 10
    config.train.export = False
    config.eval.every = 0
    config.model.hidden_units = (32,)
    config.model.dropout = 0.0
    for dotted, value in overrides.items():
        *path, leaf = dotted.split(".")
        section = config
        for key in path:
            section = section[key]
        section[leaf] = value
    return config


def _env(keep_tf_config: bool = False) -> dict[str, str]:
    """The environment a test's trainer runs in: quiet TF, this repo importable."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if not keep_tf_config:
        env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def run_cli(
    *args: str, cwd: str, timeout: float = 300, module: str = "trainer", keep_tf_config=False
) -> subprocess.CompletedProcess:
    """Runs `python -m MODULE ARGS` in `cwd` (default the trainer), as a user would."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=_env(keep_tf_config),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(*args: str, cwd, module: str = "trainer") -> subprocess.Popen:
    """Starts `python -m MODULE ARGS` and returns it running; stdout (and stderr) piped."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def launch(*args: str, cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python -m trainer.launch ARGS`: a local cluster on 127.0.0.1."""
    return run_cli(*args, cwd=cwd, timeout=timeout, module="trainer.launch")


def checkpoint_values(model_dir) -> dict:
    """Every variable in the newest checkpoint of `model_dir`, by checkpoint key."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    names = [n for n in reader.get_variable_to_shape_map() if "VARIABLE_VALUE" in n]
    return {n: reader.get_tensor(n) for n in names}


def pid_of(task_type: str, index: int, marker: str) -> int | None:
    """The live trainer process whose `TF_CONFIG` names this task, in the test's cluster."""
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if marker not in command:
            continue
        for entry in environ:
            if entry.startswith("TF_CONFIG="):
                task = json.loads(entry.removeprefix("TF_CONFIG="))["task"]
                if task == {"type": task_type, "index": index}:
                    return int(proc.name)
    return None


def launch_and_signal(
    *args: str, cwd, trigger: str, task: tuple[str, int], sig: int, timeout: float = 300
) -> tuple[int, list[tuple[float, str]], float]:
    """Runs `python -m trainer.launch ARGS`; at the first line holding `trigger`, signals `task`.

    The task is found by its `TF_CONFIG` among processes whose command line
    holds `cwd`, so pass `--model_dir` under `cwd`.

    Returns:
      The launcher's exit code, its output as (seconds since start, line), and
      the second the signal was sent.
    """
    proc = start_cli(*args, cwd=cwd, module="trainer.launch")
    start, sent, lines = time.monotonic(), None, []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if sent is None and trigger in line:
                pid = pid_of(*task, str(cwd))
                assert pid, f"{task} not found"
                os.kill(pid, sig)
                sent = time.monotonic() - start
            assert time.monotonic() - start < timeout, "the cluster ran too long"
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert sent is not None, "\n".join(line for _, line in lines)[-3000:]
    return code, lines, sent
