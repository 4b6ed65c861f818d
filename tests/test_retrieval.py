"""Retrieval (`trainer.retrieval`): the in-batch softmax, its metrics, its export and bad input.

Each behaviour in one process on tiny data; `examples/retrieval.py` through
the command line under `one_device` (and, in the slow tier, `mirrored` and a
parameter-server cluster of 2 workers and 2 ps).
"""

import json
import pathlib
import shlex

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples import retrieval as example
from tests import helpers
from tests.fresh_process import run_script
from trainer import retrieval
from trainer.layers import DynamicEmbedding, ShardedEmbedding
from trainer.loop import train

TINY = {
    "task.num_users": 200,
    "task.num_items": 100,
    "task.categories": 5,
    "task.interactions": 4000,
    "task.eval_fraction": 0.1,
    "task.item_capacity": 256,
    "task.k": 20,
    "train.global_batch_size": 64,
    "train.steps": 20,
    "train.steps_per_loop": 10,
    "train.checkpoint_every": 20,
    "train.export": False,
    "eval.global_batch_size": 100,
}


# `mirrored` on 2 of the 4 logical CPUs: each replica's items meet the other's as with 4.
MIRRORED = {"strategy.name": "mirrored", "strategy.mirrored.devices": "/cpu:0,/cpu:1"}


def _config(**overrides):
    config = example.get_config()
    config.devices.logical_cpus = 4
    config.update_from_flattened_dict({**TINY, **overrides})
    return config


def _towers(width: int = 4, capacity: int = 64):
    user_id = keras.Input((), dtype="int64", name="user_id")
    query = keras.Model({"user_id": user_id}, DynamicEmbedding(width, name="users")(user_id))
    item_id = keras.Input((), dtype="int64", name="item_id")
    items = DynamicEmbedding(width, capacity=capacity, name="items")(item_id)
    return query, keras.Model(item_id, items, name="item_tower")


def _reference_loss(q, v, ids, temperature, log_q=None, extra=None):
    """numpy: the softmax cross-entropy of each query against the candidates, hits masked."""
    candidates, cand_ids = v, ids
    if extra is not None:
        candidates, cand_ids = np.concatenate([v, extra[0]]), np.concatenate([ids, extra[1]])
    logits = q @ candidates.T / temperature
    if log_q is not None:
        logits -= np.log(log_q)[None]
    same = ids[:, None] == cand_ids[None, :]
    same[np.arange(len(ids)), np.arange(len(ids))] = False
    logits[same] = -1e9
    logits -= logits.max(1, keepdims=True)
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return -np.log(probabilities[np.arange(len(ids)), np.arange(len(ids))])


RNG = np.random.default_rng(0)
Q = RNG.normal(size=(6, 4)).astype(np.float32)
V = RNG.normal(size=(6, 4)).astype(np.float32)
IDS = np.array([5, 9, 5, 2, 7, 9], np.int64)  # 5 and 9 twice: accidental hits


def test_the_in_batch_softmax_is_the_cross_entropy_against_the_batchs_other_items():
    softmax = retrieval.InBatchSoftmax(temperature=0.5, log_q=False)
    loss = softmax.per_example_loss(Q, V, tf.constant(IDS))
    np.testing.assert_allclose(loss, _reference_loss(Q, V, IDS, 0.5), rtol=1e-5)


def test_an_item_twice_in_the_batch_is_no_negative_of_its_own_queries():
    kept = retrieval.InBatchSoftmax(log_q=False, remove_accidental_hits=False)
    removed = retrieval.InBatchSoftmax(log_q=False)
    with_hits = kept.per_example_loss(Q, V, tf.constant(IDS)).numpy()
    without = removed.per_example_loss(Q, V, tf.constant(IDS)).numpy()
    unique = [1 if i in (3, 4) else 0 for i in range(6)]
    assert np.all(without[np.array(unique) == 0] < with_hits[np.array(unique) == 0])
    np.testing.assert_allclose(without[[3, 4]], with_hits[[3, 4]], rtol=1e-6)


