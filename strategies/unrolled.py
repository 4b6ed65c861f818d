"""How many steps each iteration of a loop of steps runs: a long run's small step unrolled.

A loop of steps is a TensorFlow `while` inside one `tf.function`, and an
iteration of a `while` starts only once every op of the one before has
finished (its outputs wait on all its stateful ops). On a small model a step
is a few milliseconds, and that wait (the next batch handed to the replicas,
the last variable updates) is several percent of it. With `k` steps traced one
after another in each iteration, TensorFlow orders their ops only where they
share a variable or the iterator: a step's input comes while the step before
finishes its updates (`small_mlp` under `mirrored`: towerflow / bare loop
0.94-0.97 with one step an iteration, 1.02-1.06 with four; 2026-11-30).

Each step more in an iteration is one more trace of the step at start-up
(about 0.3 s for each of `small_mlp`'s, 0.4 s for the default job's), which
pays only over many steps: so a loop unrolls where its train step asks for
it (`unroll`). The trainer asks for `train.steps_per_iteration`, or where that
is 0 (auto) for `STEPS` in a one-process run of `LONG_RUN` steps or more, if
the step has at most `MAX_OPS` ops (a step of more is slower to trace and long
enough that the wait weighs little). What the steps compute, and in which order, is the
same either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

STEPS = 4  # steps to an iteration where a long run's step is small
LONG_RUN = 50_000  # steps of a run that unrolls: the traces cost about 1.6 s (default job)
# The most ops a step (all of a process's replicas) may have and be unrolled unasked:
# `small_mlp` on 2 replicas has 325, the default job 515, the `cnn` on digits 756,
# the `resnet` 4,062.
MAX_OPS = 1000


@dataclasses.dataclass(frozen=True)
class Unroll:
    """What a train step asks of a loop: `steps` to an iteration; `if_small`: if of few ops."""

    steps: int = 1
    if_small: bool = False


def for_run(configured: int, total_steps: int, one_process: bool) -> Unroll:
    """What a run of `total_steps` asks for, given `train.steps_per_iteration` (0: auto).

    Auto asks only in a job of one process: in a cluster a small step's time
    is mostly its all-reduce or its round trips to the ps, which the next
    step cannot overlap (its forward needs the updated variables), while each
    member pays the traces.
    """
    if configured:
        return Unroll(configured)
    long_run = total_steps >= LONG_RUN and one_process
    return Unroll(STEPS, if_small=True) if long_run else Unroll()


def traced_ops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """`fn()`, traced inside a `tf.function`, and how many ops it added to the graph."""
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = fn()
    return result, len(graph.get_operations()) - before


def asked(step_fn: Callable) -> Unroll:
    """What `step_fn.unroll` asks (one step an iteration where it has none)."""
    return getattr(step_fn, "unroll", None) or Unroll()


def steps_per_iteration(step_fn: Callable, ops: int) -> int:
    """Steps to an iteration for `step_fn`, whose one step traced to `ops` ops.

    What `step_fn.unroll` asks (one step where it has none), but one step
    where it asks only for a step of few ops and this one has more than `MAX_OPS`.
    """
    unroll = asked(step_fn)
    return 1 if unroll.if_small and ops > MAX_OPS else unroll.steps
