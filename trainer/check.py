"""`python -m trainer.check`: does your own job train the same under each strategy?

    python -m trainer.check --strategies=one_device,mirrored,multi_worker \\
        [--steps=20] [--tolerance=1e-4] -- <your usual trainer flags>

The flags after `--` are those you give `python -m trainer` (`--config`,
`--config.*` overrides: a built-in model, your own builder, a compiled model,
a task); `--strategy`, `--cluster` and `--model_dir` among them are ignored.
Each strategy named trains that job in this process for `--steps` steps from
the same seed, with deterministic ops and pipeline (`train.deterministic`),
in one block, then evaluates once; nothing is written outside a temporary
directory. Then, per strategy against the first: the largest weight
difference (and its variable), the train loss difference, the largest eval
metric difference, and a verdict. A difference beyond `--tolerance`
(relative to the value, or absolute below 1) is explained where a likely
cause is found:

* Keras's own `Dropout` (and its subclasses) in the model: it draws the same
  mask on every replica (`trainer.layers.Dropout` does not);
* BatchNorm moving statistics that differ: kept per replica;
* the first strategy disagreeing with a second run of itself: a
  nondeterministic pipeline or op (e.g. a `dataset_fn` that shuffles unseeded);
* weights and loss that agree while an eval metric differs: that metric is not
  additive over replicas (a mean of per-replica means, a ratio).

Exit status: 0 when every strategy agrees with the first, 1 when one differs
(for your CI), 2 for bad input (one line). Strategies run in one process: a
`multi_worker` run is one local worker; `parameter_server` needs a cluster
and is refused.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags  # noqa: E402

from trainer import cli  # noqa: E402

cli.own_packages_first()  # before anything imports `strategies`

from towerflow import renamed  # noqa: E402

_STRATEGIES = flags.DEFINE_list(
    "strategies",
    ["one_device", "mirrored", "multi_worker"],
    "The strategies to compare, the first the reference.",
)
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps under each strategy.")
_TOLERANCE = flags.DEFINE_float(
    "tolerance",
    1e-4,
    "The largest difference that agrees: relative to the value, absolute below 1.",
)
_IGNORED = ("--strategy", "--cluster", "--model_dir", "--mode")
_IN_ONE_PROCESS_NOT = ("parameter_server",)


@dataclasses.dataclass
class StrategyRun:
    """What one strategy's run ended with."""

    strategy: str
    replicas: int
    names: list[str]  # the model's weights, by path, in order
    weights: list  # numpy arrays, in the same order
    loss: float
    eval: dict[str, float]
    dropout_layers: list[str]  # Keras's own `Dropout` layers of the model
    batchnorm_layers: list[str]


@dataclasses.dataclass
class Comparison:
    """One strategy's run against the reference's."""

    run: StrategyRun
    weight_diff: float
    weight_name: str
    loss_diff: float
    metric_diff: float
    metric_name: str
    causes: list[str] = dataclasses.field(default_factory=list)

    def agrees(self, tolerance: float) -> bool:
        return max(self.weight_diff, self.loss_diff, self.metric_diff) <= tolerance


def main(argv: list[str]) -> None:
    """Parses the trainer's flags, trains under each strategy, prints, exits 0, 1 or 2."""
    from absl import logging

    from towerflow.errors import UserError, one_line

    logging.set_verbosity(logging.WARNING)  # the runs' progress lines, not TensorFlow's INFO
    try:
        config = trainer_config(argv[1:])
        names = check_strategies(_STRATEGIES.value)
        if _STEPS.value < 1:
            raise UserError(f"`--steps` ({_STEPS.value}) must be at least 1; e.g. 20.")
        if not _TOLERANCE.value > 0:
            raise UserError(f"`--tolerance` ({_TOLERANCE.value}) must be > 0; e.g. 1e-4.")
        with tempfile.TemporaryDirectory(prefix="towerflow-check-") as scratch:
            code = check(config, names, _STEPS.value, _TOLERANCE.value, scratch)
    except UserError as e:
        cli.fail(one_line(e))
    sys.exit(code)


