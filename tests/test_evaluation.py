"""Evaluations while training: every pass runs the same traced loop and leaves nothing behind."""

import os

from tests.helpers import tiny_config
from trainer.loop import train
from trainer.loop.summaries import Summaries


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_repeated_evaluations_keep_the_threads_and_the_traced_loop_they_started_with(tmp_path):
    # A long run evaluating every N steps made a new eval step, traced loop and
    # per-device pipelines (about 6 threads under mirrored) each time, all kept.
    job = train.build(tiny_config(**{"strategy.name": "mirrored"}), str(tmp_path))
    summaries = Summaries(str(tmp_path), enabled=False)
    first = train._evaluate(job, summaries)
    train._evaluate(job, summaries)
    threads = _threads()
    for _ in range(6):
        assert train._evaluate(job, summaries) == first  # the same weights: the same metrics
    assert _threads() <= threads
    assert sum(kind == "eval" for kind, _ in job.strategy._compiled) == 1
