"""The `trainer` package's own docstring example runs as written."""

import re

import trainer


def test_the_package_docstring_example_runs(tmp_path, monkeypatch):
    example = re.search(r"::\n\n((?:    .*\n|\n)+)", trainer.__doc__).group(1)
    code = "\n".join(line[4:] for line in example.splitlines())
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(code, namespace)
    results = namespace["results"]
    assert results["step"] == 50
    assert results["eval"]["examples"] == 360
    assert (tmp_path / "runs" / "x" / "results.json").exists()


def test_default_config_is_towerflows_own_whatever_the_path_holds(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "__init__.py").write_text("raise ImportError('the user package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = trainer.default_config()
    assert config.data.name == "digits" and config.train.steps == 1000
