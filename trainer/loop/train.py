"""The outer loop: build under the strategy's scope, train, checkpoint, evaluate, export.

`train_and_evaluate(config, model_dir)` is the whole job; the command line
(`python -m trainer`) only parses flags and calls it. The loop never asks
which strategy it runs under: everything that differs lives in the plugin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

import keras
import ml_collections
import tensorflow as tf

import strategies
from strategies import devices, tf_patches, unrolled
from strategies.cluster import discovery, scratch
from towerflow import calls, storage
from towerflow.errors import UserError
from trainer import data, layers
from trainer.data import follow, labels, service_client, wait
from trainer.loop import (
    actions,
    checks,
    compiled,
    controller,
    elastic,
    faults,
    loop_length,
    models,
    objectives,
    optim,
    precision,
    steps,
    tasks,
    warm_start,
)
from trainer.loop import lock as model_dir_lock
from trainer.loop.checkpoints import Checkpointer
from trainer.loop.export import export, export_version
from trainer.loop.readings import Readings
from trainer.loop.summaries import Summaries

MODES = ("train", "eval", "train_and_eval")
_ONE_PIPELINE = tf.distribute.InputContext()  # one pipeline feeding one replica
_FOLLOW_BLOCK_STEPS = 100  # `data.follow` with `train.steps_per_loop=0`: steps of a block


@dataclasses.dataclass
class Job:
    """Everything built for one run, before anything is written to `model_dir`."""

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
    input_wait: wait.InputWait | None = None  # seconds the training stream kept steps waiting
    follower: follow.Follower | None = None  # the files of `data.follow` and the position in them
    warm_start: warm_start.Plan | None = None  # what `train.warm_start` loads into a fresh run
    counted: elastic.CountedStep | None = None  # elastic: the step every variable holds
    # Elastic `batch=per_replica`: the input position in per-replica batches, checkpointed.
    input_position: elastic.InputPosition | None = None
    # Steps to an iteration of a loop's `while` (`strategies.unrolled`): more in a long run.
    unroll: unrolled.Unroll = unrolled.Unroll()
    # Auto's measured loop length, kept: a later `run` of the job starts where this one was.
    loop_length: loop_length.LoopLength | None = None

    @functools.cached_property
    def eval_step(self) -> Callable:
        """The eval step, made once: the strategy traces an eval pass once per step function."""
        return steps.make_eval_step(self.model, self.objective)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    model_dir: str,
    mode: str = "train_and_eval",
    extra_actions: Sequence[actions.Action] = (),
) -> dict:
    """Runs the job described by `config` in `model_dir`; returns the results dict.

    Args:
      config: a config from `configs/` (see `configs/default.py` for every field).
      model_dir: where checkpoints, TensorBoard events, results and the export go.
        A rerun with the same `model_dir` resumes from its newest checkpoint.
      mode: "train", "eval" (the newest checkpoint, once) or "train_and_eval".
      extra_actions: more actions for the training loop, after the built-in
        ones and `train.actions` (e.g. the benchmark's clock).

    Raises:
      UserError: a bad config value, name, size or path. Nothing in `model_dir`
        has been written when it is raised.
    """
    if mode not in MODES:
        raise UserError(f"Unknown `--mode` '{mode}'; known: {', '.join(MODES)}.")
    checked = checks.check_config(config)  # every field that needs nothing else, once
    strategy = make_strategy(config, checked)
    member = strategy.membership
    if member.role == "serve":  # a ps or worker member of a parameter-server cluster
        say(f"serving as a {strategy.name} member until the chief ends the job")
        member.serve()
        return {}
    if member.role == "evaluate":
        return sidecar_evaluate(build(config, model_dir, strategy, checked=checked))
    if mode == "eval":  # evaluation reads in the trainer (`trainer.data.service_client`)
        return run(build(config, model_dir, strategy, checked=checked), mode, extra_actions)
    with service_client.started(config.data, strategy.traits.ordered_input, say) as service:
        job = build(config, model_dir, strategy, service, checked)
        return run(job, mode, extra_actions)


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
    if config.data.get("follow", False) and not plugin.traits.ordered_input:
        raise UserError(
            f"`data.follow` trains on each record once, in order, and `strategy.name` '{name}' "
            "lets workers take batches as they come, so records would train twice or never "
            "across restarts; use `multi_worker`, `mirrored` or `one_device`."
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


def build(
    config: ml_collections.ConfigDict,
    model_dir: str,
    strategy: strategies.Strategy | None = None,
    service: service_client.Service | None = None,
    checked: checks.Checked | None = None,
) -> Job:
    """Builds strategy, data, model and optimizer and checks them; writes nothing.

    With a `service` (`service_client.started`), the training input runs on it.
    `checked` is `checks.check_config(config)`, where the caller already has it.
    """
    checked = checked or checks.check_config(config)
    strategy = strategy or make_strategy(config, checked)
    config = _group_config(config, strategy)
    user_task = tasks.user_task(config)
    custom_step = _custom_step(user_task, config, strategy)
    if user_task is None:
        dataset = data.get(config.data, checked.data)
    else:
        fn, name = user_task.dataset_fn, config.task.name
        dataset = data.from_function(config.data, fn, name, checked.data)
    total_steps = checks.total_steps(config, dataset.spec)
    _check_model_dir(config, model_dir, strategy.membership.is_chief, dataset.spec)
    data.check(dataset)
    follower = follow.follower_of(dataset)
    dataset = service_client.wrap(dataset, service, model_dir)
    # TensorFlow refuses clocks under op determinism (`train.deterministic`).
    timed = strategy.traits.ordered_input and not config.train.deterministic
    input_wait = wait.InputWait() if timed else None
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
    warm_start.check_resumed(model, model_dir)  # both checked before any write
    warm = warm_start.plan(config, model, list(model.variables))
    return Job(
        config,
        model_dir,
        strategy,
        dataset,
        objective,
        total_steps,
        model,
        optimizer,
        user_actions,
        custom_step,
        input_wait,
        follower,
        warm,
        input_position=elastic.InputPosition() if elastic.per_replica(config) else None,
        unroll=unrolled.for_run(
            config.train.steps_per_iteration, total_steps, strategy.membership.cluster is None
        ),
        loop_length=loop_length.LoopLength(config.train.steps_per_loop),
    )


def _group_config(
    config: ml_collections.ConfigDict, strategy: strategies.Strategy
) -> ml_collections.ConfigDict:
    """The config this group of replicas runs, its batches checked against them.

    An elastic group may train other batches and another rate than the config
    gives (`elastic.group_batches`): it runs a copy with them; the caller's
    config is not changed.
    """
    if elastic.enabled(config):
        cluster = strategy.membership.cluster
        workers = cluster.num_workers if cluster else 1
        replicas = strategy.num_replicas_in_sync
        batches = elastic.group_batches(config, replicas, workers, say)
        config = elastic.for_group(config, batches)
    checks.check_batch(config, strategy)
    return config


def _check_model_dir(
    config: ml_collections.ConfigDict, model_dir: str, is_chief: bool, spec: data.DataSpec
) -> None:
    """`model_dir` can be written (the chief) or read, and an earlier run there agrees."""
    if is_chief:
        checks.check_model_dir(model_dir)
    else:  # every member reads model_dir; the chief alone checks that it can be written
        storage.check_scheme(model_dir, "--model_dir")
    _check_class_names(model_dir, spec.class_names)
    if config.get("cluster"):  # the input position of a resumed run is read as it was written
        elastic.check_batch_kept(config, model_dir)


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
    return objectives.for_spec(classes, models.output_kind(model), dataset.spec.class_names)


def run(job: Job, mode: str, extra_actions: Sequence[actions.Action] = ()) -> dict:
    """Trains and/or evaluates a built `job`; the only function that writes `model_dir`."""
    start = time.time()
    member, config = job.strategy.membership, job.config
    say(f"model_dir: {job.model_dir}")
    # One trainer at a time writes model_dir (the chief); `--mode=eval` only reads it.
    lock = model_dir_lock.take(job.model_dir) if member.is_chief and mode != "eval" else None
    if member.is_chief:
        tf.io.gfile.makedirs(job.model_dir)
    checkpointer = _checkpointer(job)
    summaries = Summaries(job.model_dir, member.is_chief)
    try:
        _restore_or_start(job, checkpointer, mode)
        placement = job.strategy.describe(job.model.variables)
        _log_start(job, placement, summaries)
        train_metrics = {}
        evaluate = (
            mode != "train"
            and member.evaluates_inline
            and not discovery.sidecar_evaluator(config.get("cluster"))
        )
        if mode != "eval":
            train_metrics = _train(job, checkpointer, summaries, evaluate, extra_actions)
        eval_metrics = _evaluate(job, summaries) if evaluate else {}
        results = _results(job, train_metrics, eval_metrics, placement, time.time() - start)
        if mode != "eval" and config.train.export:
            _export(job)
        if member.is_chief:
            storage.write_json(os.path.join(job.model_dir, "results.json"), results)
        return results
    except tf.errors.OpError as e:
        with contextlib.suppress(Exception):  # a save under way may need the lost member
            checkpointer.sync()
        lost = faults.lost_members(e, member.lost_members())
        if lost is None:
            raise
        if elastic.enabled(config):  # every survivor saves the step it completed
            raise _reform(job, checkpointer, lost, e) from None
        raise faults.lost_member_error(e, lost, checkpointer.directory) from None
    finally:
        if job.follower:  # the input stream stops waiting for files, however the run ends
            job.follower.close()
        summaries.close()
        checkpointer.close()
        if lock:
            lock.release()


def _checkpointer(job: Job) -> Checkpointer:
    """The chief's checkpoints of `job` (every member restores through it)."""
    config = job.config
    checkpointer = Checkpointer(
        job.model_dir,
        job.strategy.membership.is_chief,
        config.train.max_checkpoints,
        async_save=config.train.async_checkpoint,
        full_every=config.train.get("full_checkpoint_every", 0),
        **checkpointed(job),
    )
    if config.train.get("full_checkpoint_every", 0) and not checkpointer.incremental:
        say(
            "note: `train.full_checkpoint_every` has no dynamic table to save rows of; every "
            "checkpoint is full"
        )
    return checkpointer


def _restore_or_start(job: Job, checkpointer: Checkpointer, mode: str) -> None:
    """Resumes from the newest state in `model_dir`, or starts fresh (maybe warm)."""
    # An elastic job's survivors may have saved a newer step than the newest checkpoint:
    # a rerun resumes from it, elastic or not.
    restored = elastic.restore(checkpointer, job.model_dir)
    job.strategy.membership.check_restored(_step(job), job.model_dir)  # every worker, one step
    if restored:
        say(f"restored {restored} at step {_step(job)}")
        if checkpointer.resplit:  # written with other table parts or shards
            say(checkpointer.resplit)
        if job.warm_start:
            say("`train.warm_start` left aside: this run resumes from its own checkpoint")
    elif mode == "eval":
        raise UserError(
            f"`--mode=eval` needs a checkpoint, and `{job.model_dir}` has none; "
            "train first (`--mode=train_and_eval`)."
        )
    elif job.warm_start:
        say(warm_start.apply(job.warm_start))


def _results(job: Job, train: dict, evaluation: dict, placement: dict, wall_s: float) -> dict:
    """What `results.json` holds: the step, metrics, wall time, placement, input, tables."""
    results = {
        "step": _step(job),
        "train": train,
        "eval": evaluation,
        "wall_time_s": round(wall_s, 3),
        "placement": placement,
        "input": {k: v for k, v in service_client.describe(job.dataset).items() if k != "line"},
    }
    tables = layers.describe_tables(job.model)
    if tables:  # each dynamic table's policy, where its parts are, the ids they hold
        results["tables"] = {
            name: {k: v for k, v in t.items() if k != "line"} for name, t in tables.items()
        }
    if elastic.enabled(job.config):
        config = job.config
        results["elastic"] = {
            "batch": "per_replica" if elastic.per_replica(config) else "global",
            "global_batch": config.train.global_batch_size,  # this, the last group's
            "learning_rate": config.optimizer.learning_rate,  # its peak rate
            "reforms": elastic.reforms(job.model_dir),
        }
    if job.dataset.spec.class_names:  # what each class index of the metrics and export is
        results["class_names"] = list(job.dataset.spec.class_names)
    return results


def _reform(job: Job, checkpointer: Checkpointer, lost: list[str], error: Exception):
    """Elastic: this survivor saves the step it completed; the error that ends it (exit 145)."""
    why = f"{', '.join(lost)} stopped answering ({type(error).__name__})"
    step = job.counted.completed if job.counted else _step(job)
    name = job.strategy.membership.cluster.member_name
    return elastic.reform(
        why, checkpointer.checkpoint, job.model_dir, step, name, job.optimizer.iterations
    )


def _export(job: Job) -> None:
    """Every member exports (some strategies save collectively); only the chief's is kept.

    With exports while training (`export.every_steps`, `export.every_secs`),
    `model_dir/export` holds versions, this one `export/<step>/`; else the
    export is `model_dir/export` itself, replaced each time.
    """
    spec = job.dataset.spec
    raw = isinstance(job.objective, compiled.CompiledObjective)  # the user's outputs, as compiled
    args = (spec.input_shape, spec.num_classes, raw, spec.class_names)
    if not job.strategy.membership.is_chief:
        with scratch.directory("export") as private:  # in memory: nothing left on any exit
            export(job.model, os.path.join(private, "export"), *args)
        return
    path = os.path.join(job.model_dir, "export")
    if not _exports_while_training(job.config):
        export(job.model, path, *args)
        say(f"exported SavedModel to {path}")
        return
    step, keep, tic = _step(job), job.config.export.keep, time.perf_counter()
    if export_version(path, step, keep, lambda version: export(job.model, version, *args)):
        seconds = time.perf_counter() - tic
        say(f"exported SavedModel version {step} to {path}/{step} in {seconds:.1f} s")


def _exports_while_training(config: ml_collections.ConfigDict) -> bool:
    export_config = config.get("export")
    return bool(export_config and (export_config.every_steps or export_config.every_secs))


def sidecar_evaluate(job: Job) -> dict:
    """Evaluates each new checkpoint in `model_dir` until the last step's (the evaluator member)."""
    config = job.config
    checkpointer = Checkpointer(job.model_dir, False, 1, **checkpointed(job))
    summaries = Summaries(job.model_dir, enabled=True)
    metrics: dict = {}
    try:
        say(f"evaluating checkpoints in {checkpointer.directory} as they appear")
        for path in tf.train.checkpoints_iterator(
            checkpointer.directory, min_interval_secs=1, timeout=config.eval.sidecar_timeout
        ):
            checkpointer.restore(path)
            metrics = _evaluate(job, summaries)
            if _step(job) >= job.total_steps:
                break
        else:
            say(f"no new checkpoint for {config.eval.sidecar_timeout:g} s: stopping")
    finally:
        summaries.close()
        checkpointer.close()
    return {"step": _step(job), "eval": metrics}


def checkpointed(job: Job) -> dict:
    """What a checkpoint of `job` holds: the `Checkpointer`'s objects (also the benchmark's)."""
    # None where a job is a model and optimizer only (the benchmark's).
    follower = getattr(job, "follower", None)
    position = getattr(job, "input_position", None)
    return {
        "model": job.model,
        "optimizer": job.optimizer,
        # Listed explicitly: a Keras model does not expose every variable to a TF
        # checkpoint (e.g. dropout's seed state), and exact resume needs them all;
        # their shapes also tell a checkpoint of another model apart.
        "variables": list(job.model.variables),
        # Listed too: a checkpoint written with other table parts restores into
        # these through the same structure (`trainer.loop.portable`).
        "tables": layers.table_indexes(job.model),
        # `data.follow`: the file being trained on and the records of it trained on.
        **({"input": follower.position} if follower else {}),
        # Elastic `batch=per_replica`: the stream's batches before the group's first step.
        **({"elastic_input": position} if position else {}),
    }


def _train(
    job: Job,
    checkpointer: Checkpointer,
    summaries: Summaries,
    evaluate: bool,
    extra_actions: Sequence[actions.Action] = (),
) -> dict:
    """The outer training loop: a controller with actions; returns the last block's metrics.

    Raises:
      faults.Preempted: SIGTERM arrived; a checkpoint holds the step reached.
      faults.Diverged: the loss blew up more than `train.max_recoveries` times.
    """
    config, strategy = job.config, job.strategy
    step = _step(job)
    if step >= job.total_steps:
        say(f"already at step {step} of {job.total_steps}: nothing to train")
        return {}
    if checkpointer.latest is None:
        checkpointer.save(step)  # a good state to fall back to if the loss blows up
    gb = config.train.global_batch_size
    train_step = _train_step(job)
    if elastic.enabled(config):  # a survivor saves the step its variables hold
        local = len(strategy.tf_strategy.extended.worker_devices)  # this process's replicas
        job.counted = train_step = elastic.CountedStep(train_step, step, local)
    iterator = iter(strategy.distribute_dataset(_train_stream(job, gb, step)))
    if job.input_wait is not None:  # each batch's wait, as the loop of steps reads it
        iterator = job.input_wait.timed(iterator)
    readings = Readings(job.optimizer, job.input_wait)  # one call after each block

    def run_block(n: int) -> dict:
        sums = strategy.run_steps(train_step, iterator, n)
        # The task's sums, and the plugin's own figures (e.g. staleness).
        sums, scalars, histograms = strategy.report(sums)
        if histograms:  # reading the step costs an eager op, after every block
            summaries.histograms("train", _step(job), histograms)
        return {**job.objective.metrics(sums), **scalars}

    loop = controller.Controller(
        run_block,
        readings.step,
        job.total_steps,
        [*_actions(job, checkpointer, summaries, evaluate, readings), *extra_actions],
        job.loop_length,
        agree=strategy.membership.agree,
    )
    last = loop.train()
    if last and last.stopped:
        say(f"stopped at step {last.step}: {last.stopped}")
    return last.metrics if last else {}


def _train_step(job: Job) -> steps.TrainStep | steps.CustomTrainStep:
    """The step of a block: towerflow's, or a task's own (which applies its own gradients)."""
    config, gb = job.config, job.config.train.global_batch_size
    if job.custom_step is not None:
        return steps.CustomTrainStep(
            job.custom_step, job.model, job.optimizer, job.objective, gb, job.unroll
        )
    return steps.TrainStep(
        job.model,
        job.optimizer,
        job.objective,
        gb,
        config.optimizer.clip_global_norm,
        config.train.jit_compile,
        config.train.accumulation_steps,
        job.strategy.traits.transfer,
        job.unroll,
    )


def _train_stream(job: Job, global_batch: int, step: int):
    """The training `dataset_fn` from `step`: from the stream's batch, where groups differed."""
    if job.input_position is None:
        return job.dataset.train_fn(global_batch, job.config.seed, step)
    first = job.input_position.start(step, job.strategy.num_replicas_in_sync)
    return job.dataset.train_fn(global_batch, job.config.seed, step, start_batch=first)


def _actions(
    job: Job, checkpointer: Checkpointer, summaries: Summaries, evaluate: bool, readings: Readings
) -> list[actions.Action]:
    """The loop's actions, in the order they run after a block.

    `readings` holds the learning rate and the input wait as read with the step
    after the block.
    """
    config, member = job.config, job.strategy.membership
    recoveries = []
    tables = layers.dynamic_tables(job.model)

    def recover(step: int, loss: float) -> None:
        recoveries.append(step)
        _recover(job, checkpointer, step, loss, len(recoveries))

    def input_wait(output: controller.Output) -> None:
        # How long each step waited for its batches, on average over the block.
        waited = job.input_wait.take(readings.input_wait_total)
        output.metrics["input_wait_ms"] = 1000 * waited / output.steps

    def log(output: controller.Output) -> None:
        summaries.scalars("train", output.step, output.metrics)
        total = output.total_steps if output.total_steps < checks.UNTIL_STOPPED else None
        _tell(job, progress_line("train", output.step, output.metrics, total))

    watch = member.watch_preemption()
    # Elastic: a silent peer ends the step (the survivors then save), not the process.
    give_up = faults.abort_step if elastic.enabled(config) else faults.exit_member_lost
    built_in = [
        # First: the position in the files moves on with every block trained, rolled back or not.
        *_follow_actions(job, watch, checkpointer),
        actions.recovery(
            lambda loss: faults.loss_blew_up(loss, config.train.loss_upper_bound), recover
        ),
        actions.rates(config.train.global_batch_size, lambda: readings.learning_rate),
        *([actions.every_block(input_wait, "input wait")] if job.input_wait else []),
        # Dynamic tables' ids, admissions, evictions, default-row share and bytes, per block.
        *([actions.tables(lambda: layers.table_figures(job.model))] if tables else []),
        *([_membership(job, checkpointer)] if elastic.enabled(config) else []),
        actions.every_block(log, "progress"),
        actions.checkpoint(checkpointer.save, config.train.checkpoint_every),
        # After the checkpoint: an export is the model of the checkpoint at its step.
        *_export_actions(job),
        actions.preemption(watch, checkpointer.save, say),
        # A single process has no other member to lose; the watchdog then never reports.
        actions.watchdog(faults.Watchdog(member.lost_members, say, give_up=give_up)),
    ]
    if config.train.profile_steps:  # on every member: all end their blocks at the same steps
        logdir = os.path.join(job.model_dir, "train")  # TensorBoard's run "train"
        profile_steps, step = config.train.profile_steps, lambda: _step(job)
        built_in.append(actions.profile(profile_steps, logdir, step, say, member.is_chief))
    if evaluate:
        built_in.append(actions.evaluation(lambda: _evaluate(job, summaries), config.eval.every))
    return built_in + job.user_actions


def _follow_actions(job: Job, watch, checkpointer: Checkpointer) -> list[actions.Action]:
    """`data.follow`: whole blocks once their files are there, the position, the backlog."""
    if job.follower is None:
        return []
    config = job.config

    def while_waiting() -> None:  # SIGTERM while no file comes: save and stop as always
        actions.stop_if_preempted(watch, checkpointer.save, say, _step(job))

    block = config.train.steps_per_loop or _FOLLOW_BLOCK_STEPS
    everyone = job.strategy.membership.everyone  # workers that step together start together
    return actions.follow(
        job.follower, config.train.global_batch_size, block, while_waiting, everyone
    )


def _export_actions(job: Job) -> list[actions.Action]:
    """Exports while training (`export.every_steps`, `export.every_secs`), on every member."""
    if not _exports_while_training(job.config):
        return []
    every = job.config.export
    agree = job.strategy.membership.agree  # the chief's clock decides for every member
    return actions.exports(lambda step: _export(job), every.every_steps, every.every_secs, agree)


def _membership(job: Job, checkpointer: Checkpointer) -> actions.Action:
    """Elastic: the membership in every block's metrics, and a re-formed group's record."""
    member, strategy = job.strategy.membership, job.strategy
    return elastic.membership(
        member.cluster.num_workers if member.cluster else 1,
        strategy.num_replicas_in_sync,
        job.config.train.global_batch_size,
        job.config.optimizer.learning_rate,
        job.model_dir,
        member.is_chief,
        checkpointer.save,
        say,
    )


def _recover(job: Job, checkpointer: Checkpointer, step: int, loss: float, attempt: int) -> int:
    """Restores the last good checkpoint after a loss blow-up; returns its step."""
    limit = job.config.train.max_recoveries
    good = checkpointer.latest
    if attempt > limit:
        raise faults.Diverged(
            f"loss {loss:.4g} at step {step} is non-finite or above `train.loss_upper_bound` "
            f"after {limit} recoveries; the last good checkpoint is {good}. Lower "
            "`optimizer.learning_rate` or set `optimizer.clip_global_norm`, then rerun."
        )
    checkpointer.restore(good)
    if job.input_position is not None:  # `good` may be an earlier group's: this group's origin
        job.input_position.start(_step(job), job.strategy.num_replicas_in_sync)
    say(
        f"loss {loss:.4g} blew up by step {step}: restored {good} (step {_step(job)}), "
        f"recovery {attempt} of {limit}; going on with fresh data"
    )
    return _step(job)


def _evaluate(job: Job, summaries: Summaries) -> dict:
    """One pass over the eval split; logs and returns its metrics."""
    sums = job.strategy.evaluate(
        job.eval_step, job.dataset.eval_fn(job.config.eval.global_batch_size)
    )
    metrics = job.objective.metrics(sums)
    metrics["examples"] = sums.get("examples", 0.0)
    step = _step(job)
    summaries.scalars("eval", step, metrics)
    _tell(job, progress_line("eval", step, metrics))
    return metrics


def _step(job: Job) -> int:
    return int(job.optimizer.iterations.numpy())


def _log_start(job: Job, placement: dict, summaries: Summaries) -> None:
    strategy = job.strategy
    _tell(
        job,
        f"strategy: {strategy.name} | replicas: {strategy.num_replicas_in_sync} | "
        f"devices: {', '.join(placement['compute_devices'])} | "
        f"threads per op: {devices.threads_per_op()}",
    )
    _tell(job, f"communication: {placement['communication']}")
    for name, where in placement["variables"].items():
        _tell(job, f"  {name}: {', '.join(where)}")
    batch, micro = job.config.train.global_batch_size, job.config.train.accumulation_steps
    micro_batches = f" ({micro} micro-batches of {batch // micro})" if micro > 1 else ""
    steps = job.total_steps if job.total_steps < checks.UNTIL_STOPPED else "until stopped"
    _tell(job, f"{_what(job)} | steps: {steps} | global batch: {batch}{micro_batches}")
    for note in job.dataset.notes:
        _tell(job, note)
    _tell(job, service_client.describe(job.dataset)["line"])
    for table in layers.describe_tables(job.model).values():
        _tell(job, table["line"])
    if strategy.membership.is_chief:
        config_json = _recorded(job).to_json_best_effort(indent=2, sort_keys=True)
        storage.write_text(os.path.join(job.model_dir, "config.json"), config_json + "\n")
        warm_start.record(job.model, checkpointed(job)["variables"], job.model_dir)
        summaries.text("config", f"```\n{config_json}\n```")
        summaries.hparams(job.config, os.path.basename(os.path.abspath(job.model_dir)))


def _recorded(job: Job) -> ml_collections.ConfigDict:
    """The config as run, with what start-up found: the class names of `label_vocabulary=auto`."""
    config = job.config
    names = job.dataset.spec.class_names
    if names and config.data.get("label_vocabulary", "") == labels.AUTO:
        config = config.copy_and_resolve_references()
        config.data.label_vocabulary = ",".join(names)
    return config


def _what(job: Job) -> str:
    """What is trained, for the start-up line: a user's task, or the model and the data."""
    config, size = job.config, f"({job.model.count_params():,} parameters)"
    if config.task.name not in tasks.BUILT_IN:
        return f"task: {config.task.name} {size}"
    return f"model: {config.model.name} {size} | data: {config.data.name}"


def progress_line(split: str, step: int, metrics: dict, total: int | None = None) -> str:
    """One fixed-width line: `train | step: 1200/1500 | loss: 0.3100 | ...`."""
    parts = [f"{split:<5}", f"step: {step}/{total}" if total else f"step: {step}"]
    for name, value in metrics.items():
        if "/" in name:  # per class (TensorBoard and results.json): too many for one line
            continue
        if name == "learning_rate":
            parts.append(f"lr: {value:.2e}")
        elif name.endswith("_per_sec"):
            parts.append(f"{name.removesuffix('_per_sec')}/s: {value:.1f}")
        elif name in ("examples", "members", "replicas", "per_replica_batch", "global_batch"):
            parts.append(f"{name}: {int(value)}")
        elif name == "ids_held":  # in the dynamic tables
            parts.append(f"ids: {int(value)}")
        elif name.startswith("backlog_"):  # `data.follow`: files and records not trained on
            parts.append(f"{name}: {int(value)}")
        elif name == "behind_s":
            parts.append(f"behind_s: {value:.1f}")
        else:
            parts.append(f"{name}: {value:.4f}")
    return " | ".join(parts)


def _tell(job: Job, line: str) -> None:
    """Progress from the chief (and a sidecar evaluator); other workers stay quiet."""
    member = job.strategy.membership
    if member.is_chief or member.role != "train":
        say(line)


def say(line: str) -> None:
    """Progress for the terminal: one line, flushed at once."""
    print(line, flush=True)
