"""The outer loop: restore or start, train with a controller, evaluate, export, report.

`train_and_evaluate(config, model_dir)` is the whole run; the command line
(`python -m trainer`) only parses flags and calls it. `trainer.loop.job.build`
builds everything and writes nothing; `run` is what writes `model_dir`. The
loop never asks which strategy it runs under (that lives in the plugin), nor
which features a run has: each is a component (`trainer.loop.component`) the
loop asks at fixed points (checkpoint, start, step, input, actions, results).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

import ml_collections
import tensorflow as tf

from strategies.cluster import discovery, scratch
from towerflow import renamed, storage
from towerflow.errors import UserError
from trainer.data import service_client
from trainer.loop import (
    actions,
    checks,
    compiled,
    controller,
    evaluation,
    faults,
    schedule,
    startup,
    steps,
)
from trainer.loop import lock as model_dir_lock
from trainer.loop.checkpoints import Checkpointer
from trainer.loop.component import Run
from trainer.loop.export import export
from trainer.loop.job import BuiltJob, build, checkpointed, make_strategy
from trainer.loop.progress import progress_line, say
from trainer.loop.readings import Readings
from trainer.loop.summaries import Summaries

__all__ = ["BuiltJob", "build", "checkpointed", "make_strategy", "progress_line", "run", "say"]
__getattr__ = renamed.old_names(__name__, {"Job": "BuiltJob"}, globals())

MODES = ("train", "eval", "train_and_eval")


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
        return evaluation.sidecar_evaluate(build(config, model_dir, strategy, checked=checked))
    if mode == "eval":  # evaluation reads in the trainer (`trainer.data.service_client`)
        return run(build(config, model_dir, strategy, checked=checked), mode, extra_actions)
    with service_client.started(config.data, strategy.traits.ordered_input, say) as service:
        job = build(config, model_dir, strategy, service, checked)
        return run(job, mode, extra_actions)


def run(job: BuiltJob, mode: str, extra_actions: Sequence[actions.Action] = ()) -> dict:
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
    readings = Readings(job.optimizer, _reads(job))  # one call after each block
    loop = Run(
        checkpointer, summaries, member.watch_preemption(), readings.value, lambda: _export(job)
    )
    try:
        _restore_or_start(job, checkpointer, mode)
        placement = job.strategy.describe(job.model.variables)
        startup.log(job, placement, summaries)
        train_metrics = {}
        evaluate = (
            mode != "train"
            and member.evaluates_inline
            and not discovery.sidecar_evaluator(config.get("cluster"))
        )
        if mode != "eval":
            train_metrics = _train(job, loop, readings, evaluate, extra_actions)
        eval_metrics = evaluation.evaluate(job, summaries) if evaluate else {}
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
        for feature in job.features.values():  # e.g. elastic: every survivor saves its step
            error = feature.lost_member(loop, lost, e)
            if error is not None:
                raise error from None
        raise faults.lost_member_error(e, lost, checkpointer.directory) from None
    finally:
        for feature in job.features.values():  # e.g. the input stops waiting for files
            feature.close()
        summaries.close()
        checkpointer.close()
        if lock:
            lock.release()


def _checkpointer(job: BuiltJob) -> Checkpointer:
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


def _restore_or_start(job: BuiltJob, checkpointer: Checkpointer, mode: str) -> None:
    """Resumes from the newest state in `model_dir`, or starts fresh; tells the features."""
    # A feature may hold a state newer than the newest checkpoint (an elastic survivor's).
    newer = [feature.newer_state(checkpointer.latest) for feature in job.features.values()]
    restored = checkpointer.restore(next((path for path in newer if path), None))
    job.strategy.membership.check_restored(job.step(), job.model_dir)  # every worker, one step
    if restored:
        say(f"restored {restored} at step {job.step()}")
        if checkpointer.resplit:  # written with other table parts or shards
            say(checkpointer.resplit)
    elif mode == "eval":
        raise UserError(
            f"`--mode=eval` needs a checkpoint, and `{job.model_dir}` has none; "
            "train first (`--mode=train_and_eval`)."
        )
    for feature in job.features.values():  # e.g. a warm start loads another run's variables
        feature.start(restored)


def _train(
    job: BuiltJob,
    loop: Run,
    readings: Readings,
    evaluate: bool,
    extra_actions: Sequence[actions.Action] = (),
) -> dict:
    """The outer training loop: a controller with actions; returns the last block's metrics.

    Raises:
      faults.Preempted: SIGTERM arrived; a checkpoint holds the step reached.
      faults.Diverged: the loss blew up more than `train.max_recoveries` times.
    """
    strategy, step = job.strategy, job.step()
    if step >= job.total_steps:
        say(f"already at step {step} of {job.total_steps}: nothing to train")
        return {}
    if loop.checkpointer.latest is None:
        loop.checkpointer.save(step)  # a good state to fall back to if the loss blows up
    train_step = _train_step(job)
    for feature in job.features.values():  # e.g. elastic counts the steps every variable holds
        train_step = feature.wrap_step(train_step, step)
    iterator = _training_input(job, step)

    def run_block(n: int) -> dict:
        sums = strategy.run_steps(train_step, iterator, n)
        # The task's sums, and the plugin's own figures (e.g. staleness).
        sums, scalars, histograms = strategy.report(sums)
        if histograms:  # reading the step costs an eager op, after every block
            loop.summaries.histograms("train", job.step(), histograms)
        return {**job.objective.metrics(sums), **scalars}

    every = [*schedule.actions_of(job, loop, readings, evaluate), *extra_actions]
    agree = strategy.membership.agree
    blocks = controller.Controller(
        run_block, readings.step, job.total_steps, every, job.loop_length, agree=agree
    )
    last = blocks.train()
    if last and last.stopped:
        say(f"stopped at step {last.step}: {last.stopped}")
    return last.metrics if last else {}


def _training_input(job: BuiltJob, step: int):
    """What the steps read: a feature's own input (units), else the data's stream, wrapped."""
    for feature in job.features.values():  # e.g. followed files handed out in units
        given = feature.input()
        if given is not None:
            return given
    iterator = iter(job.strategy.distribute_dataset(_train_stream(job, step)))
    for feature in job.features.values():  # e.g. each batch's wait, as the steps read it
        iterator = feature.wrap_input(iterator)
    return iterator


def _train_step(job: BuiltJob) -> steps.TrainStep | steps.CustomTrainStep:
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


def _train_stream(job: BuiltJob, step: int):
    """The training `dataset_fn` from `step`: from a feature's batch, where one places it."""
    batch, seed = job.config.train.global_batch_size, job.config.seed
    first = job.starts_at(step)
    if first is None:
        return job.dataset.train_fn(batch, seed, step)
    return job.dataset.train_fn(batch, seed, step, start_batch=first)