def trainer_config(args: Sequence[str]):
    """The config the trainer flags `args` describe (parsed as `python -m trainer` does)."""
    kept = [a for a in args if a.split("=", 1)[0] not in _IGNORED]
    argv = ["towerflow", *kept]
    defined = cli.define_flags(flags.FlagValues(), argv)
    cli.parse_flags(defined, argv)
    return defined.config.value


def check_strategies(names: Sequence[str]) -> list[str]:
    """The `--strategies` list, checked: at least two, known, each runnable in one process."""
    import strategies
    from towerflow.errors import UserError

    names = [name.strip() for name in names if name.strip()]
    if len(names) < 2:
        raise UserError(
            f"`--strategies` ({','.join(names) or 'empty'}) needs at least two strategies to "
            "compare, the first the reference; e.g. `--strategies=one_device,mirrored`."
        )
    known = strategies.available()
    for name in names:
        if name not in known:
            raise UserError(
                f"`--strategies` names `{name}`, which is not a strategy; use some of "
                f"{', '.join(f'`{k}`' for k in known)}."
            )
        if name in _IN_ONE_PROCESS_NOT:
            raise UserError(
                f"`--strategies` names `{name}`, which needs a cluster; the check runs in one "
                "process: compare one_device, mirrored, central_storage, multi_worker, default."
            )
    return names


def check(config, names: Sequence[str], steps: int, tolerance: float, scratch: str) -> int:
    """Trains under each strategy, prints the comparison; returns the exit status (0 or 1)."""
    runs = [train_once(config, name, steps, os.path.join(scratch, name)) for name in names]
    reference = runs[0]
    comparisons = [compare(reference, run) for run in runs[1:]]
    if any(not c.agrees(tolerance) for c in comparisons):
        again = train_once(config, names[0], steps, os.path.join(scratch, "again"))
        self_check = compare(reference, again)
        for comparison in comparisons:
            if not comparison.agrees(tolerance):
                comparison.causes = likely_causes(comparison, self_check, tolerance)
    print(table(reference, comparisons, tolerance), flush=True)
    return 0 if all(c.agrees(tolerance) for c in comparisons) else 1


def train_once(config, strategy: str, steps: int, model_dir: str) -> StrategyRun:
    """The job of `config` trained for `steps` steps under `strategy`, then evaluated once."""
    import keras
    import numpy as np

    from strategies import tf_patches
    from trainer.loop import train

    config = config.copy_and_resolve_references()
    config.strategy.name = strategy
    config.train.steps = steps
    config.train.steps_per_loop = steps  # one block: its loss is the mean over every step
    config.train.checkpoint_every = steps
    config.train.export = False
    config.train.deterministic = True
    config.eval.every = 0
    cli.set_cluster_source(config, "local")  # the check is one process, whatever TF_CONFIG says
    train.say(f"check: training under {strategy} for {steps} steps")
    job = train.build(config, model_dir)
    results = train.run(job, "train_and_eval")
    layers = tf_patches.flat_layers(job.model)
    return StrategyRun(
        strategy=strategy,
        replicas=job.strategy.num_replicas_in_sync,
        names=[w.path for w in job.model.weights],
        weights=[np.array(w.numpy()) for w in job.model.weights],
        loss=float(results["train"].get("loss", float("nan"))),
        eval={k: float(v) for k, v in results["eval"].items() if k != "examples"},
        dropout_layers=[x.name for x in layers if isinstance(x, keras.layers.Dropout)],
        batchnorm_layers=[x.name for x in layers if isinstance(x, keras.layers.BatchNormalization)],
    )


