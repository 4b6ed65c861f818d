"""towerflow run from a user's project that has `configs/` and `strategies/` packages of its own.

towerflow installs top-level packages named `trainer`, `strategies` and
`configs`; a user's project with packages of the same names must neither
shadow them nor lose its own modules (its model builder imports its own
`configs`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import assert_exit, run_cli
from trainer import cli

FAST = [  # training only: the user's model is what is asserted, in results.json
    "--mode=train",
    "--strategy=one_device",
    "--config.train.steps=10",
    "--config.train.steps_per_loop=5",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.model.name=my_pkg.models:build",
]

USER_FILES = {
    "configs/__init__.py": '"""The user\'s own configs."""\n',
    "configs/settings.py": "WIDTH = 24\n",
    "strategies/__init__.py": "raise ImportError('the user\\'s strategies package was imported')\n",
    "my_pkg/__init__.py": "",
    "my_pkg/models.py": (
        "import keras\n"
        "from configs import settings  # the user's own configs package\n\n"
        "def build(spec, model_config):\n"
        "    inputs = keras.Input(spec.input_shape)\n"
        "    x = keras.layers.Flatten()(inputs)\n"
        "    x = keras.layers.Dense(settings.WIDTH, activation='relu', name='users_layer')(x)\n"
        "    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))\n"
    ),
}


@pytest.fixture
def project(tmp_path):
    """A user's project directory: its own `configs`, `strategies` and model packages."""
    for name, text in USER_FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _trained_with_the_users_model(result: subprocess.CompletedProcess, model_dir) -> None:
    assert_exit(result)
    results = json.loads((model_dir / "results.json").read_text())
    assert results["step"] == 10
    layers = [name for name in results["placement"]["variables"] if "users_layer" in name]
    assert layers, results["placement"]["variables"]


def test_the_towerflow_command_from_a_users_project(project):
    towerflow = os.path.join(os.path.dirname(sys.executable), "towerflow")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    result = subprocess.run(
        [towerflow, *FAST, "--model_dir=run"],
        cwd=project,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    _trained_with_the_users_model(result, project / "run")


def test_python_m_trainer_from_a_users_project(project):
    result = run_cli("--config=configs/default.py", *FAST, "--model_dir=run", cwd=str(project))
    _trained_with_the_users_model(result, project / "run")
    assert json.loads((project / "run" / "config.json").read_text())["data"]["name"] == "digits"


def test_builtin_configs_resolve_to_towerflows_files(project, monkeypatch):
    monkeypatch.chdir(project)
    argv = cli.resolve_config_arg(["towerflow", "--config=configs/ctr.py:x", "--strategy=a"])
    assert argv == ["towerflow", f"--config={cli.CONFIG_DIR / 'ctr.py'}:x", "--strategy=a"]
    assert cli.resolve_config_arg(["towerflow"])[1] == f"--config={cli.CONFIG_DIR / 'default.py'}"
    assert cli.resolve_config_arg(["t", "--config=configs/settings.py"])[1].endswith(
        "=configs/settings.py"  # a file of the user's project stays the user's
    )


def test_a_config_that_loads_the_default_ignores_the_users_configs(project, monkeypatch):
    # As `--config=configs/ctr.py` loads it: by path, the user's project first on sys.path.
    (project / "configs" / "default.py").write_text("raise ImportError('the user's default')\n")
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(project))
    spec = importlib.util.spec_from_file_location("ctr_config", cli.CONFIG_DIR / "ctr.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert config.data.name == "ctr" and config.train.global_batch_size >= 1
