"""After each block the loop reads the step, the learning rate and the input wait in one call."""

import numpy as np
import pytest

from tests.helpers import tiny_config
from trainer.data import wait
from trainer.loop import optim, train
from trainer.loop.readings import Readings


def _cosine_optimizer(total_steps: int):
    config = tiny_config().optimizer
    config.schedule, config.warmup_steps = "cosine", 10
    return optim.build(config, total_steps)


def test_the_values_are_those_of_the_optimizer_and_the_clock_at_each_step():
    optimizer = _cosine_optimizer(1000)
    clock = wait.InputWait()
    readings = Readings(optimizer, {"input_wait": clock.variable})
    for step in (0, 5, 10, 300, 999, 2**40 + 1):  # warm-up, decay, beyond float32
        optimizer.iterations.assign(step)
        clock.variable.assign_add(0.25)
        assert readings.step() == step
        assert readings.learning_rate == pytest.approx(float(optimizer.learning_rate), rel=1e-6)
        assert readings.value("input_wait") == pytest.approx(float(clock.variable.numpy()))
    assert clock.take(readings.value("input_wait")) == pytest.approx(6 * 0.25)
    assert clock.take(readings.value("input_wait")) == 0.0  # taken


def test_without_a_clock_only_the_step_and_the_rate_are_read():
    optimizer = _cosine_optimizer(100)
    readings = Readings(optimizer)
    assert readings.step() == 0
    assert np.isfinite(readings.learning_rate)


def test_a_run_reports_the_rate_and_the_wait_of_its_last_block(tmp_path):
    config = tiny_config(**{"strategy.name": "one_device", "train.steps": 30})
    config.optimizer.schedule = "cosine"
    job = train.build(config, str(tmp_path / "run"))
    results = train.run(job, "train")["train"]
    assert results["learning_rate"] == pytest.approx(float(job.optimizer.learning_rate), rel=1e-6)
    assert results["learning_rate"] != pytest.approx(config.optimizer.learning_rate)  # decayed
    assert np.isfinite(results["input_wait_ms"]) and results["input_wait_ms"] >= 0
