"""The `multi_host` case: `multi_worker` on 2 simulated hosts over shaped links, against one host.

    python -m trainer.bench --cases=multi_host          # as root: ~10 min here

Each host is a network namespace of its own (`hosts.py`), its process pinned
to one core of its own with `taskset`; the two talk through a bridge over
links that are raw (veth, as fast as the kernel copies), or shaped with an
HTB rate limit on each host's link, both ways (10 Gbit/s and 1 Gbit/s; with
0.2 ms and 1 ms of added delay each way where the kernel has `sch_netem`).
Each runs the per-host command of docs/beyond-one-machine.md. One host alone is `one_device` on one
core. Models: the default job's (`python -m trainer`: the MLP on digits, global
batch 128) and the `dense_large` MLP (about 15M parameters, batch 512), the
latter also with its gradients all-reduced in bfloat16
(`strategy.multi_worker.gradient_dtype`, where it exists).

examples/s come from the chief's clock action (`clock.to_file`) over whole
loops, the first loop (tracing) and the end-of-run checkpoint left out. Runs
alternate (one host, each link, ...) `max(1, reps // 2)` times per model;
ratios are paired within each round (`harness.paired`).
Needs root (`hosts.available()`); elsewhere the case reports why, no figures.
"""

from __future__ import annotations

import os
import statistics

from trainer.bench import clock, hosts
from trainer.bench.harness import note, paired, result, tail
from trainer.bench.links import netem as has_netem
from trainer.bench.sizes import Sizes

# Each host's link, both ways: HTB rate in Mbit/s, and added one-way delay (netem only).
LINKS = {
    "raw": {},
    "10gbit": {"rate_mbit": 10_000, "delay_ms": 0.2},
    "1gbit": {"rate_mbit": 1_000, "delay_ms": 1.0},
}
BF16 = "--config.strategy.multi_worker.gradient_dtype=bfloat16"  # half the bytes all-reduced
RUN_TIMEOUT_S = 600  # one training run; a loaded machine is slow, not stuck


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """examples/s of 2 hosts over each link, of one host alone, and their ratios."""
    reason = hosts.available()
    if reason:
        note(f"  multi_host skipped: {reason}")
        return result("examples/s", {}, {}, {}, notes=[f"not run: {reason}"])
    links = {name: _link(LINKS[name]) for name in sizes.host_links}
    samples: dict[str, list[float]] = {}
    for model, flags in _models(sizes).items():
        per_step = int(_flag(flags, "train.global_batch_size"))
        runs: dict[str, tuple[dict | None, list[str]]] = {"one_host": (None, [])}
        runs.update({name: (link, []) for name, link in links.items()})
        if model == "dense" and _bf16_transfer():
            runs.update({f"{name}/bf16": (link, [BF16]) for name, link in links.items()})
        for rep in range(max(1, reps // 2)):
            for name, (link, extra) in runs.items():
                key = f"{model}/{name}"
                stem = os.path.join(workdir, key)
                rate = _rate([*flags, *extra], per_step, link, stem, rep)
                samples.setdefault(key, []).append(rate)
                note(f"  rep {rep + 1} {key}: {rate:.4g} examples/s")
    figures = {key: statistics.median(values) for key, values in samples.items()}
    ratios = {}
    for key in figures:
        if not key.endswith("/one_host"):
            base = f"{key.split('/')[0]}/one_host"
            ratios[f"{key}/one_host"] = paired(samples, lambda r, k=key, b=base: r[k] / r[b])
        if key.endswith("/bf16"):
            base = key.removesuffix("/bf16")
            ratios[f"{key}/float32"] = paired(samples, lambda r, k=key, b=base: r[k] / r[b])
    netem = has_netem()
    return result(
        "examples/s",
        figures,
        ratios,
        samples,
        links={name: _describe(link) for name, link in links.items()},
        delay="netem" if netem else "none: this kernel has no sch_netem",
        cores="one per host (taskset)",
    )


def _models(sizes: Sizes) -> dict[str, list[str]]:
    """Each model's trainer flags (both strategies), by name."""
    steps = {"default": sizes.host_steps, "dense": sizes.host_dense_steps}
    dense = [
        "--config.data.name=synthetic",
        f"--config.data.synthetic.input_shape=({sizes.large_input},)",
        f"--config.data.synthetic.num_examples={sizes.examples}",
        f"--config.model.hidden_units=({','.join(map(str, sizes.large_hidden))},)",
        "--config.model.dropout=0.0",
        f"--config.train.global_batch_size={sizes.large_batch}",
    ]
    models = {"default": ["--config.train.global_batch_size=128"], "dense": dense}
    return {
        name: [
            *models[name],
            # One step more, untimed: the end-of-run checkpoint comes after it.
            f"--config.train.steps={steps[name] + 1}",
            f"--config.train.steps_per_loop={max(1, steps[name] // 6)}",  # 5 timed loops
            "--config.train.checkpoint_every=0",
            "--config.train.export=False",
            "--config.eval.every=0",
            "--config.train.actions=trainer.bench.clock:to_file",
            "--mode=train",
        ]
        for name in sizes.host_models
    }


def _rate(flags: list[str], per_step: int, link: dict | None, stem: str, rep: int) -> float:
    """examples/s of one run: one host alone (`link` None), or 2 hosts over `link`."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    marks = f"{stem}-{rep}.clock"
    env = {clock.FILE_VARIABLE: marks}
    model_dir = f"--model_dir={stem}-{rep}"
    with hosts.Hosts(1 if link is None else 2) as simulated:
        if link is None:
            members, strategy = [0], "--strategy=one_device"
        else:
            for host in (0, 1):
                simulated.shape(host, **link)
            members, strategy = simulated.cluster({"worker": [0, 1]}), "--strategy=multi_worker"
        cores = sorted(os.sched_getaffinity(0))
        procs = [
            simulated.start_trainer(
                member,
                [strategy, model_dir, *flags],
                f"{stem}-{rep}-{i}.log",
                cpu=cores[i % len(cores)],
                env=env,
            )
            for i, member in enumerate(members)
        ]
        for i, proc in enumerate(procs):
            if proc.wait(timeout=RUN_TIMEOUT_S):
                raise RuntimeError(
                    f"{stem} exited with {proc.returncode}:\n{tail(f'{stem}-{rep}-{i}.log')}"
                )
    steps = int(_flag(flags, "train.steps")) - 1
    return clock.rate(clock.read(marks), per_step, until=steps)


def _bf16_transfer() -> bool:
    """Whether `multi_worker` can all-reduce gradients in bfloat16 (`gradient_dtype`)."""
    import configs.default

    return "gradient_dtype" in configs.default.get_config().strategy.multi_worker


def _link(link: dict) -> dict:
    """`link` as `Hosts.shape` takes it here: without the delay where there is no netem."""
    return {k: v for k, v in link.items() if k != "delay_ms" or has_netem()}


def _describe(link: dict) -> str:
    if not link:
        return "veth, unshaped"
    delay = f", +{link['delay_ms']:g} ms each way" if link.get("delay_ms") else ""
    return f"HTB {link['rate_mbit'] / 1000:g} Gbit/s each way on each host's link{delay}"


def _flag(flags: list[str], field: str) -> str:
    """The value of `--config.<field>=` in `flags`."""
    prefix = f"--config.{field}="
    return next(f.removeprefix(prefix) for f in flags if f.startswith(prefix))
