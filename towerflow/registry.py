"""The one `Registry` type (strategies, models, datasets), and `resolve` for "module.path:name".

A `Registry` refuses a duplicate name, lists the known names, and resolves
the user's own "module.path:name" references (`resolve`), so a model, a
dataset or a strategy given by the user is found, and fails, the same way.
`strategies.registry` holds the strategy plugins in one. `own_imported`
imports towerflow's own modules by name, never a user's of the same name.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from towerflow.errors import UserError

F = TypeVar("F")


class Registry(dict):
    """Things by name (strategies, models, datasets): one type for every registry.

    `@registry.register("name")` adds one and refuses a name already taken;
    `names()` lists them; `lookup` also resolves the user's own "module.path:name".

    Args:
      kind: what it holds, for messages (e.g. "Strategy").
      origin: says where a registered value comes from, for the duplicate-name error.
    """

    def __init__(self, kind: str, origin: Callable[[object], str] | None = None):
        super().__init__()
        self.kind = kind
        self._origin = origin or (lambda value: f"module `{getattr(value, '__module__', '?')}`")

    def register(self, name: str, replaces: object = None) -> Callable[[F], F]:
        """Decorator: adds the value under `name`; a name already taken is an error.

        Args:
          name: the name users give.
          replaces: a placeholder the value may take the place of (a plugin's entry
            point, while that entry point imports the plugin).

        Raises:
          ValueError: `name` is taken (registries never overwrite).
        """

        def decorator(value: F) -> F:
            if name in self and (replaces is None or self[name] is not replaces):
                raise ValueError(
                    f"{self.kind} `{name}` is already registered by {self._origin(self[name])}; "
                    "pick another name."
                )
            self[name] = value
            return value

        return decorator

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)

    def lookup(self, field: str, name: str, expect: str) -> Callable:
        """The function registered as `name`, or the user's own "module.path:name".

        Args:
          field: the config field that holds `name`, for messages (e.g. "model.name").
          name: a registered name, or "module.path:name".
          expect: what the user's callable must be, for messages.

        Raises:
          UserError: an unknown name (the message lists the known ones), or a
            reference that does not resolve (see `resolve`).
        """
        if name in self:
            return self[name]
        if ":" not in name:
            raise UserError(
                f"Unknown {self.kind.lower()} `{field}` '{name}'; known: "
                f"{', '.join(self.names())}, or your own as 'module.path:name' ({expect})."
            )
        return resolve(field, name, expect)


def resolve(field: str, reference: str, expect: str) -> Callable:
    """The callable that "module.path:name" names, for a config field such as `model.name`.

    Args:
      field: the config field, for messages (e.g. "task.name").
      reference: "module.path:name".
      expect: what the callable must be, for messages (e.g. "a function returning a Task").

    Raises:
      UserError: not of that form, no such module, or no such callable in it. A
        module that exists but fails while importing raises its own error: the
        bug is in the user's code, and its traceback says where.
    """
    module_name, colon, attr = reference.partition(":")
    if not colon or not module_name or not attr:
        raise UserError(
            f"`{field}` '{reference}' is not 'module.path:name'; give {expect}, "
            f"e.g. `--config.{field}=my_package.module:name`."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not e.name or not module_name.startswith(e.name):
            raise  # the user's module imports something missing: their traceback
        raise UserError(
            f"`{field}` '{reference}': no module '{e.name}'; check the module path and that "
            "it is importable from the working directory or PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(
            f"`{field}` '{reference}': module '{module_name}' has no '{attr}'; give {expect}."
        )
    return fn


# The directory that holds towerflow's packages (`towerflow`, `strategies`, `trainer`,
# `configs`): a checkout's top directory, or the site-packages it is installed in.
_OWN_ROOT = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def own_imported(names: Sequence[str], failing_ok: bool = False) -> str | None:
    """Imports towerflow's own modules `names`, never a package of the same name the user has.

    `python -m` puts the working directory first on `sys.path`, and a user's
    project may hold packages named like ours (`strategies`, `configs`). The
    modules are imported with the working directory out of `sys.path`, unless it
    is towerflow's own checkout; `sys.path` is then as it was.

    Args:
      names: the modules, e.g. `("strategies",)`.
      failing_ok: a module that fails to import is left to whoever imports it
        next (which fails on it as it would have); else the error is raised.

    Returns:
      The working directory that was left out, or None where it was kept.
    """
    cwd = os.path.realpath(os.getcwd())
    left_out = None if cwd == _OWN_ROOT else cwd
    path = list(sys.path)
    if left_out:
        sys.path[:] = [p for p in path if os.path.realpath(p or ".") != left_out]
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:
                if not failing_ok:
                    raise
    finally:
        sys.path[:] = path
    return left_out
