"""The training loop: what `trainer.train_and_evaluate` runs, below the commands.

    train.py        the run: restore or start, train with a controller, evaluate, export
    job.py          the job: strategy, data, model and optimizer under its scope, the features
    component.py    features as components: `Component`, `Feature`, `Slot`, the registry
    features/       the built-in components (follow, input wait, tables, elastic, exports, ...)
    schedule.py     the actions of a run in order, the features' in their slots
    evaluation.py, startup.py, progress.py    eval passes, start-up lines and records, output
    controller.py   blocks of steps sized by the actions' schedules; `Action`
    actions.py      the built-in actions (checkpoint, evaluation, progress, ...) and the user's
    steps.py        the per-replica train and eval steps (`TrainStep`)
    checkpoints.py, summaries.py, export.py   what the chief writes
    restore.py, retention.py                  a checkpointer's restores and its bookkeeping
    portable.py     checkpoints written with another split of the tables and shards
    faults.py, lock.py, checks.py             lost members and blow-ups, one trainer per
                                              `model_dir`, the config checked in one pass
    loop_length.py, precision.py, optim.py    steps per loop, mixed precision, optimizers
    objectives.py, tasks.py, compiled.py,     what is trained: objectives, the user's Task,
    models.py                                 model builders

It uses the layers and the input below it (`trainer.layers`, `trainer.data`),
the strategy plugins and the shared core; it never imports a command
(`trainer.cli`, `trainer.launch`, ...): `tests/test_imports.py`.
"""
