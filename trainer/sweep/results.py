"""A sweep's results: one row per trial, ranked by a metric; printed, `sweep.json`, `sweep.csv`.

Each finished trial's numbers come from the `results.json` its trainer wrote
(never from its printed lines); a failed one carries its one-line error.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from collections.abc import Sequence

from towerflow import storage
from towerflow.errors import UserError

FINISHED, FAILED, INTERRUPTED, NOT_RUN = "finished", "failed", "interrupted", "not run"
MODES = ("auto", "max", "min")


@dataclasses.dataclass
class Row:
    """One trial's outcome.

    Attributes:
      trial: the trial's name (its directory under the sweep's).
      overrides: `{field: value as typed}`.
      status: finished, failed, interrupted or not run.
      step: the step its `results.json` reports (0 without one).
      train, eval: its final metrics, from `results.json`.
      wall_time_s: how long its process ran in this sweep (its `results.json`'s
        time when an earlier run of the sweep finished it).
      error: the one-line error of a failed trial.
      model_dir: where it ran.
    """

    trial: str
    overrides: dict[str, str]
    status: str = NOT_RUN
    step: int = 0
    train: dict[str, float] = dataclasses.field(default_factory=dict)
    eval: dict[str, float] = dataclasses.field(default_factory=dict)
    wall_time_s: float = 0.0
    error: str = ""
    model_dir: str = ""

    def metric(self, name: str) -> float | None:
        """`eval/accuracy` -> `self.eval["accuracy"]`; None when the trial has no such value."""
        split, _, key = name.partition("/")
        value = getattr(self, split, {}).get(key) if split in ("train", "eval") else None
        return None if value is None or math.isnan(value) else float(value)


def read_results(model_dir: str) -> dict | None:
    """The trial's `results.json`, or None if it has none (yet)."""
    return storage.read_json(os.path.join(model_dir, "results.json"))


def check_metric(metric: str, mode: str) -> str:
    """Checks `--metric` and `--mode`; returns the mode, auto resolved (min for losses).

    Raises:
      UserError: a metric not named `train/<name>` or `eval/<name>`, or an unknown mode.
    """
    split, _, key = metric.partition("/")
    if split not in ("train", "eval") or not key:
        raise UserError(
            f"`--metric` '{metric}' must be `train/<name>` or `eval/<name>`, "
            "e.g. `eval/accuracy` or `eval/loss`."
        )
    if mode not in MODES:
        raise UserError(f"`--mode` '{mode}' is not one of: {', '.join(MODES)}.")
    if mode == "auto":
        return "min" if key.endswith(("loss", "error")) else "max"
    return mode


def ranked(rows: Sequence[Row], metric: str, mode: str) -> list[Row]:
    """Rows with the metric, best first; then the others, in trial order."""
    scored = [r for r in rows if r.metric(metric) is not None]
    scored.sort(key=lambda r: r.metric(metric), reverse=mode == "max")
    return scored + [r for r in rows if r.metric(metric) is None]


def best(rows: Sequence[Row], metric: str) -> Row | None:
    """The first finished row with the metric (of `ranked` rows)."""
    return next((r for r in rows if r.status == FINISHED and r.metric(metric) is not None), None)


def metric_names(rows: Sequence[Row]) -> list[str]:
    """Every `train/...` and `eval/...` metric any row has, in a stable order."""
    names = {f"{split}/{k}" for r in rows for split in ("train", "eval") for k in getattr(r, split)}
    return sorted(names, key=lambda n: (not n.startswith("eval"), n))


def write(sweep_dir: str, rows: Sequence[Row], metric: str, mode: str) -> None:
    """Writes `sweep.json` and `sweep.csv` (rows already `ranked`) into `sweep_dir`."""
    winner = best(rows, metric)
    summary = {
        "metric": metric,
        "mode": mode,
        "best": winner.trial if winner else None,
        "trials": [dataclasses.asdict(r) for r in rows],
    }
    storage.write_text(os.path.join(sweep_dir, "sweep.json"), json.dumps(summary, indent=2) + "\n")
    fields = list(dict.fromkeys(f for r in rows for f in r.overrides))
    metrics = metric_names(rows)
    text = io.StringIO()
    out = csv.writer(text)
    out.writerow(["trial", "status", *fields, *metrics, "step", "wall_time_s", "error"])
    for r in rows:
        values = [r.metric(m) for m in metrics]
        out.writerow(
            [r.trial, r.status, *(r.overrides.get(x, "") for x in fields)]
            + ["" if v is None else v for v in values]
            + [r.step, r.wall_time_s, r.error]
        )
    storage.write_text(os.path.join(sweep_dir, "sweep.csv"), text.getvalue())


def table(rows: Sequence[Row], metric: str) -> str:
    """The rows as a fixed-width text table, the best trial named below it."""
    fields = list(dict.fromkeys(f for r in rows for f in r.overrides))
    metrics = [metric] + [m for m in ("train/loss", "eval/loss", "eval/accuracy") if m != metric]
    metrics = [m for m in metrics if any(r.metric(m) is not None for r in rows)] or [metric]
    header = ["trial", *(f.rsplit(".", 1)[-1] for f in fields), *metrics, "wall s", "status"]
    lines = []
    for r in rows:
        values = [r.metric(m) for m in metrics]
        status = f"{r.status}: {r.error}" if r.error else r.status
        lines.append(
            [r.trial.split("-", 1)[0], *(r.overrides.get(f, "") for f in fields)]
            + ["-" if v is None else f"{v:.4f}" for v in values]
            + [f"{r.wall_time_s:.1f}", status]
        )
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    text = [
        "  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    ]
    winner = best(rows, metric)
    if winner:
        text.append(
            f"best: {winner.trial} ({metric} {winner.metric(metric):.4f}) in {winner.model_dir}"
        )
    else:
        text.append(f"best: none (no finished trial reported `{metric}`)")
    return "\n".join(text)
