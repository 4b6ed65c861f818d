"""`python -m trainer.sweep`: hyper-parameter sweeps (`__main__`, `plan`, `results`)."""