def test_log_q_subtracts_each_candidates_log_expected_count_from_its_logit():
    frequencies = np.array([0.3, 0.1, 0.3, 0.05, 0.05, 0.1], np.float32)
    softmax = retrieval.InBatchSoftmax(temperature=1.0)
    extra = retrieval.Negatives(tf.constant(frequencies))
    loss = softmax.per_example_loss(Q, V, tf.constant(IDS), extra)
    reference = _reference_loss(Q, V, IDS, 1.0, log_q=6 * frequencies)
    np.testing.assert_allclose(loss, reference, rtol=1e-5)


def test_extra_negatives_join_the_candidates_and_their_hits_are_masked_too():
    more_v = RNG.normal(size=(3, 4)).astype(np.float32)
    more_ids = np.array([7, 100, 101], np.int64)  # 7 is query 4's own item
    softmax = retrieval.InBatchSoftmax(temperature=0.5, log_q=False)
    extra = retrieval.Negatives(None, tf.constant(more_ids), tf.constant(more_v))
    loss = softmax.per_example_loss(Q, V, tf.constant(IDS), extra)
    reference = _reference_loss(Q, V, IDS, 0.5, extra=(more_v, more_ids))
    np.testing.assert_allclose(loss, reference, rtol=1e-5)


def test_under_mirrored_each_query_meets_the_items_of_the_whole_global_batch():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    softmax = retrieval.InBatchSoftmax(temperature=0.5, log_q=False)

    def replica_loss(q, v, ids):
        return softmax.per_example_loss(q, v, ids)

    def part(context_values):
        index = tf.distribute.get_replica_context().replica_id_in_sync_group
        return [x[index * 3 : (index + 1) * 3] for x in context_values]

    values = [tf.constant(Q), tf.constant(V), tf.constant(IDS)]
    per_replica = strategy.run(lambda: replica_loss(*part(values)))
    both = np.concatenate([t.numpy() for t in strategy.experimental_local_results(per_replica)])
    np.testing.assert_allclose(both, _reference_loss(Q, V, IDS, 0.5), rtol=1e-5)


def test_the_item_tables_frequencies_are_its_counts_over_its_lookups():
    table = DynamicEmbedding(4, capacity=16)
    for batch in ([1, 1, 1, 2], [1, 2, 3, 3]):
        table(tf.constant(batch, tf.int64), training=True)
    shares = table.frequencies(tf.constant([1, 2, 3, 4], tf.int64)).numpy()
    np.testing.assert_allclose(shares / shares.sum(), [4 / 8, 2 / 8, 2 / 8, 0.0], atol=0.01)
    assert sorted(table.held_ids().numpy().tolist()) == [1, 2, 3]


def _trained_model(steps: int = 2):
    query, item_tower = _towers()
    model = retrieval.Retrieval(query, item_tower, "item_id", retrieval.InBatchSoftmax(), k=3)
    features = {
        "user_id": tf.constant([1, 2, 3, 4, 5, 6], tf.int64),
        "item_id": tf.constant([10, 11, 12, 10, 13, 14], tf.int64),
    }
    for _ in range(steps):
        queries = model({"user_id": features["user_id"]}, training=True)
        model.compute_loss(features, None, queries, training=True)
    return model, features


def test_eval_ranks_each_item_among_every_item_the_table_holds():
    model, features = _trained_model()
    features["item_id"] = tf.constant([10, 11, 12, 10, 13, 99], tf.int64)  # 99: never held
    queries = model.query_tower({"user_id": features["user_id"]})
    model.compute_loss(features, None, queries, training=False)
    model.compute_metrics(features, None, queries)
    results = {k: float(v) for k, v in model.get_metrics_result().items()}
    held = model.catalogue_ids().numpy()
    vectors = model.item_tower(tf.constant(held)).numpy()
    scores = queries.numpy() @ vectors.T
    ranks = []
    for i, item in enumerate(features["item_id"].numpy()[:5]):
        ranks.append(int(np.sum(scores[i] > scores[i][list(held).index(item)])))
    ranks = np.array(ranks)
    assert results["recall_at_10"] == pytest.approx(5 / 6)  # 6 items held: all but 99
    assert results["mrr"] == pytest.approx(np.sum(1 / (ranks + 1)) / 6, rel=1e-5)


def test_training_reports_no_recall():
    model, features = _trained_model(1)
    assert not any(name.startswith("recall") for name in model.get_metrics_result())


