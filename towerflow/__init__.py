"""towerflow's shared core: what every layer above may use, and nothing else.

    towerflow/     errors.py    one-line errors (`UserError`, `MemberLost`, `one_line`)
                                and every exit status of every command
                   registry.py  the one `Registry` type and "module.path:name" references
                   storage.py   files under `model_dir` and sweep directories (`tf.io.gfile`)
                   processes.py child processes in groups, stopped with a grace
                   calls.py     how a user's function is called (by parameter names, or in order)

The layers above, bottom to top: `strategies/` (distribution), the model's
layers and the input (`trainer/layers/`, `trainer/data/`), the loop
(`trainer/loop/`), and the commands at the top of `trainer/`. The core
imports nothing of them, and none of its modules imports TensorFlow when it
loads (`storage` imports it on first use), so the light commands (the
launcher, the sweep) start at once (`tests/test_imports.py` checks both).
"""
