"""Repeated passes leave nothing behind: evaluations run the same traced loop, and a new
train step replaces the loop of the one before."""

import os

import pytest

from tests.helpers import tiny_config
from tests.steps_two_replicas import on_two_cpus
from trainer.loop import evaluation, train
from trainer.loop.summaries import Summaries


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> train.BuiltJob:
    """A job under `mirrored` on 2 replicas (a pipeline per device), built once for the module."""
    return train.build(tiny_config(**on_two_cpus("mirrored")), str(tmp_path_factory.mktemp("job")))


def test_repeated_evaluations_keep_the_threads_and_the_traced_loop_they_started_with(job, tmp_path):
    # A long run evaluating every N steps made a new eval step, traced loop and
    # per-device pipelines (threads) each time, all kept.
    summaries = Summaries(str(tmp_path), enabled=False)
    first = evaluation.evaluate(job, summaries)
    evaluation.evaluate(job, summaries)
    threads = _threads()
    for _ in range(6):
        assert evaluation.evaluate(job, summaries) == first  # the same weights: the same metrics
    assert _threads() <= threads
    assert job.strategy._compiled["eval"][0] is job.eval_step


def test_a_new_train_step_replaces_the_last_ones_loop_and_its_iterators_threads(job):
    # Each `train.run` makes a new train step; the strategy kept every step's traced loop,
    # and with it the per-device pipelines of the iterator it ran (threads each time).
    def run_a_new_step():
        stream = job.dataset.train_fn(job.config.train.global_batch_size, 0)
        iterator = iter(job.strategy.distribute_dataset(stream))
        step = train._train_step(job)
        job.strategy.run_steps(step, iterator, 2)
        return step

    run_a_new_step()
    run_a_new_step()
    threads = _threads()
    for _ in range(2):
        step = run_a_new_step()
    assert _threads() <= threads
    assert job.strategy._compiled["train"][0] is step