def _reads(job: BuiltJob) -> dict[str, tf.Variable]:
    """The variables the features read with the step after each block."""
    return {name: v for feature in job.features.values() for name, v in feature.reads().items()}


def _results(job: BuiltJob, train: dict, evaluation: dict, placement: dict, wall_s: float) -> dict:
    """What `results.json` holds: the step, metrics, wall time, placement, input, features'."""
    results = {
        "step": job.step(),
        "train": train,
        "eval": evaluation,
        "wall_time_s": round(wall_s, 3),
        "placement": placement,
        "input": {k: v for k, v in service_client.describe(job.dataset).items() if k != "line"},
    }
    for feature in job.features.values():  # e.g. each dynamic table's policy and ids
        results.update(feature.results())
    if job.dataset.spec.class_names:  # what each class index of the metrics and export is
        results["class_names"] = list(job.dataset.spec.class_names)
    return results


def _export(job: BuiltJob) -> None:
    """Every member exports (some strategies save collectively); only the chief's is kept.

    The export is `model_dir/export`, replaced each time, unless a feature
    writes it its own way (numbered versions while training).
    """
    spec = job.dataset.spec
    raw = isinstance(job.objective, compiled.CompiledObjective)  # the user's outputs, as compiled
    args = (spec.input_shape, spec.num_classes, raw, spec.class_names)

    def write(path: str) -> None:
        export(job.model, path, *args)

    if not job.strategy.membership.is_chief:
        with scratch.directory("export") as private:  # in memory: nothing left on any exit
            write(os.path.join(private, "export"))
        return
    path = os.path.join(job.model_dir, "export")
    if not any(feature.write_export(path, write) for feature in job.features.values()):
        write(path)
        say(f"exported SavedModel to {path}")
