"""Mistakes found before anything runs: a config file that gives no config, a blank `TF_CONFIG`.

Each is one line naming what is wrong and the fix, exit status 2; an
exception raised by the user's own `get_config()` keeps its traceback above
that line.
"""

import sys

import pytest
from absl import flags

from strategies.cluster import discovery
from towerflow.errors import UserError
from trainer import cli


@pytest.fixture(autouse=True)
def _fresh_config_module(monkeypatch):
    """ml_collections loads every config file as one module, which keeps the last one's names."""
    monkeypatch.delitem(sys.modules, "config_config", raising=False)


def _parse(config_file, capsys) -> tuple[int, str]:
    argv = ["towerflow", f"--config={config_file}", "--config.train.steps=2"]
    defined = cli.define_flags(flags.FlagValues(), argv)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        cli.parse_flags(defined, argv)
    return exit.value.code, capsys.readouterr().err


def _last_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def test_a_get_config_that_returns_none_is_one_line_naming_the_file(tmp_path, capsys):
    path = tmp_path / "forgot.py"
    path.write_text("def get_config():\n    config = {}\n")
    code, err = _parse(path, capsys)
    line = _last_line(err)
    assert code == 2 and f"'{path}'" in line
    assert "`get_config()` returned None" in line and "`return config`" in line
    assert "Traceback" not in err and "NoneType" not in err


def test_an_error_in_the_users_get_config_keeps_its_traceback_then_names_the_file(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("def get_config():\n    settings = {}\n    return settings['nosuchkey']\n")
    code, err = _parse(path, capsys)
    line = _last_line(err)
    assert code == 2
    assert line == (
        f"error: `--config` file '{path}': its `get_config()` failed with KeyError: "
        "'nosuchkey' (the traceback above shows where)."
    )
    assert "Traceback" in err and f'File "{path}", line 3, in get_config' in err


def test_a_config_file_without_get_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "nothing.py"
    path.write_text("X = 1\n")
    code, err = _parse(path, capsys)
    assert code == 2 and "has no `get_config()`" in _last_line(err)
    assert "Traceback" not in err


@pytest.mark.parametrize("source", ["auto", "tf_config"])
def test_a_blank_tf_config_is_refused_with_the_fix(source):
    with pytest.raises(UserError, match=r"`TF_CONFIG` is blank \(' '\).*`unset TF_CONFIG`"):
        discovery.find({"source": source}, "mirrored", {"TF_CONFIG": " "})


def test_an_empty_tf_config_is_unset_and_local_ignores_a_blank_one():
    assert discovery.find(None, "mirrored", {"TF_CONFIG": ""}).source == "local"
    assert discovery.find({"source": "local"}, "mirrored", {"TF_CONFIG": "  "}).source == "local"
