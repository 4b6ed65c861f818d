"""Strategy plugins: one interface over every way of distributing training.

    import strategies
    strategy = strategies.get("mirrored", config.strategy.mirrored)

`available()` lists the registered plugins; `@register(name)` adds one.
"""

# Built-in plugins register themselves on import.
from strategies import central_storage, default, mirrored, one_device  # noqa: E402,F401,I001
from strategies.base import Strategy
from strategies.errors import UserError
from strategies.registry import available, get, register

__all__ = ["Strategy", "UserError", "available", "get", "register"]
