"""Features of the loop as components: the interface, and the one registry they sit in.

A *component* is one feature of the training loop (following files, elastic
groups, warm start, versioned exports, dynamic tables' figures, profiling,
the input wait, ...). The loop names none of them: it asks every registered
component, in registration order, at four points of a run, and a feature
never needs a line in a loop file.

1. Its config section (`Component.section`, a typed dataclass declared once:
   `towerflow.sections.Section`) is read at start-up: each field's type and the
   declaration's rules, before anything is built or written
   (`trainer.loop.checks.check_config`); then `Component.check(config, traits)`,
   for rules that need another section or the strategy plugin's `traits`.
2. `Component.adapt(config, strategy, say)`: the config the run trains with,
   once the strategy is known (an elastic group trains its own batches).
3. `Component.build(context)`: this run's `Feature`, or None where the config
   leaves it off. It may check more (files, the model) and must write nothing.
4. The run then asks each `Feature` what it adds: checkpoint entries, actions
   (made once the run's checkpointer exists, `Run`), hooks around the train
   step and the input (or an input of its own), start-up lines, results, and
   what it does on close.

A component registers with `@component.register("name")` on its class; a
name taken twice is an error. The built-in ones live in
`trainer.loop.features`, which the registry imports when it is first read;
their sections are declared in `trainer.loop.options` (TensorFlow-free, so
`configs/default.py` builds their fields from them). A user's own registers
the same way from any module imported before the run, with its section
declared beside it (docs/components.md).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import ml_collections
import tensorflow as tf

import strategies
from strategies.units import UnitStream
from towerflow.registry import Registry
from towerflow.sections import Section
from trainer.loop.controller import Action

BUILT_IN = "trainer.loop.features"  # the package whose modules register the built-in ones

REGISTRY = Registry("Component", lambda value: f"module `{value.__module__}`")


class Slot(enum.IntEnum):
    """Where a feature's actions run among the loop's own, after each block.

    FIRST: before blow-up recovery, which may roll the step back (a position in
      the input moves on with every block trained).
    METRICS: after the rates, before the progress line and summaries: adds to
      the block's metrics.
    SAVED: after the checkpoint: sees the state just saved (an export of it).
    LAST: after preemption and the watchdog, before evaluation and the user's.
    """

    FIRST = 0
    METRICS = 1
    SAVED = 2
    LAST = 3


@dataclasses.dataclass(frozen=True)
class Context:
    """What the loop built, read-only, for a component's `build`.

    Attributes:
      config: the config the run trains with (after every `Component.adapt`).
      model_dir: where the run writes.
      strategy: the strategy plugin (its `membership`, `traits`, replicas).
      dataset: the data (`trainer.data.Dataset`), before a tf.data service wraps it.
      model: the model, built under the strategy's scope.
      optimizer: its optimizer; `optimizer.iterations` is the step.
      total_steps: where training ends.
      say: prints a line of progress.
      objective: the loss and metrics (`trainer.loop.objectives`, or a compiled
        model's `CompiledObjective`): its eval sums and `metrics(sums)`.
    """

    config: ml_collections.ConfigDict
    model_dir: str
    strategy: strategies.Strategy
    dataset: Any
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    total_steps: int
    say: Callable[[str], None]
    objective: Any = None

    def step(self) -> int:
        """The step the model is at now."""
        return int(self.optimizer.iterations.numpy())


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run adds to the `Context` once it writes, for a feature's actions.

    Attributes:
      checkpointer: the run's `trainer.loop.checkpoints.Checkpointer` (`save(step)`).
      summaries: its TensorBoard writer (`trainer.loop.summaries.Summaries`).
      watch: the membership's preemption watch (`check(save)` stops after SIGTERM).
      read: the value of a feature's `reads()` variable, as read with the step
        after the block (one call into TensorFlow for all of them).
      export: exports the model now, as the run's own end-of-training export does.
    """

    checkpointer: Any
    summaries: Any
    watch: Any
    read: Callable[[str], float]
    export: Callable[[], None]


class Feature:
    """One run's part of a component: what it adds to the loop.

    Every member has a default that adds nothing, so a feature overrides
    only what it needs. `slot` says where its actions run (`Slot`).
    """

    slot: Slot = Slot.METRICS
    # A lost member is a membership change this feature handles (`lost_member`): the
    # watchdog then ends the step that waits for it, not the process.
    handles_lost_members: bool = False

    def checkpoint(self) -> dict[str, tf.Module]:
        """Objects every checkpoint holds beside the model's, by name (restored with it)."""
        return {}

    def starts_at(self, step: int) -> int | None:
        """Training (re)starts at `step` (at first, and after a blow-up's restore).

        Returns the input stream's first batch where the feature places it
        (None: the stream starts at the step's own batch).
        """
        return None

    def newer_state(self, latest: str | None) -> str | None:
        """A saved state newer than the newest checkpoint `latest`, to resume from; else None."""
        return None

    def start(self, restored: str | None) -> None:
        """After the run restored its newest state (`restored`, its path) or found none."""

    def lines(self) -> list[str]:
        """Start-up lines, after the model and the data (said by the chief)."""
        return []

    def record(self) -> None:
        """The chief writes what it keeps beside `config.json` at start-up."""

    def wrap_step(self, step: Callable, first_step: int) -> Callable:
        """The train step the strategy runs (`steps.TrainStep`), maybe wrapped."""
        return step

    def input(self) -> UnitStream | None:
        """The input the steps read instead of the data's stream (None: the stream).

        A plugin with `Traits.takes_units` takes a `strategies.units.UnitStream`
        (followed files handed out in units to whichever worker is free).
        """
        return None

    def wrap_input(self, iterator: Iterator) -> Iterator:
        """The distributed training iterator the steps read, maybe wrapped."""
        return iterator

    def reads(self) -> dict[str, tf.Variable]:
        """Variables read with the step after each block (`Run.read(name)` gives them)."""
        return {}

    def actions(self, run: Run) -> list[Action]:
        """The feature's actions, in the order they run within its `slot`."""
        return []

    def write_export(self, path: str, write: Callable[[str], None]) -> bool:
        """Writes the chief's export at `path` its own way (`write(path)`); False: as usual."""
        return False

    def lost_member(self, run: Run, lost: list[str], error: Exception) -> BaseException | None:
        """The error to end with when `lost` members stop answering (None: the usual one)."""
        return None

    def results(self) -> dict:
        """What it adds to `results.json`, by key."""
        return {}

    def close(self) -> None:
        """The run ends, however it ends."""


class Component(abc.ABC):
    """A feature of the loop: its config checked at start-up, built into a `Feature` per run.

    Attributes:
      name: the name it is registered under (set by `register`).
      section: its config, declared once (`Section(path, OptionsDataclass)`): each
        field's type, default and meaning, and the rules of the dataclass's
        `__post_init__`. The config's fields come from it, and the start-up check
        reads it (`read`). None: no section of its own.
      fields: the config fields it reads, dotted (e.g. "export.every_steps"): its
        section's (set by `register`), or, without one, as the component lists them.
    """

    name: str = "?"
    section: Section | None = None
    fields: tuple[str, ...] = ()

    def read(self, config: ml_collections.ConfigDict) -> Any:
        """Its section of `config` as the declared dataclass, types and rules checked.

        Returns:
          The options (fields a config lacks at their defaults), or None without a section.

        Raises:
          UserError: a value of another type or refused by the rules, naming the field.
        """
        return self.section.read(config) if self.section else None

    def check(self, config: ml_collections.ConfigDict, traits: strategies.Traits) -> None:
        """Rules across sections, once its own section is read; `traits`: the strategy plugin's.

        Raises:
          UserError: a bad value, naming the field, the value, the rule and the fix.
        """
        return None  # the section's own types and rules are checked by its declaration

    def adapt(
        self,
        config: ml_collections.ConfigDict,
        strategy: strategies.Strategy,
        say: Callable[[str], None],
    ) -> ml_collections.ConfigDict:
        """The config this run trains with (a copy where it changes): `config` by default."""
        return config

    @abc.abstractmethod
    def build(self, context: Context) -> Feature | None:
        """This run's `Feature`, or None where the config leaves it off; writes nothing."""


def register(name: str) -> Callable[[type[Component]], type[Component]]:
    """Class decorator: registers a `Component` subclass under `name` (refused if taken).

    Raises:
      ValueError: `name` is registered already.
      TypeError: the class is not a `Component`.
    """

    def decorator(cls: type[Component]) -> type[Component]:
        if not (isinstance(cls, type) and issubclass(cls, Component)):
            raise TypeError(f"component `{name}` must subclass `trainer.loop.component.Component`")
        if cls.section is not None and not isinstance(cls.section, Section):
            raise TypeError(f"component `{name}`: `section` must be a `component.Section`")
        cls.name = name
        cls.fields = cls.section.fields if cls.section else tuple(cls.fields)
        return REGISTRY.register(name)(cls)

    return decorator


def registered() -> list[Component]:
    """One of each registered component, in registration order (the built-in ones first)."""
    importlib.import_module(BUILT_IN)  # registers the built-in ones, once
    return [cls() for cls in REGISTRY.values()]


def check(config: ml_collections.ConfigDict, traits: strategies.Traits) -> None:
    """Every component's section (types and rules), then its `check`, under `traits`.

    Raises:
      UserError: the first bad value, in one line naming the field.
    """
    for component in registered():
        component.read(config)
        component.check(config, traits)
