"""Public Python names renamed for one vocabulary, importable by their old names for a release.

A module whose public name changed keeps the old one through a module
`__getattr__` made here: using the old name works, and warns once per use
with a `DeprecationWarning` that names the new one.

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
        warnings.warn(
            f"`{module}.{name}` is renamed `{module}.{renamed[name]}`; the old name goes in "
            f"{REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return namespace[renamed[name]]

    return __getattr__
