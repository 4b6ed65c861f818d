"""Strategy plugins: one interface over every way of distributing training.

    import strategies
    strategy = strategies.get("mirrored", config.strategy.mirrored)

`available()` lists the registered plugins; `@register(name)` adds one. A
plugin subclasses `Strategy` (its hooks, the public contract, are in
`strategies.base`), declares its `Traits` and reads its options with
`read_options`; the hooks of towerflow 0.1 are mapped onto today's, with one
line, by `strategies.deprecated`.

Importing this package does not import TensorFlow: plugins load on the first
`get()` or `available()`, so light tools (the cluster launcher, TF_CONFIG
checks) start at once.

One module per way of distributing at the top (`default`, `one_device`,
`mirrored`, `central_storage`, `multi_worker`, `parameter_server` with its
update modes, `pipeline`), behind `base.Strategy`; beside them what the
plugins share (`transfer`, `sharding`, `devices`, `tf_patches`), and who a
process is in its cluster in `strategies.cluster`. Nothing here imports
`trainer/`.
"""

from strategies.registry import available, get, plugin, register
from towerflow.errors import UserError

__all__ = [
    "Strategy",
    "Traits",
    "UserError",
    "available",
    "get",
    "local_replicas",
    "plugin",
    "read_options",
    "register",
]
_FROM_BASE = ("Strategy", "Traits", "local_replicas", "read_options")


def __getattr__(name: str):
    if name in _FROM_BASE:  # the base imports TensorFlow: only when asked
        from strategies import base

        return getattr(base, name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
