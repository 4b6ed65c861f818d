"""towerflow's shared core: errors and exit codes, the registry type, files, processes, user calls.

Imports nothing of `strategies/` or `trainer/`."""
