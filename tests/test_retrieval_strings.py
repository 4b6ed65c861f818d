"""Retrieval over string user and item ids: trained, ranked and served as the raw strings.

A string `DynamicEmbedding` keeps fingerprints; the model keeps the strings
of the items it trained (`trainer.retrieval.names`), so eval and the export
name items by their raw ids.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples import retrieval as example
from tests.test_retrieval import MIRRORED, _config, _reference_loss, _served
from trainer import retrieval
from trainer.layers import DynamicEmbedding
from trainer.loop import train
from trainer.retrieval import names

USERS = ["ann", "bob", "cy", "dee", "eve", "flo"]
ITEMS = ["shoe", "hat", "sock", "shoe", "coat", "hat"]  # shoe and hat twice: accidental hits


def _string_model(k: int = 3) -> retrieval.Retrieval:
    user_id = keras.Input((), dtype="string", name="user_id")
    users = DynamicEmbedding(4, "string", name="users")(user_id)
    query = keras.Model({"user_id": user_id}, users)
    item_id = keras.Input((), dtype="string", name="item_id")
    items = DynamicEmbedding(4, "string", capacity=64, name="items")(item_id)
    item_tower = keras.Model(item_id, items, name="item_tower")
    softmax = retrieval.InBatchSoftmax(temperature=0.5, log_q=False)
    return retrieval.Retrieval(query, item_tower, "item_id", softmax, k=k)


def _features(items=ITEMS) -> dict:
    return {"user_id": tf.constant(USERS), "item_id": tf.constant(items)}


def _trained(steps: int = 2) -> retrieval.Retrieval:
    model = _string_model()
    features = _features()
    for _ in range(steps):
        queries = model({"user_id": features["user_id"]}, training=True)
        model.compute_loss(features, None, queries, training=True)
    return model


def test_accidental_hits_are_found_among_string_item_ids():
    model = _string_model()
    features = _features()
    queries = model({"user_id": features["user_id"]}, training=True)
    loss = model.compute_loss(features, None, queries, training=True)
    vectors = model.item_tower(features["item_id"]).numpy()
    same_ids = np.unique(ITEMS, return_inverse=True)[1]  # equal strings, equal numbers
    reference = _reference_loss(queries.numpy(), vectors, same_ids, 0.5)
    assert float(loss) == pytest.approx(reference.mean(), rel=1e-5)


def test_eval_ranks_string_items_among_every_item_held():
    model = _trained()
    features = _features(["shoe", "hat", "sock", "shoe", "coat", "scarf"])  # scarf: never held
    queries = model.query_tower({"user_id": features["user_id"]})
    model.compute_loss(features, None, queries, training=False)
    model.compute_metrics(features, None, queries)
    results = {k: float(v) for k, v in model.get_metrics_result().items()}
    held = ["shoe", "hat", "sock", "coat"]
    scores = queries.numpy() @ model.item_tower(tf.constant(held)).numpy().T
    ranks = [int(np.sum(scores[i] > scores[i][held.index(item)])) for i, item in enumerate(ITEMS)]
    assert results["recall_at_10"] == pytest.approx(5 / 6)
    assert results["mrr"] == pytest.approx(np.sum(1 / (np.array(ranks[:5]) + 1)) / 6, rel=1e-5)


def test_the_names_of_items_no_longer_held_are_forgotten_at_the_next_catalogue():
    model = _trained()
    held = model.catalogue_ids().numpy()
    model.item_names.remember(tf.constant(["gone"]))
    assert len(model.item_names.names.export()[0].numpy()) == len(held) + 1
    catalogue = model.catalogue()
    assert sorted(catalogue.ids) == [b"coat", b"hat", b"shoe", b"sock"]
    assert sorted(model.item_names.names.export()[0].numpy()) == sorted(held)


def test_replicas_gather_each_others_strings_in_replica_order():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    parts = [tf.constant(["a", "bé", "ccc"]), tf.constant(["", "dddddd", "e"])]

    def gather():
        replica = tf.distribute.get_replica_context()
        mine = tf.gather(tf.stack(parts), replica.replica_id_in_sync_group)
        return names.all_gather_strings(replica, mine)

    gathered = strategy.experimental_local_results(strategy.run(tf.function(gather)))
    expected = ["a", "bé", "ccc", "", "dddddd", "e"]
    for each in gathered:
        assert [x.decode() for x in each.numpy()] == expected


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory) -> dict:
    """examples/retrieval.py with string ids under `mirrored`: trained, evaluated, exported.

    The export answers its first 3 users in a fresh process. Returns the config,
    the trained model, the results, the stream, the users and what was served.
    """
    model_dir = tmp_path_factory.mktemp("mirrored")
    config = _config(**MIRRORED, **{"task.string_ids": True})
    config.train.export = True
    job = train.build(config, str(model_dir))
    results = train.run(job, "train_and_eval")
    stream = example.interactions(config.task, config.seed)
    users = example.as_strings(stream["user_id"][:3], "user_id").tolist()
    served = _served(model_dir / "export", users)["item_ids"]
    return dict(config=config, model=job.model, results=results, stream=stream, served=served)


def test_under_mirrored_string_ids_train_evaluate_and_export_the_raw_strings(mirrored):
    config, served = mirrored["config"], mirrored["served"]
    assert {"recall_at_10", "recall_at_100", "mrr"} <= set(mirrored["results"]["eval"])
    trained = set(example.as_strings(mirrored["stream"]["item_id"], "item_id").tolist())
    assert len(served[0]) == config.task.k and set(served[0]) <= trained, served[0][:5]


def test_the_export_answers_the_raw_string_item_ids_in_a_fresh_process(mirrored):
    model, stream = mirrored["model"], mirrored["stream"]
    users = example.as_strings(stream["user_id"][:3], "user_id")
    queries = model.query_tower({"user_id": tf.constant(users)}).numpy()
    held = np.array([name.decode() for name in model.catalogue().ids])
    scores = queries @ model.item_tower(tf.constant(held)).numpy().T
    expected = held[np.argsort(-scores, axis=1)[:, :3]].tolist()
    assert [answer[:3] for answer in mirrored["served"]] == expected
