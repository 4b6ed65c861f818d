"""A table of functions by name that refuses a duplicate name (built-in models, datasets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """`@registry.register("name")` adds a function; `registry.names()` lists them."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: adds the function under `name`; a duplicate name is an error."""

        def decorator(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} `{name}` is already registered; pick another name.")
            self[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)
