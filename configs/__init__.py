"""Built-in training configs: each module has `get_config()`.

Run one with `python -m trainer --config=configs/NAME.py`; the path also
resolves inside the installed package, so it works from any directory.
"""

import pathlib

CONFIG_DIR = pathlib.Path(__file__).resolve().parent


def path(name: str) -> str:
    """The file path of the built-in config `name` (e.g. "default")."""
    return str(CONFIG_DIR / f"{name}.py")
