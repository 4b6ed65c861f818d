"""Evaluation: one pass over the eval split, inline or by an evaluator member beside training.

`evaluate` runs after the blocks the `evaluation` action schedules and once
at the end of a run; `sidecar_evaluate` is what an evaluator member of a
cluster runs instead of training: each new checkpoint in `model_dir`, until
the last step's.
"""

from __future__ import annotations

import tensorflow as tf

from trainer.loop.checkpoints import Checkpointer
from trainer.loop.job import BuiltJob, checkpointed
from trainer.loop.progress import progress_line, say, tell
from trainer.loop.summaries import Summaries


def evaluate(job: BuiltJob, summaries: Summaries) -> dict:
    """One pass over the eval split; logs and returns its metrics."""
    sums = job.strategy.evaluate(
        job.eval_step, job.dataset.eval_fn(job.config.eval.global_batch_size)
    )
    metrics = job.objective.metrics(sums)
    metrics["examples"] = sums.get("examples", 0.0)
    step = job.step()
    summaries.scalars("eval", step, metrics)
    tell(job.strategy, progress_line("eval", step, metrics))
    return metrics


def sidecar_evaluate(job: BuiltJob) -> dict:
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
            metrics = evaluate(job, summaries)
            if job.step() >= job.total_steps:
                break
        else:
            say(f"no new checkpoint for {config.eval.sidecar_timeout:g} s: stopping")
    finally:
        summaries.close()
        checkpointer.close()
    return {"step": job.step(), "eval": metrics}
