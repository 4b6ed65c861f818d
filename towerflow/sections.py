"""Config sections declared once, as typed dataclasses: defaults, types and rules in one place.

A *declaration* is a frozen dataclass, one field per config field: its type, its
default, and its meaning in the comment beside or above it (the configuration
reference, docs/hooks/config_reference.py, reads those comments). Its docstring
opens with where its fields sit: "`export`." for a section of its own (the rest
of the docstring is the section's description), or "`train`: ..." for some
fields of a section that holds others too. Rules that need nothing but the
section's own values go in its `__post_init__`, raising `UserError`.

A `Section` puts a declaration in the config: `configs/default.py` builds the
config's fields from it (`defaults()`), and at start-up `read(config)` checks
every field's type and the declaration's rules, once, and returns the typed
options. No TensorFlow here, so a config file may import a module of declarations.

>>> @dataclasses.dataclass(frozen=True)
... class Toy:
...     '''`toy`.'''
...     count: int = 3  # how many toys
>>> section = Section("toy", Toy)
>>> section.read(ml_collections.ConfigDict({"toy": {"count": 5}}))
Toy(count=5)
>>> section.read(ml_collections.ConfigDict({"toy": {"count": "5"}}))
Traceback (most recent call last):
...
towerflow.errors.UserError: `toy.count` ('5') must be an int; set e.g. `--config.toy.count=3`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from towerflow.errors import UserError

_NAMES = {bool: "True or False", int: "an int", float: "a number", str: "a string"}


@dataclasses.dataclass(frozen=True)
class Section:
    """Where a declaration's fields sit in the config.

    Attributes:
      path: the section, dotted ("export", "cluster.elastic").
      options: the declaration, a frozen dataclass.
      shared: False: the section holds these fields only (another is refused as a
        typo); True: they are some of the fields of a section that holds others
        (e.g. `train.profile_steps` among `train`'s).
    """

    path: str
    options: type
    shared: bool = False

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"section `{self.path}`: {self.options!r} is not a dataclass")

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field's dotted path, e.g. ("export.every_steps", ...)."""
        return tuple(f"{self.path}.{field.name}" for field in dataclasses.fields(self.options))

    def defaults(self) -> ml_collections.ConfigDict:
        """The fields at their declared defaults, in declaration order (a config's section)."""
        return ml_collections.ConfigDict(dataclasses.asdict(self.options()))

    def read(self, config: ml_collections.ConfigDict) -> Any:
        """The options `config` sets, over the declared defaults, their types and rules checked.

        A field the config lacks (a config file written before it) takes its default.

        Raises:
          UserError: a value of another type, a value its rules refuse, or (a section of
            its own) a field it does not declare; naming the field, the value and the fix.
        """
        return self.parse(_section_of(config, self.path))

    def parse(self, given: Mapping[str, Any]) -> Any:
        """The options of the section's fields in hand (`given`), as `read` reads them.

        For a caller that holds the section itself rather than the whole config
        (a plugin's `config.strategy.<name>`, a model builder's `config.model`).

        Raises:
          UserError: as `read`.
        """
        hints = _hints(self.options)
        declared = {field.name: field for field in dataclasses.fields(self.options)}
        unknown = [] if self.shared else self.undeclared(given)
        if unknown:
            raise UserError(
                f"`{self.path}.{unknown[0]}` is no field of `{self.path}`; its fields: "
                f"{', '.join(declared)} (check the spelling)."
            )
        values = {}
        for name, field in declared.items():
            default = field.default
            if default is dataclasses.MISSING:
                default = field.default_factory()
            value = given.get(name, default)
            values[name] = _typed(f"{self.path}.{name}", value, hints[name], default)
        return self.options(**values)

    def undeclared(self, given: Mapping[str, Any]) -> list[str]:
        """The names in `given` that the declaration has no field for, sorted."""
        declared = {field.name for field in dataclasses.fields(self.options)}
        return sorted(set(given) - declared)


def _hints(options: type) -> dict[str, Any]:
    """Each field's declared type; `Any` (left to the dataclass's rules) for all where the
    annotations name what cannot be resolved here (a plugin's, imported only to type-check)."""
    try:
        return typing.get_type_hints(options)
    except (NameError, TypeError, AttributeError):
        return {field.name: Any for field in dataclasses.fields(options)}


def _section_of(config: ml_collections.ConfigDict, path: str) -> dict:
    """The section at dotted `path` as a dict of its fields ({} where a config has none).

    Raises:
      UserError: a value stands where the section (or one above it) should be.
    """
    section, walked = config, []
    for key in path.split("."):
        walked.append(key)
        section = section.get(key)
        if section is None:
            return {}
        if not isinstance(section, (ml_collections.ConfigDict, dict)):
            where = ".".join(walked)
            raise UserError(
                f"`{where}` ({section!r}) must be a section of fields, as in "
                f"configs/default.py; set its fields, e.g. `--config.{path}.FIELD=VALUE`."
            )
    return dict(section.items())


def _typed(field: str, value: Any, kind: Any, default: Any) -> Any:
    """`value` as `kind` (a list for a tuple; an int for a float), or a one-line error."""
    fits, value = _fits(value, kind)
    if not fits:
        raise UserError(
            f"`{field}` ({value!r}) must be {_name(kind)}; set e.g. `--config.{field}={default!r}`."
        )
    return value


def _fits(value: Any, kind: Any) -> tuple[bool, Any]:
    """Whether `value` is of the declared type `kind`, and the value to use."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            fits, converted = _fits(value, arm)
            if fits:
                return True, converted
        return False, value
    if kind is type(None):
        return value is None, value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False, value
        items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        if len(items) != len(value):
            return False, value
        checked = [_fits(item, arm) for item, arm in zip(value, items)]
        return all(fits for fits, _ in checked), tuple(item for _, item in checked)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return True, float(value)
    if kind in (int, float) and isinstance(value, bool):
        return False, value
    if isinstance(origin, type):  # list[str], dict[str, int]: the container's type only
        return isinstance(value, origin), value
    if kind is Any or not isinstance(kind, type):  # Any, Literal[...]: left to its rules
        return True, value
    return isinstance(value, kind), value


def _name(kind: Any) -> str:
    """How an error names a type: "an int", "a tuple of ints", "a string or None"."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join("None" if arm is type(None) else _name(arm) for arm in args)
    if typing.get_origin(kind) is tuple:
        if args[1:] == (Ellipsis,):
            return f"a tuple of {_name(args[0]).split(' ', 1)[1]}s"
        return f"a tuple ({', '.join(_name(arm) for arm in args)})"
    return _NAMES.get(kind, getattr(kind, "__name__", str(kind)))


def at_least(
    field: str, value: float, minimum: float, meaning: str, example: float | None = None
) -> None:
    """A declaration's rule: `value` of `field` is `minimum` or more.

    Args:
      field: its dotted path, e.g. "export.keep".
      value: the value given.
      minimum: the least value allowed.
      meaning: what the field means, said in the error.
      example: a value to suggest; by default the larger of `minimum` and 1.

    Raises:
      UserError: it is less, with the rule, what the field means and an example.
    """
    if value < minimum:
        example = max(minimum, 1) if example is None else example
        raise UserError(
            f"`{field}` ({value}) must be >= {minimum} ({meaning}); "
            f"set e.g. `--config.{field}={example}`."
        )
