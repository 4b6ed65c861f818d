"""docs/tables.md: its shell commands run as written.

The training command goes through the command's flags, main and exit in this process
(`tests.helpers.cli_in_process`): a process of its own adds nothing asserted here, and
would convert and trace again what this process has already.
"""

import json
import pathlib
import re
import shlex

import pytest

from tests.helpers import assert_exit, cli_in_process, run_command

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tables.md"


def _commands() -> list[str]:
    """The page's ```sh blocks, each one command (backslash continuations joined)."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S)
    return [block.replace("\\\n", " ").strip() for block in blocks]


def _args(command: str, tmp_path) -> list[str]:
    """`command`'s words, its /tmp paths under `tmp_path`."""
    return [arg.replace("/tmp/", f"{tmp_path}/") for arg in shlex.split(command)]


def _run(command: str, tmp_path, timeout: float, *more: str):
    """`command` and `more` arguments run from the repository, its /tmp paths under `tmp_path`."""
    return run_command([*_args(command, tmp_path), *more], str(REPO), timeout)


def test_the_pages_training_command_runs_as_written(tmp_path, capsys):
    (command,) = [c for c in _commands() if c.startswith("python -m trainer ")]
    python, module, trainer, *args = _args(command, tmp_path)
    assert [python, module, trainer] == ["python", "-m", "trainer"]
    code, out, err = cli_in_process(*args, capsys=capsys, cwd=REPO)
    assert code == 0, f"exit {code}:\n{out[-4000:]}{err[-3000:]}"
    out += err
    line = "at most 2000 rows (eviction lfu), min_count 2, ttl_steps 0, fallback_rows 500 (read 2"
    assert line in out
    assert "step: 40/40" in out and (tmp_path / "tables-run").is_dir()
    assert re.search(r"^train .*\| ids: \d+$", out, re.MULTILINE), "its progress lines count ids"


@pytest.mark.slow  # thirteen short training runs: about a minute
def test_the_pages_bench_command_prints_the_auc_table(tmp_path):
    (command,) = [c for c in _commands() if c.startswith("python -m trainer.bench")]
    done = _run(command, tmp_path, 900, f"--json={tmp_path / 'bench.json'}")
    assert_exit(done)
    assert "| rows / distinct ids | hashed rows |" in done.stderr
    case = json.loads((tmp_path / "bench.json").read_text())["cases"]["tables_quality"]
    for share in ("5pct", "15pct", "50pct", "100pct"):
        assert 0 < case["figures"][f"auc_dynamic_{share}"] <= 1
        assert 0 < case["figures"][f"auc_hashed_{share}"] <= 1
