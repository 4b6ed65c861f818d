"""towerflow's trainer: the loop, data, models and the `python -m trainer` command.

from trainer import train_and_evaluate
results = train_and_evaluate(configs.default.get_config(), "runs/x")
"""