SERVE = """
import sys, json
import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
users = json.loads(sys.argv[2])
out = serve(user_id=tf.constant(users, tf.string if isinstance(users[0], str) else tf.int64))
out = {k: v.numpy().tolist() for k, v in out.items()}
out["item_ids"] = [[x.decode() if isinstance(x, bytes) else x for x in r] for r in out["item_ids"]]
print("SERVED", json.dumps(out))
"""


def _served(path, users) -> dict:
    served = run_script(SERVE, str(path), json.dumps(users), cwd=path)
    helpers.assert_exit(served)
    line = next(x for x in served.stdout.splitlines() if x.startswith("SERVED"))
    return json.loads(line[len("SERVED ") :])


def test_the_export_answers_the_top_k_raw_item_ids_in_a_fresh_process(tmp_path):
    model, features = _trained_model()
    users = [1, 2, 3]
    path = retrieval.export(model, str(tmp_path / "export"))
    served = _served(path, users)
    queries = model.query_tower({"user_id": tf.constant(users, tf.int64)}).numpy()
    held = model.catalogue_ids().numpy()
    scores = queries @ model.item_tower(tf.constant(held)).numpy().T
    expected = held[np.argsort(-scores, axis=1)[:, :3]]
    assert served["item_ids"] == expected.tolist()
    np.testing.assert_allclose(served["scores"], np.sort(scores, 1)[:, ::-1][:, :3], rtol=1e-5)


def test_exact_top_100_equals_numpy_brute_force_over_the_same_vectors():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 2**62, size=3000)
    vectors = rng.normal(size=(3000, 16)).astype(np.float32)
    queries = rng.normal(size=(50, 16)).astype(np.float32)
    found, scores = retrieval.Catalogue(ids, vectors).top_k(tf.constant(queries), 100)
    expected = ids[np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :100]]
    np.testing.assert_array_equal(found.numpy(), expected)


def test_a_partitioned_index_probing_every_cell_is_exact_and_probing_few_costs_less():
    rng = np.random.default_rng(2)
    ids = np.arange(2000) * 7 + 3
    vectors = rng.normal(size=(2000, 8)).astype(np.float32)
    queries = tf.constant(rng.normal(size=(20, 8)).astype(np.float32))
    exact, _ = retrieval.Catalogue(ids, vectors).top_k(queries, 10)
    every = retrieval.Catalogue(ids, vectors, retrieval.Partitioned(20, probes=20))
    np.testing.assert_array_equal(every.top_k(queries, 10)[0].numpy(), exact.numpy())
    few = retrieval.Catalogue(ids, vectors, retrieval.Partitioned(20, probes=3))
    found = few.top_k(queries, 10)[0].numpy()
    assert few.dot_products() < 2000 / 2
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact.numpy())])
    assert recall > 0.4


def test_fewer_items_than_k_pad_the_answer_with_no_item():
    catalogue = retrieval.Catalogue(np.array([4, 5]), np.eye(2, dtype=np.float32))
    ids, scores = catalogue.top_k(tf.constant([[1.0, 0.0]]), 3)
    assert ids.numpy().tolist() == [[4, 5, -1]] and np.isinf(scores.numpy()[0, 2])


# Bad input: one line naming the value and the fix.


def test_a_temperature_not_above_zero_is_refused():
    helpers.one_line_error(r"`temperature` \(0.0\).*> 0", retrieval.InBatchSoftmax, 0.0)


def test_k_beyond_what_the_table_can_hold_is_refused():
    query, item_tower = _towers(capacity=50)
    message = helpers.one_line_error(
        r"`k` \(51\)", retrieval.Retrieval, query, item_tower, "item_id", None, 51
    )
    assert "at most 50" in message


def test_an_export_of_k_beyond_the_items_held_is_refused_and_writes_nothing(tmp_path):
    model, _ = _trained_model()  # 5 items held
    model.k = 6
    path = tmp_path / "export"
    helpers.one_line_error(r"`k` \(6\).*5 items", retrieval.export, model, str(path))
    assert not path.exists()


