"""The public Python API is listed, exists, has docstrings and is in the API reference.

What is public: `trainer.__all__`, `trainer.layers.__all__`, `strategies.__all__`
and the optimizers of `trainer.loop.optim` (`OPTIMIZERS`, which has no
`__all__`: the module's other names serve the loop). Docstrings are read as
the site reads them (griffe, statically), so a type alias documented by the
string after it counts. tests/test_docs.py checks that the built site renders
them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib

import griffe
import pytest

from tests.helpers import REPO

OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Ftrl", "SGD")  # trainer.loop.optim's public names
LISTED = ("trainer", "trainer.layers", "strategies")  # modules whose `__all__` is public
API_PAGE = pathlib.Path(REPO, "docs", "api.md")


def _public() -> list[tuple[str, str]]:
    """(module, name) for every public name."""
    names = [
        (module, name) for module in LISTED for name in importlib.import_module(module).__all__
    ]
    return names + [("trainer.loop.optim", name) for name in OPTIMIZERS]


@functools.cache
def _package(name: str) -> griffe.Object:
    loader = griffe.GriffeLoader(search_paths=[REPO], allow_inspection=False)
    return loader.load(name)


def _defined(module: str, name: str) -> griffe.Object:
    """What griffe reads for `module.name`: where it is defined (re-exports, lazy names)."""
    value = getattr(importlib.import_module(module), name)
    if inspect.ismodule(value):
        path = value.__name__
    elif inspect.isclass(value) or inspect.isfunction(value):
        path = f"{value.__module__}.{value.__qualname__}"
    else:  # e.g. a type alias: griffe follows the name's import to its assignment
        path = f"{module}.{name}"
    package, _, rest = path.partition(".")
    found = _package(package)[rest] if rest else _package(package)
    return found.final_target if found.is_alias else found


@pytest.mark.parametrize("module, name", _public(), ids=lambda v: v)
def test_each_public_name_exists_with_a_docstring(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is listed, not there"
    documented = _defined(module, name)
    assert documented.docstring and documented.docstring.value.strip(), f"{module}.{name}"


@pytest.mark.parametrize("module, name", _public(), ids=lambda v: v)
def test_each_public_name_is_in_the_api_reference(module, name):
    page = API_PAGE.read_text()
    shown = f"::: {module}.{name}\n" in page or f'heading: "{module}.{name}"' in page
    assert shown or f"::: {_defined(module, name).path}\n" in page, f"{module}.{name}"
