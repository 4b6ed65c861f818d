"""The controller: block lengths from the actions' schedules, action order, stop and skip."""

import contextlib

from trainer.loop import controller
from trainer.loop.controller import Action, Controller, Output
from trainer.loop.loop_length import LoopLength


class Counter:
    """A stand-in for a model's step counter: `run_block(n)` advances it by n."""

    def __init__(self, step: int = 0):
        self.step = step
        self.blocks: list[int] = []

    def run_block(self, n: int) -> dict:
        self.blocks.append(n)
        self.step += n
        return {"loss": 1.0 / self.step}


def make(counter: Counter, total: int, actions, steps_per_loop: int = 100) -> Controller:
    return Controller(
        counter.run_block, lambda: counter.step, total, actions, LoopLength(steps_per_loop)
    )


def test_blocks_end_where_a_scheduled_action_is_due():
    counter, seen = Counter(), []
    actions = [
        Action(lambda o: seen.append(("ckpt", o.step)), every=30, at_end=True),
        Action(lambda o: seen.append(("eval", o.step)), every=50),
    ]
    make(counter, 120, actions).train()
    assert counter.blocks == [30, 20, 10, 30, 10, 20]
    assert seen == [
        ("ckpt", 30),
        ("eval", 50),
        ("ckpt", 60),
        ("ckpt", 90),
        ("eval", 100),
        ("ckpt", 120),
    ]


def test_resumes_from_the_current_step():
    counter, steps = Counter(step=70), []
    make(counter, 100, [Action(lambda o: steps.append(o.step))], steps_per_loop=20).train()
    assert steps == [90, 100]


def test_stop_training_runs_the_end_actions_once():
    counter, saved, after = Counter(), [], []

    def stop(output: Output) -> None:
        if output.step >= 20:
            raise controller.StopTraining("loss is low enough")

    actions = [
        Action(lambda o: saved.append(o.step), every=1000, at_end=True),
        Action(stop),
        Action(lambda o: after.append(o.stopped)),
    ]
    last = make(counter, 1000, actions, steps_per_loop=10).train()
    assert last.step == 20 and last.stopped == "loss is low enough"
    assert saved == [20]  # not due by schedule; once, at the stop
    assert after == ["", "loss is low enough"]


def test_skip_block_drops_the_rest_of_its_actions():
    counter, seen, rolled_back = Counter(), [], []

    def rollback(output: Output) -> None:
        if output.step == 20 and not rolled_back:
            rolled_back.append(True)
            counter.step = 10  # restored an earlier checkpoint
            raise controller.SkipBlock

    actions = [Action(rollback), Action(lambda o: seen.append(o.step))]
    make(counter, 30, actions, steps_per_loop=10).train()
    assert counter.blocks == [10, 10, 10, 10]
    assert seen == [10, 20, 30]


def test_an_actions_hooks_wrap_the_loop_and_each_block():
    counter, events = Counter(), []

    @contextlib.contextmanager
    def around(what):
        events.append(f"enter {what}")
        yield
        events.append(f"exit {what}")

    action = Action(
        lambda output: events.append(f"after {output.step}"),
        loop=lambda: around("loop"),
        block=lambda step: around(f"block {step}"),
    )
    make(counter, 20, [action], steps_per_loop=10).train()
    assert events == [
        "enter loop",
        "enter block 0",
        "exit block 0",
        "after 10",
        "enter block 10",
        "exit block 10",
        "after 20",
        "exit loop",
    ]


def test_an_action_of_hooks_only_is_never_called_but_still_ends_blocks():
    counter, blocks = Counter(), []

    def stop(output: Output) -> None:
        raise controller.StopTraining("enough")

    def block(step: int) -> contextlib.AbstractContextManager:
        blocks.append(step)
        return contextlib.nullcontext()

    hooks_only = Action(None, every=0, at_end=True, at_steps=(3,), block=block)
    make(counter, 20, [hooks_only, Action(stop, every=7)], steps_per_loop=10).train()
    assert counter.blocks == [3, 4] and blocks == [0, 3]


def test_steps_until_next_event_never_passes_the_end():
    actions = [Action(print, every=7), Action(print, every=0)]
    assert controller.steps_until_next_event(5, 6, actions, 100) == 1
    assert controller.steps_until_next_event(0, 100, actions, 100) == 7
    assert controller.steps_until_next_event(7, 100, actions, 3) == 3


def test_a_users_action_stops_training_and_the_end_actions_still_run(tmp_path):
    from tests import helpers, user_actions
    from trainer.loop import train

    user_actions.SEEN.clear()
    config = helpers.tiny_config(
        **{"train.actions": "tests.user_actions:stop_at_10", "strategy.name": "one_device"}
    )
    results = train.train_and_evaluate(config, str(tmp_path))
    assert results["step"] == 10
    assert [step for step, _ in user_actions.SEEN] == [5, 10]
    assert {"loss", "learning_rate", "examples_per_sec"} <= set(user_actions.SEEN[-1][1])
    assert helpers.checkpoint_values(tmp_path)  # the end-of-run checkpoint, at step 10
    assert results["eval"]["examples"] == 360


def test_a_users_action_keeps_its_schedule(tmp_path):
    from tests import helpers, user_actions
    from trainer.loop import train

    user_actions.SEEN.clear()
    config = helpers.tiny_config(
        **{"train.actions": "tests.user_actions:every_4_steps", "strategy.name": "one_device"}
    )
    train.train_and_evaluate(config, str(tmp_path))
    assert [step for step, _ in user_actions.SEEN] == [4, 8, 12, 16, 20]


def test_a_bad_action_name_is_one_line(tmp_path):
    import pytest

    from tests import helpers
    from towerflow.errors import UserError
    from trainer.loop import train

    for name, message in [
        ("no_colon", "is not 'module.path:name'"),
        ("tests.nowhere:fn", "no module 'tests.nowhere'"),
        ("tests.user_actions:missing", "has no 'missing'"),
    ]:
        config = helpers.tiny_config(**{"train.actions": name, "strategy.name": "one_device"})
        with pytest.raises(UserError, match=message):
            train.train_and_evaluate(config, str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()
