"""Strategy plugins by name (`@register`, `get`, `available`).

The plugins sit in one `towerflow.registry.Registry`, the type that also
holds models and datasets (in `trainer/`): it refuses a duplicate name,
lists the known names, and resolves the user's own "module.path:name".

Built-in plugins register when the registry is first read. Third-party plugins
are found through the `towerflow.strategies` entry-point group of installed
packages: each entry point names a `Strategy` subclass. Their names are read
at once (a name taken twice is an error naming both packages), their modules
only when that plugin is used: a plugin whose module fails to import, or whose
class does not implement the plugin contract (`strategies.base.Strategy`'s
abstract hooks), breaks only the commands that use it, with one line naming
what it lacks, and `available()` shows it as broken.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

import ml_collections

from towerflow.errors import UserError
from towerflow.registry import Registry

ENTRY_POINT_GROUP = "towerflow.strategies"
BUILTIN_MODULES = (
    "strategies.default",
    "strategies.one_device",
    "strategies.mirrored",
    "strategies.central_storage",
    "strategies.multi_worker",
    "strategies.parameter_server",
    "strategies.pipeline",
)

# name -> the registered class, or the entry point of a plugin not yet imported.
_REGISTRY: Registry  # made below, once `Registry` is defined
_entry_points_loaded = False
_from_packages: set[str] = set()  # names that came from entry points
_loading: dict[str, importlib.metadata.EntryPoint] = {}  # entry points being imported


class PluginBroken(UserError):
    """An installed package's plugin failed to import; `error` says how, in one line."""

    def __init__(self, message: str, error: str):
        super().__init__(message)
        self.error = error


def register(name: str) -> Callable[[type], type]:
    """Class decorator that registers a `Strategy` subclass under `name`.

    Args:
      name: the name users pass to `--strategy`.

    Raises:
      ValueError: `name` is already registered (registries never overwrite).
    """

    def decorator(cls: type) -> type:
        cls.name = name
        # A third-party module may register itself under its own entry point's name
        # while that entry point loads it.
        return _REGISTRY.register(name, replaces=_loading.get(name))(cls)

    return decorator


def _load_plugins() -> None:
    """Imports the built-in plugins and reads the names of installed packages' plugins, once.

    Raises:
      UserError: two packages (or a package and towerflow) claim one name.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    found = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _REGISTRY or entry_point.name in found:
            other = _REGISTRY.get(entry_point.name) or found[entry_point.name]
            raise UserError(
                f"Strategy `{entry_point.name}` is claimed twice: by {_origin(entry_point)} "
                f"and by {_origin(other)}; uninstall one of them, or rename the entry point."
            )
        found[entry_point.name] = entry_point
    _REGISTRY.update(found)
    _from_packages.update(found)
    _entry_points_loaded = True


def rescan() -> None:
    """Forgets installed packages' plugins and reads their entry points again.

    For a process that installed or removed a plugin package after it first read
    the registry; built-in plugins stay.
    """
    global _entry_points_loaded
    for name in _from_packages:
        _REGISTRY.pop(name, None)
    _from_packages.clear()
    importlib.invalidate_caches()
    _entry_points_loaded = False
    _load_plugins()


def available() -> dict[str, str]:
    """Every registered strategy name with its one-line description, sorted by name.

    A plugin whose package fails to load is listed as `(broken: <its error>)`.
    """
    _load_plugins()
    described = {}
    for name in sorted(_REGISTRY):
        try:
            described[name] = description(plugin(name))
        except PluginBroken as e:
            described[name] = f"(broken: {e.error})"
    return described


def description(cls: type) -> str:
    """A plugin's one line for `--list_strategies`: the first line of its docstring."""
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def get(name: str, options: ml_collections.ConfigDict | None = None):
    """Builds the strategy plugin registered as `name`.

    Args:
      name: a registered name (see `available()`).
      options: the plugin's options, usually `config.strategy.<name>`.

    Raises:
      UserError: `name` is not registered (the message lists the known names), or
        its package fails to load.
    """
    return plugin(name)(options)


def plugin(name: str) -> type:
    """The `Strategy` subclass registered as `name`, not yet built.

    Raises:
      UserError: `name` is not registered (the message lists the known names), or
        its package fails to load.
    """
    _load_plugins()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(
            f"Unknown strategy `{name}`; known strategies: {known}. "
            "Pass one of them with `--strategy`."
        )
    entry = _REGISTRY[name]
    if isinstance(entry, importlib.metadata.EntryPoint):
        _import(name, entry)
    return _REGISTRY[name]


def _import(name: str, entry_point: importlib.metadata.EntryPoint) -> None:
    """Imports a package's plugin and registers its class in place of its entry point."""
    _loading[name] = entry_point
    try:
        cls = entry_point.load()
    except Exception as e:  # any error of a third-party module: that plugin is broken
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise PluginBroken(
            f"Strategy `{name}` from {_origin(entry_point)} failed to load ({error}); "
            "fix or uninstall that package, or pick another `--strategy`.",
            error,
        ) from e
    finally:
        del _loading[name]
    if _REGISTRY[name] is not entry_point:  # the module registered the class itself
        cls = _REGISTRY[name]
    problem = _not_a_plugin(cls)
    if problem:
        _REGISTRY[name] = entry_point  # still broken at the next use, which says so again
        raise PluginBroken(
            f"Strategy `{name}` from {_origin(entry_point)} {problem}; "
            "fix or uninstall that package, or pick another `--strategy`.",
            problem,
        )
    cls.name = name
    _REGISTRY[name] = cls


def _not_a_plugin(cls) -> str:
    """What keeps `cls` from being built as a strategy plugin, in words; "" if nothing."""
    from strategies.base import Strategy  # noqa: PLC0415 (imports TensorFlow: only here)

    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        return f"names {cls!r}, which is no `strategies.Strategy` subclass"
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        hooks = ", ".join(f"`{hook}`" for hook in missing)
        return f"does not implement {hooks} (the plugin contract: docs/plugins.md)"
    return ""


def _origin(entry: type | importlib.metadata.EntryPoint) -> str:
    """Which package a registered class or an entry point comes from, for messages."""
    if isinstance(entry, importlib.metadata.EntryPoint):
        dist = getattr(entry, "dist", None)
        package = dist.name if dist is not None and dist.name else entry.module.split(".")[0]
        return f"package `{package}` (entry point `{entry.name} = {entry.value}`)"
    if entry.__module__ in BUILTIN_MODULES:
        return "package `towerflow`"
    top = entry.__module__.split(".")[0]
    packages = importlib.metadata.packages_distributions().get(top) or [top]
    return f"package `{packages[0]}` (module `{entry.__module__}`)"


_REGISTRY = Registry("Strategy", origin=_origin)
