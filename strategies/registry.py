"""Strategy plugins by name: `@register`, `get`, `available`.

Built-in plugins register when the registry is first read. Third-party plugins
are found through the `towerflow.strategies` entry-point group of installed
packages: each entry point names a `Strategy` subclass, registered under the
entry point's name the first time the registry is read.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

import ml_collections

from strategies.errors import UserError

ENTRY_POINT_GROUP = "towerflow.strategies"
BUILTIN_MODULES = (
    "strategies.default",
    "strategies.one_device",
    "strategies.mirrored",
    "strategies.central_storage",
    "strategies.multi_worker",
    "strategies.parameter_server",
)

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator that registers a `Strategy` subclass under `name`.

    Args:
      name: the name users pass to `--strategy`.

    Raises:
      ValueError: `name` is already registered (registries never overwrite).
    """

    def decorator(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(
                f"Strategy `{name}` is already registered by {_REGISTRY[name].__module__}; "
                "pick another name."
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def _load_plugins() -> None:
    """Imports the built-in plugins, then those of installed packages, once."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _REGISTRY:
            continue
        cls = entry_point.load()
        if entry_point.name not in _REGISTRY:
            register(entry_point.name)(cls)


def available() -> dict[str, str]:
    """Every registered strategy name with its one-line description, sorted by name."""
    _load_plugins()
    return {name: _REGISTRY[name].description() for name in sorted(_REGISTRY)}


def get(name: str, options: ml_collections.ConfigDict | None = None):
    """Builds the strategy plugin registered as `name`.

    Args:
      name: a registered name (see `available()`).
      options: the plugin's options, usually `config.strategy.<name>`.

    Raises:
      UserError: `name` is not registered; the message lists the known names.
    """
    return plugin(name)(options)


def plugin(name: str) -> type:
    """The `Strategy` subclass registered as `name`, not yet built.

    Raises:
      UserError: `name` is not registered; the message lists the known names.
    """
    _load_plugins()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(
            f"Unknown strategy `{name}`; known strategies: {known}. "
            "Pass one of them with `--strategy`."
        )
    return _REGISTRY[name]
