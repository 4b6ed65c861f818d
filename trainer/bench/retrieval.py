"""The `retrieval` case: the export's exactness, log-Q's lift, the approximate index, PS step time.

On `examples/retrieval.py`'s synthetic catalogue (users and items with latent
factors, item popularity Zipf(`ZIPF_A`), items arriving over the stream):

1. `exact`: the example trained on `one_device`, exported by the loop; a
   fresh process loads the export and answers `queries` users; their top-100
   ids must equal numpy's brute force over the same vectors (the model's
   catalogue and query tower, read in this process).
2. `log_q`: recall@100 on the held-out interactions with and without the
   log-Q correction, the same model, data and seeds (the mean over `seeds`).
3. `index`: `items` clustered item vectors (a million in the full size),
   brute force against `Partitioned(partitions, probes)`, each written as a
   SavedModel of query vectors to top-100 ids and timed in a fresh process
   (queries/s at batches of `QUERY_BATCH`); the approximate index's recall@100
   relative to exact, and the dot products a query costs in each.
4. `ps`: a `parameter_server` cluster (2 workers, 2 ps) training the retrieval
   objective against the same towers with a sigmoid on labelled pairs
   (`examples.retrieval:PairsTask`, a positive and a uniform negative per
   interaction), ms per step of each (the chief's clock, `harness.cluster_marks`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys

import numpy as np

from trainer.bench import clock
from trainer.bench.harness import cluster_marks, note, result
from trainer.bench.sizes import QUICK, Sizes

ZIPF_A = 1.1  # the catalogue's popularity exponent (>= 1: skewed)
TOP = 100  # the k of recall@k and of the exactness check
QUERY_BATCH = 1  # queries per call when timing the indexes: one request, one user
EXAMPLE = "examples/retrieval.py"


@dataclasses.dataclass(frozen=True)
class RetrievalSizes:
    """The case's sizes (full, and `--quick`)."""

    steps: int = 600  # training steps of each run of the example
    interactions: int = 80_000
    queries: int = 1000  # users answered by the export in the exactness check
    seeds: int = 3  # runs with and without log-Q (their recall's mean)
    items: int = 1_000_000  # item vectors of the index comparison
    partitions: int = 2000
    probes: int = 64
    index_queries: int = 500  # timed one at a time
    ps_steps: int = 300  # timed steps of each cluster run


FULL = RetrievalSizes()
QUICK_SIZES = RetrievalSizes(
    steps=40,
    interactions=8000,
    queries=200,
    seeds=1,
    items=20_000,
    partitions=100,
    probes=10,
    index_queries=100,
    ps_steps=20,
)


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Every figure of the module docstring."""
    mine = QUICK_SIZES if sizes is QUICK else FULL
    figures, samples, extra = {}, {}, {}
    figures["exact_top100_identical_share"] = _exactness(mine, workdir)
    recalls = _log_q(mine, workdir, samples)
    figures.update(recalls)
    extra["index"] = _index(mine, workdir)
    figures["exact_queries_per_s"] = extra["index"]["exact_queries_per_s"]
    figures["approximate_queries_per_s"] = extra["index"]["approximate_queries_per_s"]
    step_ms = {kind: _cluster_step_ms(mine, workdir, kind, reps) for kind in ("retrieval", "pairs")}
    figures.update({f"ps_{kind}_ms_per_step": ms for kind, ms in step_ms.items()})
    ratios = {
        "log_q/no_log_q recall@100": recalls["recall@100_log_q"] / recalls["recall@100_no_log_q"],
        "approximate/exact recall@100": extra["index"]["relative_recall"],
        "exact/approximate dot products": extra["index"]["exact_dot_products"]
        / extra["index"]["approximate_dot_products"],
        "ps retrieval/sigmoid step time": step_ms["retrieval"] / step_ms["pairs"],
    }
    for name, value in ratios.items():
        note(f"  {name}: {value:.3f}")
    return result("mixed: shares, recall, queries/s, ms", figures, ratios, samples, **extra)


def _config(mine: RetrievalSizes, **overrides):
    """The example's config at this size, on `one_device`; no export or checkpoint unless asked."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("retrieval_example_config", _example_path())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.strategy.name = "one_device"
    config.update_from_flattened_dict(
        {
            "task.interactions": mine.interactions,
            "task.zipf_a": ZIPF_A,
            "train.steps": mine.steps,
            "train.steps_per_loop": min(100, mine.steps),
            "train.checkpoint_every": 0,
            "train.export": False,
            **overrides,
        }
    )
    return config


def _example_path() -> str:
    return os.path.join(os.path.dirname(__file__), "..", "..", EXAMPLE)


def _exactness(mine: RetrievalSizes, workdir: str) -> float:
    """The share of `queries` users whose exported top-100 equals numpy's brute force."""
    import tensorflow as tf

    from trainer.loop import train

    model_dir = os.path.join(workdir, "retrieval-exact")
    job = train.build(_config(mine, **{"train.export": True, "task.k": TOP}), model_dir)
    train.run(job, "train")
    model = job.model
    catalogue = model.catalogue()
    users = np.unique(np.arange(mine.queries) * 7919 + 11)
    queries = model.query_tower({"user_id": tf.constant(users)}).numpy()
    scores = queries @ catalogue.vectors.T
    expected = catalogue.ids[np.argsort(-scores, axis=1, kind="stable")[:, :TOP]]
    served = np.array(_fresh_answer(os.path.join(model_dir, "export"), users.tolist()))
    share = float(np.mean(np.all(served == expected, axis=1)))
    note(f"  export vs numpy, top-{TOP} of {len(users)} users: {share:.1%} identical")
    return share


