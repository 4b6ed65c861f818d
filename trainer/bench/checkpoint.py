"""The `checkpoint` case: how long a save of a ~100 MB checkpoint blocks training, and a restore.

Synchronous against asynchronous saves (`train.async_checkpoint`), of what
the trainer's checkpoints hold (`train.checkpointed`).
"""

from __future__ import annotations

import os
import statistics

from trainer.bench.harness import alternate, medians, paired, result, timed
from trainer.bench.sizes import Sizes, make_config, parameters


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Seconds a save blocks training, synchronous and asynchronous, and a restore."""
    from trainer.loop import train
    from trainer.loop.checkpoints import Checkpointer

    config = make_config(sizes, "one_device", sizes.ckpt_hidden, sizes.large_input, 64)
    job = train.build(config, os.path.join(workdir, "ckpt"))
    objects = train.checkpointed(job)
    savers = {
        mode: Checkpointer(
            os.path.join(workdir, f"ckpt-{mode}"), True, 2, async_save=mode == "async", **objects
        )
        for mode in ("sync", "async")
    }
    step = iter(range(1, 10**6))
    finished: dict[str, list[float]] = {"async": []}

    def save(mode: str) -> float:
        saver = savers[mode]
        blocked = timed(lambda: saver.save(next(step)))
        if mode == "async":
            finished["async"].append(blocked + timed(saver.sync))
        return blocked

    runs = {
        "sync_save_blocks_s": lambda: save("sync"),
        "async_save_blocks_s": lambda: save("async"),
        "restore_s": lambda: timed(savers["sync"].restore),
    }
    samples = alternate(runs, reps)
    figures = medians(samples)
    figures["async_save_completes_s"] = statistics.median(finished["async"][1:])
    size = directory_mb(savers["sync"].latest)
    for saver in savers.values():
        saver.close()
    ratios = {
        "async_blocks/sync_blocks": paired(
            samples, lambda r: r["async_save_blocks_s"] / r["sync_save_blocks_s"]
        )
    }
    return result(
        "seconds", figures, ratios, samples, checkpoint_mb=size, parameters=parameters(config)
    )


def directory_mb(prefix: str) -> float:
    """MiB of the files of the checkpoint at `prefix`."""
    directory, stem = os.path.split(prefix)
    files = [f for f in os.listdir(directory) if f.startswith(os.path.basename(stem) + ".")]
    return sum(os.path.getsize(os.path.join(directory, f)) for f in files) / 2**20
