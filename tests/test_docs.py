"""The documentation site builds strictly and offline, and documents the whole public API.

`mkdocs build --strict` (mkdocs.yml) fails on a broken link or anchor, a page
missing from the nav or a nav entry without its page, and a docstring griffe
cannot read; the configuration reference is generated from `configs/default.py`
by `docs/hooks/config_reference.py` at build time. The checks here add what
strict mode does not see: every public name in the API reference with a
docstring, every config field in the configuration reference, and no page that
needs the network (where it may, the build itself runs without one).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, assert_exit

SITE_TIMEOUT_S = 300
DOCS = pathlib.Path(REPO, "docs")
MAX_LINE = 300  # characters on a docs page's line (tables included)
README_MAX_LINE = 120


def _offline() -> list[str]:
    """A command prefix that runs without a network (`unshare -n`: only a loopback that is
    down), where this machine allows it (as root); else none, and the build runs as it is."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0:
        return ["unshare", "-n"]
    return []


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built as `mkdocs build --strict` builds it, into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(
        [*_offline(), *build],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SITE_TIMEOUT_S,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert_exit(result)
    return out


def public_names() -> dict[str, object]:
    """The public API the reference must document: dotted name -> the object."""
    import strategies
    import trainer
    import trainer.check
    import trainer.layers

    names = {f"trainer.{name}": getattr(trainer, name) for name in trainer.__all__}
    names["strategies.Strategy"] = strategies.Strategy
    names.update(
        {f"strategies.{n}": getattr(strategies, n) for n in ("register", "get", "available")}
    )
    for name, value in vars(trainer.layers).items():
        public = not name.startswith("_")
        if public and _defined_in(value, "trainer.layers") and inspect.isclass(value):
            names[f"trainer.layers.{name}"] = value
    names["trainer.check"] = trainer.check
    for name, value in vars(trainer.check).items():
        if _defined_in(value, "trainer.check") and not name.startswith("_"):
            names[f"trainer.check.{name}"] = value
    return names


def _defined_in(value, package: str) -> bool:
    module = getattr(value, "__module__", "") or ""
    return module == package or module.startswith(package + ".")


def _where_documented(name: str, value) -> str:
    """The dotted path the reference documents `name` under: the name itself where the
    reference uses it, else where it is defined (names `trainer` loads on first use)."""
    if inspect.ismodule(value):
        return value.__name__
    if f"::: {name}\n" in (DOCS / "api.md").read_text():
        return name
    return f"{value.__module__}.{value.__qualname__}"


@functools.cache
def _griffe_objects():
    import griffe

    loader = griffe.GriffeLoader(search_paths=[REPO], allow_inspection=False)
    return {package: loader.load(package) for package in ("trainer", "strategies")}


def _static_docstring(path: str) -> str:
    """The docstring griffe reads for `path` (statically, as the site's build does)."""
    package, _, rest = path.partition(".")
    obj = _griffe_objects()[package]
    obj = obj[rest] if rest else obj
    return obj.docstring.value if obj.docstring else ""


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    built = {p.parent.name for p in site.glob("*/index.html")}
    assert {p.stem for p in DOCS.glob("*.md")} - {"index"} <= built


def test_every_public_name_is_in_the_api_reference_with_a_docstring(site):
    page = (site / "api" / "index.html").read_text()
    directives = (DOCS / "api.md").read_text()
    missing = []
    for name, value in public_names().items():
        path = _where_documented(name, value)
        if f"::: {path}" not in directives and not path.startswith("trainer.check."):
            missing.append(f"{name}: no `::: {path}` in docs/api.md")
        elif f'id="{path}"' not in page:
            missing.append(f"{name}: not rendered at #{path}")
        elif not _static_docstring(path).strip():
            missing.append(f"{name}: no docstring at {path}")
    assert not missing, "\n".join(missing)


def test_every_public_strategy_member_is_documented(site):
    import strategies

    page = (site / "api" / "index.html").read_text()
    for name, value in vars(strategies.Strategy).items():
        if name.startswith("_"):
            continue
        path = f"strategies.base.Strategy.{name}"
        if callable(value) or isinstance(value, property):
            assert f'id="{path}"' in page, f"{path} is not in the API reference"
            assert _static_docstring(path).strip(), f"{path} has no docstring"


def test_every_config_field_is_in_the_configuration_reference(site):
    hook = _hook()
    source = hook.CONFIG.read_text()
    documented = {e.path for e in hook.entries(source) if not e.is_section}
    assert documented == set(_leaves(hook.defaults()))
    page = (site / "configuration" / "index.html").read_text()
    for path in documented:
        section, _, field = path.rpartition(".")
        assert f"<code>{field}</code>" in page, path
        if section:
            assert f"<code>{section}</code>" in page, section


def _hook():
    """docs/hooks/config_reference.py, loaded by path as mkdocs loads it."""
    path = DOCS / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves += _leaves(value, f"{prefix}{key}.")
        else:
            leaves.append(prefix + key)
    return leaves


def test_an_undocumented_config_field_fails_the_build():
    hook = _hook()
    source = hook.CONFIG.read_text().replace(
        "    return c\n", "    c.train.undocumented = 1\n    return c\n"
    )
    with pytest.raises(ValueError, match=r"`train.undocumented` .* has no comment"):
        hook.reference(source, {"train": {"undocumented": 1}, **hook.defaults()})


def test_the_site_needs_no_network(site):
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert not re.search(r"fonts\.(googleapis|gstatic)\.com", text), page
        assert not re.search(r"<script[^>]+src=\"https?://", text), page


def test_pages_and_readme_keep_their_lines_short():
    long_lines = [
        f"{page.name}:{number}: {len(line)} characters"
        for page in DOCS.glob("*.md")
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    readme = pathlib.Path(REPO, "README.md").read_text().splitlines()
    long_lines += [
        f"README.md:{number}: {len(line)} characters"
        for number, line in enumerate(readme, 1)
        if len(line) > README_MAX_LINE
    ]
    assert not long_lines, "\n".join(long_lines)


def test_the_readme_links_every_topic_page():
    readme = pathlib.Path(REPO, "README.md").read_text()
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", readme))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"
    assert all((DOCS / name).is_file() for name in linked), sorted(linked)