def test_an_item_tower_without_a_dynamic_or_sharded_table_is_refused():
    query, _ = _towers()
    item_id = keras.Input((), dtype="int64", name="item_id")
    plain = keras.Model(item_id, keras.layers.Embedding(100, 4)(item_id), name="plain")
    helpers.one_line_error(
        r"holds no `DynamicEmbedding` or `ShardedEmbedding`.*Embedding",
        retrieval.Retrieval,
        query,
        plain,
    )


def test_a_sharded_item_table_serves_its_rows_without_log_q():
    query, _ = _towers()
    item_id = keras.Input((), dtype="int64", name="item_id")
    sharded = keras.Model(item_id, ShardedEmbedding(30, 4)(item_id), name="sharded")
    helpers.one_line_error("keeps no counts", retrieval.Retrieval, query, sharded)
    model = retrieval.Retrieval(query, sharded, softmax=retrieval.InBatchSoftmax(log_q=False), k=5)
    assert model.catalogue_ids().numpy().tolist() == list(range(30))


def test_negatives_from_a_column_the_data_lacks_are_refused():
    softmax = retrieval.InBatchSoftmax(negatives_column="shown")
    helpers.one_line_error(
        r"'shown' is not a feature.*`item_id`", softmax.check_features, {"item_id": 0, "user_id": 0}
    )


def test_an_index_of_more_partitions_than_items_is_refused():
    helpers.one_line_error(
        r"\(11\) is more than the 10 items",
        retrieval.Catalogue,
        np.arange(10),
        np.ones([10, 2], np.float32),
        retrieval.Partitioned(11),
    )


BAD = [
    ({"task.temperature": -1.0}, r"`temperature` \(-1.0\)"),
    ({"task.k": 5000}, r"`k` \(5000\) is more than the item table 'items' can hold"),
    ({"task.negatives_column": "shown"}, r"`negatives_column` 'shown'"),
    ({"task.partitions": 5000}, r"`Partitioned.partitions` \(5000\)"),
]


@pytest.mark.parametrize("overrides, words", BAD)
def test_bad_retrieval_options_stop_the_run_before_model_dir(overrides, words, tmp_path):
    model_dir = tmp_path / "run"
    config = _config(**{"strategy.name": "one_device", **overrides})
    helpers.one_line_error(words, train.train_and_evaluate, config, str(model_dir))
    assert not model_dir.exists()


def test_a_bad_retrieval_option_exits_2_from_the_command_line(tmp_path, capsys):
    model_dir = tmp_path / "run"
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    code, _, err = helpers.cli_in_process(
        "--config=examples/retrieval.py",
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        "--config.task.negatives_column=shown",
        *helpers.config_flags(_config(), tuple(TINY)),  # its data made small, as above
        capsys=capsys,
        cwd=helpers.REPO,
    )
    assert code == 2, err[-3000:]
    assert "`negatives_column` 'shown'" in err and "Traceback" not in err
    assert not model_dir.exists()


# The loop: eval metrics, log-Q and exports, in one process.


def _served_items(export_dir) -> set[int]:
    """Every item id a version answers for one user (its `k` is above the items it holds)."""
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    answer = serve(user_id=tf.constant([11], tf.int64))["item_ids"].numpy()[0]
    return set(answer[answer >= 0].tolist())


def test_under_mirrored_each_versions_index_holds_the_items_trained_by_its_step(tmp_path):
    overrides = {
        **MIRRORED,
        "task.k": 256,  # above the items held: each answer lists them all
        "task.shuffle_buffer": 0,  # in stream order: new items arrive in later steps
        "export.every_steps": 10,
        "export.keep": 0,
    }
    config = _config(**overrides)
    results = train.train_and_evaluate(config, str(tmp_path))
    assert {"recall_at_10", "recall_at_100", "mrr"} <= set(results["eval"])
    stream = example.interactions(config.task, config.seed)["item_id"]
    batch = config.train.global_batch_size
    early, late = (_served_items(tmp_path / "export" / str(step)) for step in (10, 20))
    assert early == set(stream[: 10 * batch].tolist())
    assert late == set(stream[: 20 * batch].tolist())
    assert late - early, "items first trained after step 10 are retrievable at step 20"


# docs/retrieval.md's commands, shortened, each through the command line.
DOCS = pathlib.Path(helpers.REPO, "docs", "retrieval.md")
SHORT = ["--config.train.steps=40", "--config.train.steps_per_loop=20"]


