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


def run_cli(*args: str, cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python -m trainer ARGS` in `cwd`, as a user would."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
