"""The `small_mlp` case: an overhead-bound MLP under the default strategy, examples/s."""

from __future__ import annotations

import math
import os

from trainer.bench import contenders
from trainer.bench.harness import alternate, medians, paired, result
from trainer.bench.sizes import Sizes, default_strategy, parameters, small_config


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """towerflow, Keras `fit` and the bare loop; and what one loop costs beyond its steps."""
    config = small_config(sizes, default_strategy())
    strategy = contenders.plugin(config.strategy.name)
    runs = contenders.training(config, strategy, workdir, sizes.small_loops)
    # One step per loop: what a loop costs beyond its steps, measured where it is large.
    one_step = small_config(sizes, config.strategy.name, **{"train.steps_per_loop": 1})
    one_step_dir = os.path.join(workdir, "small_mlp-loop1")
    runs["towerflow_loop1"] = contenders.towerflow(
        one_step, strategy, one_step_dir, sizes.loop1_steps
    )
    failed: dict[str, str] = {}
    samples = alternate(runs, reps, failed)
    figures = medians(samples)
    ratios = contenders.training_ratios(samples)
    loop = config.train.steps_per_loop
    step_s = sizes.small_batch / figures["bare_loop"]
    overhead_s = paired(
        samples, lambda r: sizes.small_batch * (1 / r["towerflow_loop1"] - 1 / r["bare_loop"])
    )
    return result(
        "examples/s",
        figures,
        ratios,
        samples,
        failed=failed,
        parameters=parameters(config),
        strategy=config.strategy.name,
        steps_per_loop=loop,
        per_loop_overhead_ms=overhead_s * 1e3,
        # The shortest loop whose overhead is under 2%: how the default was chosen.
        steps_per_loop_for_2pct=max(1, math.ceil(overhead_s / (0.02 * step_s))),
    )
