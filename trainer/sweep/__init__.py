"""`python -m trainer.sweep`: hyper-parameter sweeps, one `python -m trainer` trial per device.

__main__.py   the command: flags, trials run and resumed, Ctrl-C, the table
plan.py       the trials (grid or random over `--sweep.<field>=...`) and their slots
              of GPUs and CPU cores
results.py    each trial's row, ranked by `--metric`; `sweep.json` and `sweep.csv`
"""
