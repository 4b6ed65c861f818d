"""Public Python names renamed for one vocabulary, answering to their old names for a release.

A module whose public name changed keeps the old one through a module
`__getattr__` made here (`old_names`); a renamed argument or attribute calls
`warn` where the old one is used. Either way the old name works, with a
`DeprecationWarning` that names the new one.

>>> import types, warnings
>>> module = types.ModuleType("example")
>>> module.LaunchPlan = object
>>> module.__getattr__ = old_names("example", {"Plan": "LaunchPlan"}, vars(module))
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     module.Plan is module.LaunchPlan
True
>>> print(caught[0].message)
`example.Plan` is renamed `example.LaunchPlan`; the old name goes in towerflow 0.3.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

REMOVED_IN = "towerflow 0.3"


def old_names(
    module: str, renamed: Mapping[str, str], namespace: Mapping[str, object]
) -> Callable[[str], object]:
    """A module `__getattr__` that answers each old name of `renamed` with its new one.

    Args:
      module: the module's dotted name, as the warning shows it.
      renamed: old name -> new name, both in `module`.
      namespace: the module's globals (`globals()`), where the new names are.

    Returns:
      The function to assign to the module's `__getattr__`; another name raises
      `AttributeError` as a module does.
    """

    def __getattr__(name: str) -> object:
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn(f"{module}.{name}", f"{module}.{renamed[name]}", stacklevel=3)
        return namespace[renamed[name]]

    return __getattr__


def warn(old: str, new: str, stacklevel: int = 2) -> None:
    """Warns that `old` (a name, an argument, an attribute) is renamed `new`, for a release.

    Args:
      old: the old name as its user wrote it, e.g. "Server.role".
      new: the name to write instead.
      stacklevel: as `warnings.warn`'s, counted from the caller of `warn`.
    """
    warnings.warn(
        f"`{old}` is renamed `{new}`; the old name goes in {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
