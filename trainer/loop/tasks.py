"""The user's own task (`trainer.Task`): model, data and maybe loss and step.

The built-in objectives (`task.name=classification` or `regression`) are in
`trainer.loop.objectives`; a user's compiled model brings its own
(`trainer.loop.compiled.CompiledObjective`).
"""

from __future__ import annotations

from towerflow import calls

BUILT_IN = ("auto", "classification", "regression")  # `task.name` values of the built-in tasks
# How towerflow calls a user's task and its methods (by these names, or in this order).
MAKE_TASK = calls.Signature("Task", ("config",))
BUILD_MODEL = calls.Signature("build_model", (), "keras.Model")
TRAIN_STEP = calls.Signature(
    "train_step", ("model", "optimizer", "features", "labels", "weights", "replica_loss")
)


class Task:
    """What is trained, when a model builder is not enough: the user's side of the contract.

    Give it as `--config.task.name=my_package.tasks:MyTask` (a subclass, or any
    callable of the config returning an object with these members); its own
    options sit under `config.task` in the user's config file. Everything
    else (distribution, the loop, checkpoints, summaries, export) is towerflow's.

    Must:
      build_model(): a `keras.Model`, compiled with its loss, loss weights and
        metrics, or not compiled when the task gives `loss` (and maybe
        `loss_weights`, `metrics`) below: towerflow compiles it with them.
      dataset_fn(input_context, split, global_batch_size): the `tf.data.Dataset`
        of `split` ("train" or "eval"), batched to
        `input_context.get_per_replica_batch_size(global_batch_size)` and sharded
        by `input_context.input_pipeline_id`, yielding `(features, labels)` or
        `(features, labels, sample_weights)`; features a tensor, tuple or dict.

    May:
      loss, loss_weights, metrics: Keras `compile()` arguments (multi-output
        models: dicts by output name).
      train_step(model, optimizer, features, labels, weights, replica_loss):
        one step on one replica's batch, e.g. with two optimizers or an extra
        loss. `replica_loss(outputs)` gives the task's `(loss share, sums)`:
        the replica's share of the global batch's loss, and the sums the loop
        reports. The step applies its own gradients and returns the sums.

    Each function gets its parameters by name when it names them as above (in
    any order), else in the order above (see `towerflow.calls`).
    """

    loss = None
    loss_weights = None
    metrics = None

    def __init__(self, config):
        self.config = config

    def build_model(self):
        raise NotImplementedError(f"{type(self).__name__} must define `build_model()`.")

    def dataset_fn(self, input_context, split: str, global_batch_size: int):
        raise NotImplementedError(f"{type(self).__name__} must define `dataset_fn(...)`.")


def user_task(config) -> Task | None:
    """The user's task that `task.name` names, made from the config; None for a built-in one.

    Raises:
      UserError: the name does not resolve, or what it makes lacks `build_model`
        or `dataset_fn`. An exception the user's own code raises is theirs.
    """
    from towerflow.errors import UserError
    from towerflow.registry import resolve

    name = config.task.name
    if name in BUILT_IN:
        return None
    if ":" not in name:
        raise UserError(
            f"Unknown `task.name` '{name}'; built-in tasks: {', '.join(BUILT_IN)}, or give "
            "your own as 'module.path:TaskClass'."
        )
    made = resolve("task.name", name, "a Task class, or a function of the config")
    made = calls.adapt(made, MAKE_TASK, f"`task.name` '{name}'")(config)
    missing = [m for m in ("build_model", "dataset_fn") if not callable(getattr(made, m, None))]
    if missing:
        raise UserError(
            f"`task.name` '{name}' made a {type(made).__name__}, which has no "
            f"{' or '.join(f'`{m}`' for m in missing)}; see `trainer.loop.tasks.Task`."
        )
    return made