_ANSWER = """
import json, sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
users = tf.constant(json.load(open(sys.argv[2])), tf.int64)
print(json.dumps(serve(user_id=users)["item_ids"].numpy().tolist()))
"""


def _fresh_answer(export_dir: str, users: list[int]) -> list:
    """The export's `item_ids` for `users`, answered by a fresh process."""
    path = export_dir + ".users.json"
    with open(path, "w") as f:
        json.dump(users, f)
    out = _python(_ANSWER, export_dir, path)
    return json.loads(out.splitlines()[-1])


def _python(code: str, *args: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(f"a fresh process failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _log_q(mine: RetrievalSizes, workdir: str, samples: dict) -> dict[str, float]:
    """Recall@100 (and @10) with and without log-Q, the mean over `seeds` seeds each."""
    from trainer.loop import train

    for seed in range(mine.seeds):
        for log_q in (True, False):
            name = "log_q" if log_q else "no_log_q"
            config = _config(mine, **{"task.log_q": log_q, "seed": seed})
            out = train.train_and_evaluate(config, os.path.join(workdir, f"rq-{name}-{seed}"))
            for k in (10, TOP):
                samples.setdefault(f"recall@{k}_{name}", []).append(out["eval"][f"recall_at_{k}"])
            note(f"  seed {seed}, {name}: recall@{TOP} {out['eval'][f'recall_at_{TOP}']:.4f}")
    return {name: statistics.fmean(values) for name, values in samples.items()}


_TIME_INDEX = """
import json, sys, time
import numpy as np
import tensorflow as tf
queries = np.load(sys.argv[2])
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
serve(queries=tf.constant(queries[:1]))  # warm
answers, tic = [], time.perf_counter()
batch = int(sys.argv[3])
for i in range(0, len(queries), batch):
    answers.append(serve(queries=tf.constant(queries[i : i + batch]))["item_ids"].numpy())
seconds = time.perf_counter() - tic
np.save(sys.argv[4], np.concatenate(answers))
print(json.dumps({"queries_per_s": len(queries) / seconds}))
"""


def _index(mine: RetrievalSizes, workdir: str) -> dict:
    """Brute force against the partitioned index on `items` clustered vectors, fresh processes."""
    import tensorflow as tf

    from trainer.retrieval import Catalogue, Partitioned

    rng = np.random.default_rng(0)
    width, clusters = 32, max(mine.items // 500, 10)
    centres = rng.normal(size=(clusters, width)).astype(np.float32)
    vectors = centres[rng.integers(clusters, size=mine.items)]
    vectors += 0.3 * rng.normal(size=vectors.shape).astype(np.float32)
    ids = rng.choice(2**62, size=mine.items, replace=False).astype(np.int64)
    queries = rng.normal(size=(mine.index_queries, width)).astype(np.float32)
    query_path = os.path.join(workdir, "index-queries.npy")
    np.save(query_path, queries)
    out = {}
    found = {}
    for name, index in (
        ("exact", None),
        ("approximate", Partitioned(mine.partitions, mine.probes)),
    ):
        catalogue = Catalogue(ids, vectors, index)
        path = os.path.join(workdir, f"index-{name}")
        module = tf.Module()
        module.serve = _serving(catalogue, width)
        tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
        answers = os.path.join(workdir, f"index-{name}.npy")
        timing = json.loads(_python(_TIME_INDEX, path, query_path, str(QUERY_BATCH), answers))
        found[name] = np.load(answers)
        out[f"{name}_queries_per_s"] = timing["queries_per_s"]
        out[f"{name}_dot_products"] = catalogue.dot_products()
    hits = [len(set(a) & set(b)) for a, b in zip(found["approximate"], found["exact"])]
    out["relative_recall"] = float(np.mean(hits)) / TOP
    out.update(items=mine.items, partitions=mine.partitions, probes=mine.probes)
    note(
        f"  index on {mine.items:,} items: approximate recall@{TOP} {out['relative_recall']:.3f} "
        f"of exact, dot products per query {out['approximate_dot_products']:,} against "
        f"{out['exact_dot_products']:,}, queries/s {out['approximate_queries_per_s']:.0f} "
        f"against {out['exact_queries_per_s']:.0f}"
    )
    return out


def _serving(catalogue, width: int):
    """A signature of query vectors `[batch, width]` to `catalogue`'s top-100 ids and scores."""
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([None, width], tf.float32, name="queries")])
    def serve(queries):
        ids, scores = catalogue.top_k(queries, TOP)
        return {"item_ids": ids, "scores": scores}

    return serve


def _cluster_step_ms(mine: RetrievalSizes, workdir: str, kind: str, reps: int) -> float:
    """ms per step of `kind` ("retrieval" or "pairs") on 2 workers and 2 ps (median of reps)."""
    chosen = "RetrievalTask" if kind == "retrieval" else "PairsTask"
    overrides = {
        "task.name": f"examples.retrieval:{chosen}",
        "task.interactions": mine.interactions,
        "task.zipf_a": ZIPF_A,
    }
    args = [f"--config={EXAMPLE}", "--strategy=parameter_server", "--mode=train"]
    times = []
    for rep in range(reps):
        model_dir = os.path.join(workdir, f"ps-{kind}-{rep}")
        marks = cluster_marks(
            ["--workers=2", "--ps=2"], args, overrides, model_dir, mine.ps_steps, 10
        )
        times.append(1e3 / clock.rate(marks, 1.0, until=mine.ps_steps))
    ms = statistics.median(times)
    note(f"  parameter_server (2 workers, 2 ps), {kind}: {ms:.1f} ms/step")
    return ms
