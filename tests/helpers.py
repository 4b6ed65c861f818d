"""Small shared pieces for the tests: a tiny config and the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

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
