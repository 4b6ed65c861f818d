"""Built-in training configs: each module has `get_config()`.

Run one with `towerflow --config=configs/NAME.py`; the path resolves to
towerflow's own files (not a `configs` package of the user's), so it works
from any directory.
"""
