"""`eval.progressive`: each batch of the followed stream scored as the model stands, then trained.

The mechanics (the step wrapper, the window of the last global batches' eval
sums) are `trainer.loop.progressive`'s; this component checks the fields,
makes the window in the strategy's scope, puts it in every checkpoint, wraps
the train step, and adds the window's metrics (`progressive_loss`,
`progressive_auc`, ..., `progressive_examples`) to each block's, so the
progress line, TensorBoard's `train` run and `results.json` carry them.
"""

from __future__ import annotations

import os

import tensorflow as tf

from towerflow.errors import UserError
from trainer.loop import actions, component, options, progressive, steps
from trainer.loop.controller import Output

CHECKPOINT_KEY = "progressive"  # the window's name in every checkpoint


@component.register("progressive")
class Progressive(component.Component):
    """Test-then-train over the stream of `data.follow`, windowed by `eval.window_examples`."""

    section = options.BUILTIN["progressive"]  # `eval.progressive`, `eval.window_examples`

    def check(self, config, traits) -> None:
        progressive.check(config)

    def build(self, context: component.Context) -> component.Feature | None:
        if not context.config.eval.get("progressive", False):
            return None
        return _Scored(context)


class _Scored(component.Feature):
    # Adds to the block's metrics, before the progress line and the summaries.
    slot = component.Slot.METRICS

    def __init__(self, context: component.Context):
        config = context.config
        batch = config.train.global_batch_size
        self._window_examples = config.eval.window_examples
        self._objective = context.objective
        self._eval_step = steps.make_eval_step(context.model, context.objective)
        # The eval split's batches: the training stream's, but made without starting it.
        batches = context.dataset.eval_fn(batch)(tf.distribute.InputContext()).element_spec
        spec = progressive.sums_spec(self._eval_step, batches)
        slots = progressive.slots_for(self._window_examples, batch)
        held = _held_window(context.model_dir)
        # A run resumed from checkpoints written without a window keeps none in them.
        self._kept = held is None or held[1] is not None
        if held and held[1] not in (None, slots):
            raise UserError(
                f"`eval.window_examples` ({self._window_examples}) makes a window of {slots} "
                f"global batches of {batch}, and checkpoint '{held[0]}' holds one of "
                f"{held[1]}; set `--config.eval.window_examples={held[1] * batch}` to go on "
                "with it, or use a new `--model_dir`."
            )
        with context.strategy.scope():
            self.window = progressive.Window(spec, slots)
        self._batch = batch

    def checkpoint(self) -> dict:
        # A resumed run goes on with its window.
        return {CHECKPOINT_KEY: self.window} if self._kept else {}

    def wrap_step(self, step, first_step: int):
        return progressive.wrap(step, self._eval_step, self.window)

    def lines(self) -> list[str]:
        slots, batch = self.window.slots, self._batch
        return [
            "progressive validation: each batch scored before it trains, over a window of "
            f"{slots * batch} examples ({slots} global batches of {batch}; "
            f"`eval.window_examples` {self._window_examples} rounded up to whole batches)"
        ] + (
            []
            if self._kept
            else [
                "note: the checkpoints of this `model_dir` were written without "
                "`eval.progressive`: the window starts empty at each start, kept in none of them"
            ]
        )

    def actions(self, run: component.Run) -> list[actions.Action]:
        def windowed(output: Output) -> None:
            output.metrics.update(self.window.metrics(self._objective.metrics))

        return [actions.every_block(windowed, "progressive validation")]


def _held_window(model_dir: str) -> tuple[str, int | None] | None:
    """The newest checkpoint in `model_dir` and the batches its window holds (None: none).

    None where there is no checkpoint, or it cannot be read (the restore then says why).
    """
    latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
    if latest is None:
        return None
    try:
        shapes = dict(tf.train.list_variables(latest))
    except (tf.errors.OpError, ValueError):
        return None
    held = shapes.get(f"{CHECKPOINT_KEY}/ring/.ATTRIBUTES/VARIABLE_VALUE")
    return latest, held[0] if held else None
