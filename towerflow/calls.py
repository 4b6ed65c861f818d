"""Calling the user's functions: by the names of their parameters, or in order.

towerflow calls functions the user wrote (a `dataset_fn`, a model builder, a
task's methods, an action) with documented parameters, e.g.
`dataset_fn(input_context, split, global_batch_size)`. A function whose
parameters all carry documented names gets them by name, in whatever order
it lists them (and only those it lists: `def dataset(split, input_context)`
is fine); any other function gets them in the documented order, as before::

    call = calls.adapt(fn, calls.Signature("dataset_fn", ("input_context", "split",
                       "global_batch_size")), "`data.name` 'my.data:dataset'")
    dataset = call(context, "train", 128)  # fn(split=..., input_context=..., ...)

A function that can be called neither way is a one-line `UserError` showing
the signature it needs, before anything runs. An error raised inside the
function is the user's own and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from towerflow.errors import UserError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class Signature:
    """How towerflow calls a kind of user function.

    Attributes:
      name: what the function is, e.g. "dataset_fn".
      parameters: the documented parameter names, in the order they are passed.
      returns: what it must return, for messages (e.g. "tf.data.Dataset").
    """

    name: str
    parameters: tuple[str, ...]
    returns: str = ""

    def __str__(self) -> str:
        text = f"{self.name}({', '.join(self.parameters)})"
        return f"{text} -> {self.returns}" if self.returns else text


def adapt(fn: Callable, signature: Signature, origin: str) -> Callable:
    """`fn` as a function of `signature`'s parameters, passed in their documented order.

    Args:
      fn: the user's callable.
      signature: the documented parameters.
      origin: names the function in messages, e.g. "`data.name` 'my.data:dataset'".

    Returns:
      A callable taking the documented parameters positionally, which calls `fn`
      by name when every parameter of `fn` carries a documented name, else in order.

    Raises:
      UserError: `fn` can be called neither by those names nor in that order.
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): called in order
        return fn
    named = [p.name for p in parameters if p.kind in _NAMED]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    positional_only = any(
        p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty for p in parameters
    )
    if not positional_only and set(named) <= set(signature.parameters) and (named or takes_any):
        wanted = set(signature.parameters) if takes_any else set(named)
        names = signature.parameters

        def by_name(*args):
            return fn(**{name: arg for name, arg in zip(names, args) if name in wanted})

        return by_name
    try:
        inspect.signature(fn).bind(*signature.parameters)
    except TypeError:
        raise UserError(
            f"{origin} takes ({_names(parameters)}), and towerflow calls it as {signature}; "
            "give it those parameters, by those names in any order or in that order."
        ) from None
    return fn


def _names(parameters: list[inspect.Parameter]) -> str:
    """The parameters as a user wrote them, without annotations: `a, b=1, *rest`."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(
        stars.get(p.kind, "") + p.name + ("" if p.default is p.empty else f"={p.default!r}")
        for p in parameters
    )
