"""A test's own Python script in a process of its own, forked from the tests' server.

`tests.helpers.run_command` forks only `python -m MODULE` commands, from a
server that imported TensorFlow and Keras once (`towerflow.forkserver`); a
script run as `python -c SCRIPT` would start an interpreter that imports
TensorFlow again, about 4.5 s of CPU. `run_command` (and `run_script`) runs it
as `python -m tests.fresh_process SCRIPT ARGS...` instead: the script runs as
`__main__` with `sys.argv[1:] == ARGS`, in a process that holds nothing of
the test's (no model, no variable; of towerflow only the server's own
`towerflow.processes`), so what it loads or builds (an export, an in-process
cluster) it does from nothing, as under `python -c`.
"""

from __future__ import annotations

import subprocess
import sys


def run_script(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """Runs `script` with `args` in a fresh process in `cwd`; stdout and stderr captured."""
    from tests.helpers import run_command  # not in the script's process: it imports nothing

    return run_command([sys.executable, "-m", "tests.fresh_process", script, *args], str(cwd))


def _main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = ["-c", *args]  # as `python -c SCRIPT ARGS...` gives them
    exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    _main()
