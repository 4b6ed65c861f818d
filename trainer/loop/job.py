"""The built job: what one process builds of the training run (strategy, data, model, ...).

A job is the training run; a `BuiltJob` is what one process built of it
(strategy, data, model, optimizer, features), nothing written yet.
`build(config, model_dir)` checks the config once, makes the strategy, adapts
the config to the group it runs (each component may), builds the data, the
model, its optimizer and objective under the strategy's scope, then each
registered component's `Feature` (`trainer.loop.component`). Nothing is
written to `model_dir` here: `trainer.loop.train.run` is what writes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import keras
import ml_collections
import tensorflow as tf

import strategies
from strategies import devices, tf_patches, unrolled
from strategies.cluster import discovery
from towerflow import calls, renamed, storage
from towerflow.errors import UserError
from trainer import data, layers
from trainer.data import labels, service_client
from trainer.loop import (
    actions,
    checks,
    compiled,
    component,
    loop_length,
    models,
    objectives,
    optim,
    precision,
    steps,
    tasks,
)
from trainer.loop.progress import say

_ONE_PIPELINE = tf.distribute.InputContext()  # one pipeline feeding one replica


@dataclasses.dataclass
class BuiltJob:
    """What one process built of the job (the training run), before anything is written."""

    config: ml_collections.ConfigDict
    model_dir: str
    strategy: strategies.Strategy
    dataset: data.Dataset
    objective: objectives.Classification | objectives.Regression | compiled.CompiledObjective
    total_steps: int
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    user_actions: list[actions.Action] = dataclasses.field(default_factory=list)
    custom_step: Callable | None = None  # a user task's own `train_step`
    # The features this run has (`Component.build` gave one), by component name, in order.
    features: dict[str, component.Feature] = dataclasses.field(default_factory=dict)
    # Steps to an iteration of a loop's `while` (`strategies.unrolled`): more in a long run.
    unroll: unrolled.Unroll = unrolled.Unroll()
    # Auto's measured loop length, kept: a later `run` of the job starts where this one was.
    loop_length: loop_length.LoopLength | None = None

    @functools.cached_property
    def eval_step(self) -> Callable:
        """The eval step, made once: the strategy traces an eval pass once per step function."""
        return steps.make_eval_step(self.model, self.objective)

    def step(self) -> int:
        """The step the model is at (the optimizer's count)."""
        return int(self.optimizer.iterations.numpy())

    def feature(self, name: str) -> component.Feature | None:
        """The `Feature` of the component `name` in this run, or None where it is off."""
        return self.features.get(name)

    def starts_at(self, step: int) -> int | None:
        """Tells every feature training (re)starts at `step`; the input stream's first batch.

        None: the stream starts at the step's own batch (no feature places it).
        """
        firsts = [feature.starts_at(step) for feature in self.features.values()]
        return next((first for first in firsts if first is not None), None)


def checkpointed(job: BuiltJob) -> dict:
    """What a checkpoint of `job` holds: the `Checkpointer`'s objects (also the benchmark's)."""
    held = {
        "model": job.model,
        "optimizer": job.optimizer,
        # Listed explicitly: a Keras model does not expose every variable to a TF
        # checkpoint (e.g. dropout's seed state), and exact resume needs them all;
        # their shapes also tell a checkpoint of another model apart.
        "variables": list(job.model.variables),
        # Listed too: a checkpoint written with other table parts restores into
        # these through the same structure (`trainer.loop.portable`).
        "tables": layers.table_indexes(job.model),
    }
    # None where a job is a model and optimizer only (a test's, the benchmark's).
    for feature in getattr(job, "features", {}).values():  # e.g. the position in the files
        held.update(feature.checkpoint())
    return held


def build(
    config: ml_collections.ConfigDict,
    model_dir: str,
    strategy: strategies.Strategy | None = None,
    service: service_client.Service | None = None,
    checked: checks.Checked | None = None,
) -> BuiltJob:
    """Builds strategy, data, model, optimizer and the features, and checks them; writes nothing.

    With a `service` (`service_client.started`), the training input runs on it.
    `checked` is `checks.check_config(config)`, where the caller already has it.
    """
    checked = checked or checks.check_config(config)
    strategy = strategy or make_strategy(config, checked)
    components = component.registered()
    for each in components:  # the config this group of replicas runs (e.g. elastic batches)
        config = each.adapt(config, strategy, say)
    checks.check_batch(config, strategy)
    user_task = tasks.user_task(config)
    custom_step = _custom_step(user_task, config, strategy)
    if user_task is None:
        dataset = data.get(config.data, checked.data)
    else:
        fn, name = user_task.dataset_fn, config.task.name
        dataset = data.from_function(config.data, fn, name, checked.data)
    total_steps = checks.total_steps(config, dataset.spec)
    _check_model_dir(model_dir, strategy.membership.is_chief, dataset.spec)
    data.check(dataset)
    keras.utils.set_random_seed(config.seed)
    with strategy.scope(), precision.policy(checked.precision):
        if user_task is None:
            model = models.build(config.model, dataset.spec)
        else:
            model = _task_model(user_task, config.task.name)
        _build_on_data(model, dataset)
        strategy.place_model(model)  # a model-parallel plugin moves layers to their devices
        optimizer = optim.build(config.optimizer, total_steps)
        optimizer = precision.wrap_optimizer(optimizer, checked.precision)
        optimizer.build(model.trainable_variables)
        objective = _objective(model, dataset, config)
    user_actions = actions.user_actions(config.train.get("actions", ""), config)
    built = component.Context(
        config, model_dir, strategy, dataset, model, optimizer, total_steps, say, objective
    )
    features = {each.name: each.build(built) for each in components}
    return BuiltJob(
        config,
        model_dir,
        strategy,
        service_client.wrap(dataset, service, model_dir),
        objective,
        total_steps,
        model,
        optimizer,
        user_actions,
        custom_step,
        {name: feature for name, feature in features.items() if feature is not None},
        unroll=unrolled.for_run(
            config.train.steps_per_iteration, total_steps, strategy.membership.cluster is None
        ),
        loop_length=loop_length.LoopLength(config.train.steps_per_loop),
    )


def make_strategy(
    config: ml_collections.ConfigDict, checked: checks.Checked | None = None
) -> strategies.Strategy:
    """Checks the config (before a cluster is joined), sets up devices, builds the plugin.

    `checked`: `checks.check_config(config)`, where the caller already has it.
    """
    checked = checked or checks.check_config(config)
    # The cluster becomes this process's `TF_CONFIG` before any plugin reads it.
    cluster_line = discovery.resolve(config.get("cluster"), config.strategy.name).line()
    if cluster_line:
        say(cluster_line)
    # Same inputs, same bits, every run; off again for a later run in this process without it.
    tf_patches.op_determinism(config.train.deterministic)
    # A traced `super()` (the optimizers' update steps) keeps no frame, nor its iterators.
    tf_patches.super_leaves_no_frames()
    # towerflow's own functions are written in TF ops: converting them cost each process 3 s.
    tf_patches.own_code_unconverted()
    # A replica's device pipeline has nothing to tune; its tuning thread delays its end.
    tf_patches.device_datasets_untuned()
    name = config.strategy.name
    plugin, options = strategies.plugin(name), config.strategy.get(name)
    if config.train.jit_compile and not plugin.traits.jit_compile:
        raise UserError(
            f"`train.jit_compile` does not work under `{name}`, whose variables live away from "
            "the devices that compute; set `--config.train.jit_compile=False`, or use "
            "`mirrored` or `one_device`."
        )
    if checked.precision == "mixed_float16" and not plugin.traits.loss_scaling:
        raise UserError(
            f"`train.precision` 'mixed_float16' (loss scaling) does not work under `{name}`; "
            "use `--config.train.precision=mixed_bfloat16` (no loss scaling), or `mirrored`."
        )
    devices.configure(
        config.devices.logical_cpus,
        config.devices.gpu_memory_growth,
        config.devices.gpu_memory_limit_mb,
        config.devices.log_placement,
        config.devices.intra_op_threads,
        replicas=strategies.local_replicas(plugin, options, config.devices.logical_cpus),
    )
    return plugin(options)


def _custom_step(user_task, config: ml_collections.ConfigDict, strategy: strategies.Strategy):
    """The user task's own `train_step`, adapted and checked against the strategy; or None."""
    custom_step = getattr(user_task, "train_step", None)
    if custom_step is not None:
        origin = f"`task.name` '{config.task.name}' `train_step`"
        custom_step = calls.adapt(custom_step, tasks.TRAIN_STEP, origin)
    steps.check_custom_step(custom_step, config, strategy.traits.transfer)
    if custom_step is not None and strategy.traits.splits_steps:
        raise UserError(
            f"`task.name` '{config.task.name}' brings its own `train_step`, which applies its "
            f"own gradients, and `strategy.{strategy.name}` as set runs a step's gradients and "
            f"its update apart; leave `strategy.{strategy.name}`'s update options at their "
            "defaults (e.g. `sync_replicas=0`, `staleness=none`)."
        )
    return custom_step


def _check_model_dir(model_dir: str, is_chief: bool, spec: data.DataSpec) -> None:
    """`model_dir` can be written (the chief) or read, and an earlier run there agrees."""
    if is_chief:
        checks.check_model_dir(model_dir)
    else:  # every member reads model_dir; the chief alone checks that it can be written
        storage.check_scheme(model_dir, "--model_dir")
    _check_class_names(model_dir, spec.class_names)


def _check_class_names(model_dir: str, names: tuple[str, ...]) -> None:
    """A run that resumes in `model_dir` must give each class index the name it had.

    Raises:
      UserError: `config.json` of an earlier run in `model_dir` records other class
        names (e.g. `label_vocabulary=auto` found another class in changed files).
    """
    recorded = storage.read_json(os.path.join(model_dir, "config.json")) or {}
    before = recorded.get("data", {}).get("label_vocabulary", "")
    if not names or not before or before == labels.AUTO or before == ",".join(names):
        return
    raise UserError(
        f"`--model_dir` '{model_dir}' was trained with the classes {before} (its config.json), "
        f"and `data.label_vocabulary` now gives {','.join(names)}; resume with "
        f"`--config.data.label_vocabulary={before}`, or train into a new `--model_dir`."
    )


def _task_model(task: tasks.Task, name: str) -> keras.Model:
    """The user task's model, compiled with the task's `loss` if it came uncompiled."""
    model = calls.adapt(task.build_model, tasks.BUILD_MODEL, f"`task.name` '{name}'")()
    if not isinstance(model, keras.Model):
        raise UserError(
            f"`task.name` '{name}': `build_model()` returned {type(model).__name__}, "
            "not a keras.Model."
        )
    if compiled.is_compiled(model):
        return model
    if getattr(task, "loss", None) is None:
        raise UserError(
            f"`task.name` '{name}': `build_model()` returned a model that is not compiled, "
            "and the task has no `loss`; compile the model, or give the task a `loss`."
        )
    model.compile(
        loss=task.loss,
        loss_weights=getattr(task, "loss_weights", None),
        metrics=getattr(task, "metrics", None),
    )
    return model


def _build_on_data(model: keras.Model, dataset: data.Dataset) -> None:
    """Creates the variables of a model built without its input shape, on one batch of the data.

    A `keras.Sequential` without `keras.Input` (or a subclassed model) has no
    variables until it is first called; the optimizer and the checkpoint need them.
    """
    if model.built and model.variables:
        return
    features, _, _ = steps.unpack(next(iter(dataset.eval_fn(2)(_ONE_PIPELINE))))
    model(compiled.model_inputs(model, features), training=False)


def _objective(model: keras.Model, dataset: data.Dataset, config: ml_collections.ConfigDict):
    """The loss and metrics: those the user `compile()`d the model with, or the data's task."""
    task_name = config.task.name
    if compiled.is_compiled(model):
        features, labels, _ = steps.unpack(next(iter(dataset.eval_fn(2)(_ONE_PIPELINE))))
        if task_name in tasks.BUILT_IN:
            origin = f"`model.name` '{config.model.name}'"
        else:
            origin = f"`task.name` '{task_name}'"
        return compiled.CompiledObjective(model, features, labels, origin)
    classes = dataset.spec.num_classes
    wanted = {"classification": classes > 0, "regression": classes == 0}.get(task_name, True)
    if not wanted:
        raise UserError(
            f"`task.name` '{task_name}' does not fit the data's `num_classes` ({classes}); "
            "use `task.name=auto`, or set the data's class count."
        )
    objective = objectives.for_spec(classes, models.output_kind(model), dataset.spec.class_names)
    _, labels, _ = steps.unpack(dataset.eval_fn(2)(_ONE_PIPELINE).element_spec)
    objective.check_labels(labels)  # before anything is written
    return objective


__getattr__ = renamed.old_names(__name__, {"Job": "BuiltJob"}, globals())