def _documented_commands() -> list[list[str]]:
    block = DOCS.read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_page_documents_one_device_mirrored_and_a_parameter_server_cluster():
    commands = [" ".join(c) for c in _documented_commands()]
    assert len(commands) == 3
    for strategy in ("one_device", "mirrored", "parameter_server"):
        assert any(f"--strategy={strategy}" in c for c in commands), commands


@pytest.mark.slow  # each a whole run through the command line (a cluster of 5 processes)
@pytest.mark.parametrize("index", range(3))
def test_each_documented_command_trains_evaluates_and_exports(index, tmp_path):
    command = _documented_commands()[index]
    model_dir = tmp_path / "run"
    args = [f"--model_dir={model_dir}" if a.startswith("--model_dir") else a for a in command]
    assert args[:2] == ["python", "-m"]
    run = helpers.run_cli(*args[3:], *SHORT, cwd=helpers.REPO, module=args[2])
    helpers.assert_exit(run)
    results = json.loads((model_dir / "results.json").read_text())
    assert {"recall_at_10", "recall_at_100", "mrr"} <= set(results["eval"])
    served = _served(model_dir / "export", [11, 7930])
    assert len(served["item_ids"]) == 2 and len(served["item_ids"][0]) == 100


@pytest.mark.slow  # trains 4 runs, exports, times 2 parameter-server clusters: minutes
def test_the_bench_case_reports_every_figure(tmp_path):
    path = tmp_path / "bench.json"
    done = helpers.run_cli(
        "--quick",
        "--cases=retrieval",
        f"--json={path}",
        cwd=str(tmp_path),
        module="trainer.bench",
    )
    helpers.assert_exit(done)
    case = json.loads(path.read_text())["cases"]["retrieval"]
    assert case["figures"]["exact_top100_identical_share"] == 1.0
    assert case["figures"]["recall@100_log_q"] > 0 and case["figures"]["recall@100_no_log_q"] > 0
    assert all(value > 0 for value in case["ratios"].values()), case["ratios"]
    assert case["index"]["approximate_dot_products"] < case["index"]["exact_dot_products"]


class CountedRows(keras.layers.Layer):
    """Passes vectors through, counting the rows it was given (a plain TF variable)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rows = tf.Variable(0, dtype=tf.int64, trainable=False)

    def call(self, vectors):
        self.rows.assign_add(tf.cast(tf.shape(vectors)[0], tf.int64))
        return vectors


def test_an_eval_pass_computes_the_held_items_vectors_once():
    query, _ = _towers()
    item_id = keras.Input((), dtype="int64", name="item_id")
    counted = CountedRows()
    item_tower = keras.Model(item_id, counted(DynamicEmbedding(4, name="items")(item_id)))
    model = retrieval.Retrieval(query, item_tower, softmax=retrieval.InBatchSoftmax(), k=3)
    clock = tf.Variable(0, dtype=tf.int64)  # the step, as the loop's optimizer clocks tables
    model.item_table.table.use_clock(clock)
    features = {
        "user_id": tf.constant([1, 2, 3, 4, 5, 6], tf.int64),
        "item_id": tf.constant([10, 11, 12, 10, 13, 14], tf.int64),
    }

    @tf.function
    def step(training: bool):
        if training:
            clock.assign_add(1)
        # The query tower: the model called outside a strategy would answer from a catalogue.
        queries = model.query_tower({"user_id": features["user_id"]}, training=training)
        model.compute_loss(features, None, queries, training=training)
        if not training:
            model.compute_metrics(features, None, queries)

    def rows_of_an_eval_pass(batches: int = 3) -> int:
        before = int(counted.rows.numpy())
        for _ in range(batches):
            step(False)
        return int(counted.rows.numpy()) - before

    step(True)
    held = int(tf.size(model.catalogue_ids()))  # 5 items
    assert rows_of_an_eval_pass() == 3 * 6 + held  # each batch's items, the held ones once
    assert rows_of_an_eval_pass() == 3 * 6  # the same step: still kept
    step(True)
    assert rows_of_an_eval_pass() == 3 * 6 + held  # a step trained since: computed anew
