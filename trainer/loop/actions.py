"""The loop's built-in actions, and the user's own from `train.actions`.

Each function here returns a `controller.Action`: a plain callable on a
block's `Output` with its schedule, and the hooks it needs (`loop()` around
the whole loop for the preemption watch, the watchdog and the profiler;
`block(step)` around each block for the last two). `trainer.loop.schedule` puts them in
order: blow-up recovery first (it may roll the step back and skip the rest), then
rates, summaries, the progress line, checkpoints, preemption, evaluation,
and the user's actions last, so they see the eval metrics of their block; a
feature's actions (`trainer.loop.component`) go in its slot among them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator

import ml_collections
import tensorflow as tf

from strategies.cluster.preemption import Preempted
from towerflow import calls
from towerflow.errors import PREEMPTED_EXIT_CODE, UserError
from towerflow.registry import resolve
from trainer.data.follow import Follower
from trainer.loop import faults
from trainer.loop.controller import Action, Output, SkipBlock, StopTraining

__all__ = ["Action", "Output", "SkipBlock", "StopTraining"]


def recovery(blew_up: Callable[[float], bool], recover: Callable[[int, float], None]) -> Action:
    """After a block whose loss blew up: `recover(step, loss)` restores, the block is dropped."""

    def act(output: Output) -> None:
        loss = output.metrics.get("loss", 0.0)
        if blew_up(loss):
            recover(output.step, loss)
            raise SkipBlock

    return Action(act, name="recovery")


# The examples a block trained, where an earlier action knows them to be fewer than its steps'
# global batches (`follow`: a short or padded step); `rates` takes it out of the metrics.
EXAMPLES_TRAINED = "examples_trained"


def rates(examples_per_step: int, learning_rate: Callable[[], float]) -> Action:
    """Adds `learning_rate`, `steps_per_sec` and `examples_per_sec` to the block's metrics."""

    def act(output: Output) -> None:
        output.metrics["learning_rate"] = learning_rate()
        output.metrics["steps_per_sec"] = output.steps / output.seconds
        examples = output.metrics.pop(EXAMPLES_TRAINED, output.steps * examples_per_step)
        output.metrics["examples_per_sec"] = examples / output.seconds

    return Action(act, name="rates")


def every_block(fn: Callable[[Output], object], name: str) -> Action:
    """`fn` after every block (summaries, the progress line)."""
    return Action(fn, name=name)


TableFigures = dict[str, list[dict[str, int]]]  # per dynamic table, per part: counters, sizes


def tables(read: Callable[[], TableFigures]) -> Action:
    """Adds each dynamic table's figures in the block to its metrics (`block_table_metrics`).

    `read()` gives every table's counters and sizes now (`layers.table_figures`);
    the counters count from the table's start, so the reading before each
    block is kept, and read again when a block does not start where the last
    one ended (a recovery rolled the step back, and the tables with it).
    """
    before: dict = {}

    @contextlib.contextmanager
    def block(step: int) -> Iterator[None]:
        if before.get("step") != step:
            before.update(step=step, figures=read())
        yield

    def act(output: Output) -> None:
        now = read()
        output.metrics.update(block_table_metrics(before["figures"], now))
        before.update(step=output.step, figures=now)

    return Action(act, name="tables", block=block)


def block_table_metrics(before: TableFigures, now: TableFigures) -> dict[str, float]:
    """Each table's figures in a block, from the readings `before` and `now` it.

    `tables/<layer>/<figure>` for each table, `tables/<layer>/part_<i>/<figure>`
    for each part of a table split over ps members, and `ids_held` over all
    tables (the progress line's `ids`). Figures: `ids_held` and `bytes_held`
    now; `admitted` and `evicted` in the block, and `default_row_share`, the
    share of the block's training lookups that read the default row.
    """
    metrics = {}
    for layer, parts in now.items():
        in_block = [_in_block(*pair) for pair in zip(before[layer], parts, strict=True)]
        whole = {name: sum(part[name] for part in in_block) for name in in_block[0]}
        named = [(f"tables/{layer}", whole)]
        if len(parts) > 1:
            named += [(f"tables/{layer}/part_{i}", part) for i, part in enumerate(in_block)]
        for prefix, figures in named:
            for name in ("ids_held", "admitted", "evicted", "bytes_held"):
                metrics[f"{prefix}/{name}"] = float(figures[name])
            lookups = figures["lookups"]
            metrics[f"{prefix}/default_row_share"] = (
                figures["defaults"] / lookups if lookups else 0.0
            )
    metrics["ids_held"] = float(sum(part["ids_held"] for parts in now.values() for part in parts))
    return metrics


