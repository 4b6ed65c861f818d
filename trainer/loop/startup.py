"""What a run says and records as it starts: placement, what is trained, `config.json`.

The chief writes `config.json` (the config as run, with what start-up
found), each feature's own record beside it (`Feature.record`), and the
config to TensorBoard; every member prints nothing but what `tell` lets it.
"""

from __future__ import annotations

import os

import ml_collections

from strategies import devices
from towerflow import storage
from trainer.data import labels, service_client
from trainer.loop import checks, tasks
from trainer.loop.job import BuiltJob
from trainer.loop.progress import tell
from trainer.loop.summaries import Summaries


def log(job: BuiltJob, placement: dict, summaries: Summaries) -> None:
    """The start-up lines; on the chief, `config.json`, the features' records, the config."""
    strategy = job.strategy
    lines = [
        f"strategy: {strategy.name} | replicas: {strategy.num_replicas_in_sync} | "
        f"devices: {', '.join(placement['compute_devices'])} | "
        f"threads per op: {devices.threads_per_op()}",
        f"communication: {placement['communication']}",
    ]
    lines += [f"  {name}: {', '.join(where)}" for name, where in placement["variables"].items()]
    batch, micro = job.config.train.global_batch_size, job.config.train.accumulation_steps
    micro_batches = f" ({micro} micro-batches of {batch // micro})" if micro > 1 else ""
    steps = job.total_steps if job.total_steps < checks.UNTIL_STOPPED else "until stopped"
    lines.append(f"{_what(job)} | steps: {steps} | global batch: {batch}{micro_batches}")
    lines += [*job.dataset.notes, service_client.describe(job.dataset)["line"]]
    for feature in job.features.values():  # e.g. each dynamic table's policy and size
        lines += feature.lines()
    for line in lines:
        tell(strategy, line)
    if strategy.membership.is_chief:
        config_json = _recorded(job).to_json_best_effort(indent=2, sort_keys=True)
        storage.write_text(os.path.join(job.model_dir, "config.json"), config_json + "\n")
        for feature in job.features.values():  # e.g. the variables a warm start reads
            feature.record()
        summaries.text("config", f"```\n{config_json}\n```")
        summaries.hparams(job.config, os.path.basename(os.path.abspath(job.model_dir)))


def _recorded(job: BuiltJob) -> ml_collections.ConfigDict:
    """The config as run, with what start-up found: the class names of `label_vocabulary=auto`."""
    config = job.config
    names = job.dataset.spec.class_names
    if names and config.data.get("label_vocabulary", "") == labels.AUTO:
        config = config.copy_and_resolve_references()
        config.data.label_vocabulary = ",".join(names)
    return config


def _what(job: BuiltJob) -> str:
    """What is trained, for the start-up line: a user's task, or the model and the data."""
    config, size = job.config, f"({job.model.count_params():,} parameters)"
    if config.task.name not in tasks.BUILT_IN:
        return f"task: {config.task.name} {size}"
    return f"model: {config.model.name} {size} | data: {config.data.name}"
