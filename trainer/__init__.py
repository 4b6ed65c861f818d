"""towerflow's trainer: the loop, data, models and the `towerflow` / `python -m trainer` command.

The commands sit at the top of the package (`__main__`, `cli`, `launch`,
`sweep`, `bench`, `data_service`, `check`); below them the loop
(`trainer.loop`), and below the loop the model's layers (`trainer.layers`)
and the input (`trainer.data`).

From Python, the same job the command runs::

    import trainer

    config = trainer.default_config()
    config.train.steps = 50
    results = trainer.train_and_evaluate(config, "runs/x")

A user's own config file starts from the default the same way (see
`examples/`). A user's own task subclasses `trainer.Task`; a user's own
loop action is a `trainer.Action` (and may raise `trainer.StopTraining`).
Importing this package does not import TensorFlow; the names below load
what they need on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

__all__ = ["Action", "StopTraining", "Task", "default_config", "train_and_evaluate"]

# The public names defined in the loop's modules, loaded on first use.
_LAZY = {
    "train_and_evaluate": "trainer.loop.train",
    "Task": "trainer.loop.tasks",
    "Action": "trainer.loop.actions",
    "StopTraining": "trainer.loop.actions",
}


def default_config():
    """towerflow's default config (`configs/default.py`), loaded from towerflow's own files.

    Loaded by path, so a user's own `configs` package does not stand in for it.
    """
    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.py"
    spec = importlib.util.spec_from_file_location("towerflow_default_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
