"""The `strategies` case: small_mlp under every strategy, relative to one_device.

one_device, mirrored and central_storage (2 logical CPUs) run in this
process with every training contender; multi_worker and parameter_server run
as local clusters (`python -m trainer.launch`), timed by the chief's clock
action (`clock.to_file`).
"""

from __future__ import annotations

import statistics
import tempfile

import strategies
from trainer.bench import clock, contenders
from trainer.bench.harness import alternate, cluster_marks, medians, note, paired, result
from trainer.bench.sizes import SINGLE_PROCESS, Sizes, small_config

CLUSTERS = {"multi_worker": ["--workers=2"], "parameter_server": ["--workers=2", "--ps=1"]}


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """examples/s under each strategy, and each over one_device."""
    runs = {}
    for name in SINGLE_PROCESS:
        config = small_config(sizes, name)
        runs.update(
            contenders.training(
                config, contenders.plugin(name), workdir, sizes.small_loops, prefix=f"{name}/"
            )
        )
    failed: dict[str, str] = {}
    samples = alternate(runs, reps, failed)
    figures = medians(samples)
    ratios = {}
    for name in SINGLE_PROCESS:
        ratios.update(contenders.training_ratios(samples, prefix=f"{name}/"))
    notes = []
    known = strategies.available()
    for name, topology in CLUSTERS.items():
        if name not in sizes.clusters:
            notes.append(f"{name}: not run at these sizes (`Sizes.clusters`)")
            continue
        if name not in known:
            notes.append(f"{name}: not registered here (strategies.available()); skipped")
            note(notes[-1])
            continue
        rates = [cluster_rate(sizes, name, topology, workdir) for _ in range(max(1, reps // 3))]
        samples[f"{name}/towerflow"] = rates
        figures[f"{name}/towerflow"] = statistics.median(rates)
    base = "one_device/towerflow"
    for name in SINGLE_PROCESS:
        ratios[f"{name}/one_device"] = paired(
            samples, lambda r, n=name: r[f"{n}/towerflow"] / r[base]
        )
    for name in CLUSTERS:  # one run each: against the median
        if f"{name}/towerflow" in figures:
            ratios[f"{name}/one_device"] = figures[f"{name}/towerflow"] / figures[base]
    return result("examples/s", figures, ratios, samples, failed=failed, notes=notes)


def cluster_rate(sizes: Sizes, name: str, topology: list[str], workdir: str) -> float:
    """examples/s of a local cluster, from the marks of the chief's clock action."""
    loop = sizes.steps_per_loop or small_config(sizes, name).train.steps_per_loop
    overrides = {
        "data.name": "synthetic",
        "data.synthetic.input_shape": f"({sizes.small_input},)",
        "data.synthetic.num_examples": sizes.examples,
        "model.hidden_units": "(" + "".join(f"{u}," for u in sizes.small_hidden) + ")",
        "model.dropout": 0.0,
        "train.global_batch_size": sizes.small_batch,
    }
    model_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
    args = [f"--strategy={name}", "--mode=train"]
    marks = cluster_marks(topology, args, overrides, model_dir, sizes.cluster_steps, loop)
    return clock.rate(marks, sizes.small_batch, until=sizes.cluster_steps)
