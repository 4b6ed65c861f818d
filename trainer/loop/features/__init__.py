"""The built-in components (`trainer.loop.component`): each feature of the loop in its own module.

    follow.py       `data.follow`: files as they arrive, the position in them checkpointed
    input_wait.py   how long steps waited for their input (`input_wait_ms`)
    tables.py       dynamic tables: their figures each block, start-up lines, results
    elastic.py      `cluster.elastic`: a group that re-forms at another size
    exports.py      `export.every_steps`/`every_secs`: numbered versions while training
    profile.py      `train.profile_steps`: a TensorBoard profile of chosen steps
    warm_start.py   `train.warm_start`: a new run from another run's variables
    progressive.py  `eval.progressive`: each batch scored before it trains, windowed

Importing this package registers them, in the order of `BUILT_IN` (the order
their actions run in within a slot). The loop imports none of them: the registry does, when
it is first read.
"""

import importlib

# In the order their actions run within a slot (`trainer.loop.component.Slot`).
BUILT_IN = (
    "follow",
    "input_wait",
    "tables",
    "elastic",
    "exports",
    "profile",
    "warm_start",
    "progressive",
)

for _module in BUILT_IN:
    importlib.import_module(f"{__name__}.{_module}")  # registers its component
