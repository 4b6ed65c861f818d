"""The plugin hooks of towerflow 0.1, mapped onto today's public names until towerflow 0.3.

A plugin written to an earlier interface keeps working for one release: its
class is adapted as it is defined (`adopt`, from `Strategy.__init_subclass__`)
and one line names each old member and its new name, on stderr and as a
`DeprecationWarning` pointing at the plugin's class. Two earlier interfaces are
known: the documented one (`Options = ...`, `_build()`, a `communication`
property, a `local_replicas` classmethod, `supports_*` flags) and the one of
its next version (`_build()`, `_communication`, `_local_replicas`,
`_compute_devices`). Each hook also answers to its old name (`keep_old_names`),
for an old plugin that extends a built-in one through `super()`. Deleting this
module (and its calls in `strategies.base`) drops them; a plugin still using
them is then refused in one line by `strategies.registry`, naming the method it
lacks.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

REMOVED_IN = "towerflow 0.3"

# Old hook -> today's, of the same kind (method, property or classmethod).
RENAMED = {
    "_build": "build_tf_strategy",
    "_communication": "communication",
    "_local_replicas": "local_replicas",
    "_compute_devices": "compute_devices",
}

# Old member -> the `Traits` field that says the same.
TRAITS = {
    "supports_jit_compile": "jit_compile",
    "supports_loss_scaling": "loss_scaling",
    "supports_gradient_transfer": "gradient_transfer",
    "ordered_input": "ordered_input",
    "splits_steps": "splits_steps",
    "gradient_transfer": "transfer",  # set on the instance in `_build` by an old plugin
}


def adopt(cls: type) -> None:
    """Maps `cls`'s own members of an earlier interface onto today's, with one line if any.

    A hook is copied under its new name (the old one stays, for the plugin's own
    calls); `Options` becomes the options dataclass; `supports_*` flags and the
    like become `traits`. A trait given as a property is read from the built
    plugin instead (`adopt_built`).
    """
    own = vars(cls)
    renames = []
    for old, new in RENAMED.items():
        if old in own and new not in own:
            setattr(cls, new, own[old])
            renames.append(f"`{old}` to `{new}`")
    if "Options" in own:
        cls._options_type = own["Options"]
        renames.append(
            f"`Options = {own['Options'].__name__}` to "
            f"`class {cls.__name__}(Strategy, options={own['Options'].__name__})`"
        )
    fixed = {
        new: own[old]
        for old, new in TRAITS.items()
        if old in own and not isinstance(own[old], property | classmethod)
    }
    if fixed:
        cls.traits = dataclasses.replace(cls.traits, **fixed)
    renames += [f"`{old}` to `traits.{new}`" for old, new in TRAITS.items() if old in own]
    if renames:
        _warn(cls, renames)
    keep_old_names(cls)


def keep_old_names(cls: type) -> None:
    """Each hook `cls` itself defines answers to its old name too.

    An old plugin that subclasses a built-in one and calls `super()._build()`,
    or reads `self._communication`, reaches the built-in's own hook.
    """
    own = vars(cls)
    for old, new in RENAMED.items():
        if new in own and old not in own:
            setattr(cls, old, own[new])


def adopt_built(strategy) -> None:
    """Reads the traits an old plugin gives as properties, or sets in `_build`, into `traits`."""
    cls = type(strategy)
    found = {
        new: getattr(strategy, old)
        for old, new in TRAITS.items()
        if isinstance(getattr(cls, old, None), property) or old in vars(strategy)
    }
    if found:
        strategy.traits = dataclasses.replace(strategy.traits, **found)


def _warn(cls: type, renames: list[str]) -> None:
    message = (
        f"strategy plugin `{cls.__module__}.{cls.__qualname__}` uses the plugin interface of "
        f"towerflow 0.1, which works until {REMOVED_IN}: rename {', '.join(renames)} "
        "(see docs/plugins.md)."
    )
    print(f"warning: {message}", file=sys.stderr, flush=True)
    # Frames up: this, `adopt`, `Strategy.__init_subclass__`, `ABCMeta.__new__`, the class.
    warnings.warn(message, DeprecationWarning, stacklevel=5)
