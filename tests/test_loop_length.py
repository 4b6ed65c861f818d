"""Loop length: a fixed `train.steps_per_loop`, or 0 for auto."""

import pytest

from tests.helpers import tiny_config
from towerflow.errors import UserError
from trainer.loop import actions, checks, train
from trainer.loop.loop_length import AUTO_LOOP_S, LoopLength


def test_fixed_length_never_changes():
    loops = LoopLength(100)
    loops.observe(100, 0.001)
    assert loops.next() == 100


def test_auto_grows_to_about_a_second_per_loop():
    loops = LoopLength(0)
    assert loops.next() == 1
    loops.observe(1, 5.0)  # the first loop also traces: slow
    assert loops.next() == 1
    lengths = []
    for _ in range(5):
        n = loops.next()
        loops.observe(n, n * 0.004)  # 4 ms a step
        lengths.append(loops.next())
    assert lengths == [10, 100, 200, 200, 200]  # 250 steps fill a second; 1-2-5 rounding
    assert 200 * 0.004 <= AUTO_LOOP_S


def test_auto_shrinks_when_steps_slow_down():
    loops = LoopLength(0)
    loops.observe(1, 0.001)
    loops.observe(10, 0.01)
    assert loops.next() == 100
    loops.observe(100, 30.0)  # 0.3 s a step
    assert loops.next() == 2


def test_the_first_loop_of_a_run_sizes_nothing():
    loops = LoopLength(0)
    loops.start()
    loops.observe(1, 0.0001)  # a run's first loop: it may time anything (here: nothing)
    assert loops.next() == 1
    loops.observe(1, 0.004)
    loops.observe(10, 0.04)
    assert loops.next() == 100
    loops.start()  # the next run: its first loop starts a pipeline and traces, slowly
    loops.observe(100, 30.0)
    assert loops.next() == 100
    loops.observe(100, 30.0)  # a slow loop later in the run does count
    assert loops.next() == 2


def test_auto_trains_every_step(tmp_path):
    job = train.build(tiny_config(**{"train.steps_per_loop": 0}), str(tmp_path))
    assert train.run(job, "train")["step"] == 20


def test_a_later_run_of_a_job_starts_at_the_length_reached(tmp_path):
    job = train.build(tiny_config(**{"train.steps_per_loop": 0}), str(tmp_path))
    blocks = []
    record = actions.Action(lambda output: blocks.append(output.steps), name="record")
    train.run(job, "train", extra_actions=[record])
    assert blocks[:2] == [1, 1] and sum(blocks) == 20
    first_run = len(blocks)
    job.total_steps = 40
    train.run(job, "train", extra_actions=[record])
    assert blocks[first_run] > 1 and sum(blocks) == 40  # no new ramp from one step


def test_negative_steps_per_loop_is_a_user_error():
    with pytest.raises(UserError, match=r"`train.steps_per_loop` \(-1\) must be >= 0"):
        checks.check_config(tiny_config(**{"train.steps_per_loop": -1}))