def compare(reference: StrategyRun, run: StrategyRun) -> Comparison:
    """`run` against `reference`: the largest differences, each relative above 1."""
    import numpy as np

    weight_diff, weight_name = 0.0, ""
    for name, got, want in zip(reference.names, run.weights, reference.weights, strict=True):
        diff = np.abs(got - want) / np.maximum(1.0, np.abs(want))
        diff = float(np.max(np.nan_to_num(diff, nan=np.inf), initial=0.0))  # NaN: the largest
        if diff > weight_diff:
            weight_diff, weight_name = diff, name
    metric_diff, metric_name = 0.0, ""
    for name, want in reference.eval.items():
        diff = _relative(run.eval.get(name, float("nan")), want)
        if diff > metric_diff:
            metric_diff, metric_name = diff, f"eval {name}"
    return Comparison(
        run, weight_diff, weight_name, _relative(run.loss, reference.loss), metric_diff, metric_name
    )


def likely_causes(comparison: Comparison, self_check: Comparison, tolerance: float) -> list[str]:
    """What can explain a difference, as far as the runs and the model show."""
    run, causes = comparison.run, []
    if not self_check.agrees(tolerance):
        causes.append(
            f"the reference ({self_check.run.strategy}) does not agree with a second run of "
            f"itself (largest weight difference {self_check.weight_diff:.2g}): a "
            "nondeterministic pipeline or op; seed every shuffle and random op in your "
            "`dataset_fn` and model"
        )
    if run.dropout_layers and run.replicas > 1:
        causes.append(
            f"Keras's own `Dropout` ({', '.join(run.dropout_layers)}) draws the same mask on "
            f"each of the {run.replicas} replicas; use `trainer.layers.Dropout`, whose masks "
            "do not depend on the replicas"
        )
    if run.batchnorm_layers and "moving_" in comparison.weight_name:
        causes.append(
            f"BatchNorm statistics ({comparison.weight_name}) are kept per replica, each from "
            "its own part of the batch"
        )
    weights_agree = max(comparison.weight_diff, comparison.loss_diff) <= tolerance
    if weights_agree and comparison.metric_diff > tolerance:
        causes.append(
            f"the weights agree but {comparison.metric_name} does not: that metric is not "
            "additive over replicas (e.g. a mean of per-replica means); compute it from sums"
        )
    if not causes:
        causes.append(
            f"no likely cause found; the largest weight difference is in {comparison.weight_name}"
        )
    return causes


def table(reference: StrategyRun, comparisons: Sequence[Comparison], tolerance: float) -> str:
    """The comparison as aligned rows, the reference first, then each cause on a line."""
    rows = [("strategy", "replicas", "max weight diff", "train loss diff", "max eval diff", "")]
    rows.append((reference.strategy, str(reference.replicas), "-", "-", "-", "reference"))
    for c in comparisons:
        verdict = "agrees" if c.agrees(tolerance) else "DIFFERS"
        weight = f"{c.weight_diff:.2g} ({c.weight_name})" if c.weight_name else "0"
        metric = f"{c.metric_diff:.2g} ({c.metric_name})" if c.metric_name else "0"
        rows.append(
            (c.run.strategy, str(c.run.replicas), weight, f"{c.loss_diff:.2g}", metric, verdict)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for c in comparisons:
        lines += [f"{c.run.strategy}: likely cause: {cause}" for cause in c.causes]
    agree = all(c.agrees(tolerance) for c in comparisons)
    lines.append(
        f"check: every strategy agrees with {reference.strategy} (tolerance {tolerance:g})"
        if agree
        else f"check: a strategy differs from {reference.strategy} (tolerance {tolerance:g})"
    )
    return "\n".join(lines)


def _relative(got: float, want: float) -> float:
    diff = abs(got - want) / max(1.0, abs(want))
    return diff if diff == diff else float("inf")  # NaN: as far apart as can be


__getattr__ = renamed.old_names(__name__, {"Run": "StrategyRun"}, globals())

if __name__ == "__main__":
    app.run(cli.guarded(main), argv=sys.argv, flags_parser=cli.parse_own_flags)