def _in_block(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """One part's sizes `now`, and its counters' growth since `before`."""
    grown = {
        name: now[name] - before[name] for name in ("admitted", "evicted", "lookups", "defaults")
    }
    return {"ids_held": now["ids_held"], "bytes_held": now["bytes_held"], **grown}


def checkpoint(save: Callable[[int], None], every: int) -> Action:
    """`save(step)` every `every` steps and at the end."""
    return Action(lambda output: save(output.step), every=every, at_end=True, name="checkpoint")


def exports(
    write: Callable[[int], None],
    every_steps: int,
    every_secs: float,
    agree: Callable[[int], int] = lambda due: due,
) -> list[Action]:
    """`write(step)` every `every_steps` steps and/or after the first block `every_secs` on.

    The seconds count from the loop's start and from each export, on the
    chief's clock: `agree` (`Membership.agree`) hands every member of a cluster
    the chief's decision, since some strategies export collectively. With both
    set, blocks still end at each multiple of `every_steps` and the clock is
    checked after every block. Empty when both are 0 (the run's own
    end-of-training export is not an action: `train.export`).
    """
    if not every_steps and not every_secs:
        return []
    if not every_secs:
        return [Action(lambda output: write(output.step), every=every_steps, name="export")]
    last = {"time": time.monotonic()}

    def act(output: Output) -> None:
        on_step = every_steps and output.step % every_steps == 0
        if on_step or agree(int(time.monotonic() - last["time"] >= every_secs)):
            write(output.step)
            last["time"] = time.monotonic()

    timed = Action(act, name="export")
    # Blocks end at the step multiples too (an action of no `fn` only shapes them).
    return [timed, Action(None, every=every_steps, name="export steps")] if every_steps else [timed]


def evaluation(evaluate: Callable[[], dict], every: int) -> Action:
    """Evaluates every `every` steps before the end (the run evaluates once more at the end)."""

    def act(output: Output) -> None:
        if not output.is_last:
            output.eval_metrics = evaluate()

    return Action(act, every=every, name="evaluation")


def user_actions(names: tuple[str, ...] | str, config: ml_collections.ConfigDict) -> list[Action]:
    """The actions named in `train.actions`: "module.path:function" each.

    The function is called with the config and returns the action: a callable
    on `Output` (run after every block) or an `Action` with its own schedule.
    Both get their parameter by name (`config`, `output`) or in order (`towerflow.calls`).

    Raises:
      UserError: a name that does not import or is not a function, or a function
        that cannot be called with the config (or its action with the output).
    """
    if isinstance(names, str):
        names = tuple(n.strip() for n in names.split(",") if n.strip())
    made = []
    for name in names:
        origin = f"`train.actions` '{name}'"
        factory = resolve("train.actions", name, "a function of the config")
        made.append(_as_action(calls.adapt(factory, MAKE_ACTION, origin)(config), name))
    return made


MAKE_ACTION = calls.Signature("make_action", ("config",), "a callable on the loop's output")
ACTION = calls.Signature("action", ("output",))


def _as_action(made: object, name: str) -> Action:
    origin = f"`train.actions` '{name}'"
    if isinstance(made, Action):
        if inspect.isroutine(made.fn):  # not an object the loop also enters
            made = dataclasses.replace(made, fn=calls.adapt(made.fn, ACTION, origin))
        return made
    if not callable(made):
        raise UserError(
            f"{origin} returned {type(made).__name__}; it must return a "
            "callable on the loop's output, or a `trainer.loop.actions.Action`."
        )
    if inspect.isroutine(made):
        made = calls.adapt(made, ACTION, f"the action {origin} returned")
    return Action(made, name=name)


def preemption(watch, save: Callable[[int], None], say: Callable[[str], None]) -> Action:
    """Watches for SIGTERM around the loop; after each block, saves and stops if it came.

    `watch` is the membership's (`Membership.watch_preemption()`), a context
    manager with `check(save)`: on one process the signal itself, on a
    `multi_worker` cluster one step agreed by all.
    """
    return Action(
        lambda output: stop_if_preempted(watch, save, say, output.step),
        name="preemption",
        loop=lambda: watch,
    )


def stop_if_preempted(watch, save: Callable[[int], None], say: Callable[[str], None], step: int):
    """If SIGTERM came (`watch.check`): `save(step)`, say so and raise `Preempted`."""
    try:
        watch.check(lambda: save(step))
    except Preempted as e:
        say(
            f"preempted ({e}) at step {step}: checkpoint saved; exiting with "
            f"{PREEMPTED_EXIT_CODE} so the scheduler restarts the job"
        )
        raise


def follow(
    follower: Follower,
    examples_per_step: int,
    block_steps: int,
    while_waiting: Callable[[], None],
    everyone: Callable[[bool], bool] = bool,
    agree: Callable[[int], int] = lambda value: value,
    say: Callable[[str], None] | None = None,
) -> list[Action]:
    """Training on files as they arrive (`data.follow`): fresh blocks, the position, the backlog.

    Each block runs on the whole global batches waiting, up to the next multiple
    of `block_steps`: a short block where fewer wait, a one-step block that
    waits where none does (a remainder short of a global batch trains padded
    once it has waited `data.follow_max_wait_secs`; see `trainer.data.follow`).
    The first block is one step; each later block's end is planned after the
    block before, and it starts once the stream holds its examples on every
    worker that steps with this one (`everyone`, `agree`: the membership's; `while_waiting()` runs
    between looks: the preemption check). After every block the position moves
    on by the examples trained (written to the variables the checkpoint saves:
    so this action runs first, before a recovery rolls the step back and before
    the checkpoint); the records it trained (padding and short steps count what
    they hold) make `examples_per_sec`; and the backlog joins the metrics: `backlog_files`,
    `backlog_records` and `behind_s`. `say` gets the follower's lines (late,
    refused and removed files): the chief's progress.
    """
    # The step is not known before the first block: it is one step long, the rest planned.
    blocks = Action(None, every=1, name="follow blocks")

    def plan(step: int) -> None:  # the next block's end: the whole batches there, at least 1
        most = block_steps - step % block_steps
        ready = follower.steps_ready(most, examples_per_step, agree, everyone)
        blocks.every, blocks.at_steps = block_steps, (step + max(1, ready),)

    def act(output: Output) -> None:
        output.metrics[EXAMPLES_TRAINED] = follower.advance(output.steps * examples_per_step)
        follower.look_if_due()
        figures = follower.figures()
        output.metrics["backlog_files"] = figures["files_waiting"]
        output.metrics["backlog_records"] = figures["records_waiting"]
        output.metrics["behind_s"] = figures["seconds_behind"]
        plan(output.step)

    @contextlib.contextmanager
    def block(step: int) -> Iterator[None]:
        # The planned end; after a recovery rolled the step back, the schedule's bound.
        ends = [end for end in blocks.at_steps if end > step]
        steps = ends[0] - step if ends else blocks.every - step % blocks.every
        follower.wait(steps * examples_per_step, examples_per_step, while_waiting, everyone, agree)
        yield

    @contextlib.contextmanager
    def loop() -> Iterator[None]:
        if say is not None:
            follower.say = say
        try:
            yield
        finally:
            follower.close()  # the stream stops waiting for files

    blocks.block = block
    return [Action(act, name="follow", loop=loop), blocks]


class Profile:
    """A TensorBoard profile of steps `start` to `stop` (`train.profile_steps`), on the chief.

    TensorFlow's profiler runs from the block that starts at `start` to the end
    of the block that reaches `stop`: the controller ends blocks at both (see
    `profile`), so the trace holds those steps and the loop's work between
    them. It lands in `logdir/plugins/profile/<time>/<host>.xplane.pb`, where
    TensorBoard's Profile tab finds it (`pip install "towerflow[profile]"`).
    Every member of a cluster has the action, so all end their blocks at the same
    steps (workers that step together must); only an `enabled` one profiles.
    """

    def __init__(
        self,
        start: int,
        stop: int,
        logdir: str,
        current_step: Callable[[], int],
        say: Callable[[str], None],
        enabled: bool = True,
    ):
        self.start, self.stop, self.logdir = start, stop, logdir
        self._current_step = current_step
        self._say = say
        self._running = False
        # One profile a run (even if a recovery rolls the step back); none where disabled.
        self._done = not enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._finish()  # training ended inside the window (or failed)

    @contextlib.contextmanager
    def block(self, step: int) -> Iterator[None]:
        """Starts the profiler before the block at `start`; stops it after the one at `stop`."""
        if not (self._running or self._done) and self.start <= step < self.stop:
            tf.profiler.experimental.start(self.logdir)
            self._running, self._first = True, step
        yield
        if self._running and self._current_step() >= self.stop:
            self._finish()

    def _finish(self) -> None:
        if not self._running:
            return
        tf.profiler.experimental.stop()
        self._running, self._done = False, True
        self._say(
            f"profile of steps {self._first} to {self._current_step()} written to "
            f"{self.logdir}/plugins/profile (TensorBoard's Profile tab)"
        )


def profile(
    steps: tuple[int, int],
    logdir: str,
    current_step: Callable[[], int],
    say: Callable[[str], None],
    enabled: bool = True,
) -> Action:
    """The `Profile` of `steps` (start, stop); blocks end at both, profiled where `enabled`."""
    start, stop = steps
    profiler = Profile(start, stop, logdir, current_step, say, enabled)
    return Action(
        None,  # nothing between blocks: it starts and stops around them
        every=0,
        at_steps=(start, stop),
        name="profile",
        loop=lambda: profiler,
        block=profiler.block,
    )


def watchdog(dog: faults.Watchdog) -> Action:
    """Says which members of the cluster do not answer while a block runs long.

    Nothing to do between blocks: the watchdog runs around the loop and marks
    each block.
    """
    return Action(None, name="watchdog", loop=lambda: dog, block=dog.loop)
