"""Strategy plugins: one interface over every way of distributing training.

    import strategies
    strategy = strategies.get("mirrored", config.strategy.mirrored)

`available()` lists the registered plugins; `@register(name)` adds one.
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

__all__ = ["Strategy", "UserError", "available", "get", "local_replicas", "plugin", "register"]


def __getattr__(name: str):
    if name in ("Strategy", "local_replicas"):  # the base imports TensorFlow: only when asked
        from strategies import base

        return getattr(base, name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
