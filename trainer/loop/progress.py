"""What a run says on the terminal: one fixed-width line per block, and who says it.

`progress_line` formats a block's (or an evaluation's) metrics as Orbit does,
`train | step: 1200/1500 | loss: 0.3100 | ...`; `say` prints a line at once;
`tell` prints it where this member speaks for the job (the chief, and a
sidecar evaluator), so the workers of a cluster stay quiet.
"""

from __future__ import annotations

import strategies

_COUNTS = ("examples", "members", "replicas", "per_replica_batch", "global_batch")


def progress_line(split: str, step: int, metrics: dict, total: int | None = None) -> str:
    """One fixed-width line: `train | step: 1200/1500 | loss: 0.3100 | ...`."""
    parts = [f"{split:<5}", f"step: {step}/{total}" if total else f"step: {step}"]
    for name, value in metrics.items():
        if "/" in name:  # per class (TensorBoard and results.json): too many for one line
            continue
        if name == "learning_rate":
            parts.append(f"lr: {value:.2e}")
        elif name.endswith("_per_sec"):
            parts.append(f"{name.removesuffix('_per_sec')}/s: {value:.1f}")
        elif name in _COUNTS or name.endswith("_examples"):  # `progressive_examples` too
            parts.append(f"{name}: {int(value)}")
        elif name == "ids_held":  # in the dynamic tables
            parts.append(f"ids: {int(value)}")
        elif name.startswith("backlog_") or name == "records_repeated":  # `data.follow`
            parts.append(f"{name}: {int(value)}")
        elif name == "behind_s":
            parts.append(f"behind_s: {value:.1f}")
        else:
            parts.append(f"{name}: {value:.4f}")
    return " | ".join(parts)


def tell(strategy: strategies.Strategy, line: str) -> None:
    """Progress from the chief (and a sidecar evaluator); other workers stay quiet."""
    member = strategy.membership
    if member.is_chief or member.role != "train":
        say(line)


def say(line: str) -> None:
    """Progress for the terminal: one line, flushed at once."""
    print(line, flush=True)
