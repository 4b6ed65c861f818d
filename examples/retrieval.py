"""A two-tower retrieval model over dynamic tables, on synthetic interactions it generates.

    python -m trainer --config=examples/retrieval.py --strategy=one_device
    python -m trainer --config=examples/retrieval.py --strategy=mirrored
    python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server \\
        --config=examples/retrieval.py

The data (`interactions`, no download): users and items with latent factors
(each item near the centre of one of `categories`), item popularity
Zipf(`zipf_a`), items arriving over time (the catalogue grows as the stream
goes on). Each interaction is a user and the item they chose, with
probability proportional to popularity x exp(affinity of their factors).
The last `eval_fraction` of the stream is held out: eval ranks each of those
interactions' item among every item the table holds (recall@10, @100, MRR).

The model (`RetrievalTask`): a user tower (`DynamicEmbedding` of user ids,
then a dense layer) and an item tower (`DynamicEmbedding` of item ids; both
ids strings with `task.string_ids`),
trained with `trainer.retrieval.InBatchSoftmax` (log-Q from the item table's
counts); the export answers the top `task.k` item ids for a user id.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from trainer import Task
from trainer.layers import DynamicEmbedding
from trainer.retrieval import InBatchSoftmax, Partitioned, Retrieval

EPOCHS = 10  # parts of the stream; items arrive at the start of one


def get_config():
    """towerflow's default config with the retrieval task and its data's options."""
    c = trainer.default_config()
    c.task.name = "examples.retrieval:RetrievalTask"
    c.task.width = 32  # the towers' output width
    c.task.temperature = 0.1  # logits are dot products / temperature
    c.task.log_q = True  # correct the in-batch negatives by the item table's counts
    c.task.uniform_negatives = 0  # more negatives a step, uniform over the items held
    c.task.negatives_column = ""  # a feature of more negative item ids ("": none)
    c.task.k = 100  # item ids the export returns per user
    c.task.partitions = 0  # an approximate index's k-means cells (0: brute force)
    c.task.probes = 1  # cells searched per query
    c.task.item_capacity = 4096  # rows of the item table
    c.task.string_ids = False  # user and item ids as strings ("user-11", "item-1000003")
    c.task.num_users = 2000
    c.task.num_items = 1000
    c.task.categories = 20  # item clusters in latent space
    c.task.factors = 8  # latent factors of users and items
    c.task.zipf_a = 1.1  # item popularity's Zipf exponent
    c.task.interactions = 40_000
    c.task.eval_fraction = 0.05  # the newest interactions, held out
    c.task.shuffle_buffer = 10_000  # interactions shuffled in training (0: in stream order)
    c.train.steps = 300
    c.train.global_batch_size = 256
    c.train.checkpoint_every = 150
    c.eval.every = 0
    c.eval.global_batch_size = 500
    c.optimizer.learning_rate = 0.02
    return c


def interactions(config, seed: int) -> dict[str, np.ndarray]:
    """The synthetic stream, oldest first: `user_id` and `item_id` (int64 raw ids).

    The stream runs in `EPOCHS` parts; a tenth of the items are there from the
    start and the others arrive at the start of one of the parts before the
    last two, evenly: each interaction picks among the items arrived by then.
    """
    rng = np.random.default_rng(seed)
    users, items, n = config.num_users, config.num_items, config.interactions
    centres = rng.normal(size=(config.categories, config.factors))
    item_factors = centres[rng.integers(config.categories, size=items)]
    item_factors += 0.3 * rng.normal(size=item_factors.shape)
    user_factors = rng.normal(size=(users, config.factors))
    popularity = -config.zipf_a * np.log1p(rng.permutation(items))  # log Zipf, random ranks
    arrival = rng.integers(1, EPOCHS - 1, size=items)
    arrival[: items // 10] = 0
    affinity = (user_factors @ item_factors.T + popularity[None, :]).astype(np.float32)
    who = rng.integers(users, size=n)
    epoch = np.arange(n) * EPOCHS // n
    chosen = np.empty(n, np.int64)
    for e in range(EPOCHS):  # each user's choice among the items arrived by then
        weights = np.exp(affinity - affinity.max(1, keepdims=True)) * (arrival <= e)[None, :]
        cumulative = np.cumsum(weights, axis=1)
        mine = np.flatnonzero(epoch == e)
        draws = rng.random(len(mine)) * cumulative[who[mine], -1]
        rows = cumulative[who[mine]]
        chosen[mine] = np.minimum((rows < draws[:, None]).sum(1), items - 1)
    return {
        "user_id": who.astype(np.int64) * 7919 + 11,
        "item_id": raw_item_ids(chosen),
    }


def raw_item_ids(positions: np.ndarray) -> np.ndarray:
    """The raw ids of items `0, 1, ...`: far apart, as a catalogue's are (int64)."""
    return positions.astype(np.int64) * 104_729 + 1_000_003


def as_strings(ids: np.ndarray, feature: str) -> np.ndarray:
    """Raw int64 ids as the strings `task.string_ids` gives them ("user-11", "item-1000003")."""
    return np.char.add(f"{feature.split('_')[0]}-", ids.astype(str)).astype(object)


class RetrievalTask(Task):
    """A user tower and an item tower over dynamic tables, trained on `interactions`."""

    def build_model(self) -> keras.Model:
        t = self.config.task
        query, item_tower = self.towers()
        softmax = InBatchSoftmax(
            t.temperature, t.log_q, True, t.uniform_negatives, t.negatives_column
        )
        index = Partitioned(t.partitions, t.probes) if t.partitions else None
        return Retrieval(query, item_tower, "item_id", softmax, t.k, index)

    def towers(self) -> tuple[keras.Model, keras.Model]:
        """The user tower (a dict of `user_id`) and the item tower (item ids)."""
        t = self.config.task
        key = "string" if t.string_ids else "int64"
        user_id = keras.Input((), dtype=key, name="user_id")
        users = DynamicEmbedding(t.width, key, capacity=4 * t.num_users, name="users")(user_id)
        query = keras.Model({"user_id": user_id}, keras.layers.Dense(t.width)(users), name="user")
        item_id = keras.Input((), dtype=key, name="item_id")
        items = DynamicEmbedding(t.width, key, capacity=t.item_capacity, name="items")(item_id)
        return query, keras.Model(item_id, items, name="item")

    def dataset_fn(self, input_context, split: str, global_batch_size: int) -> tf.data.Dataset:
        features, labels = self.examples(split)
        examples = tf.data.Dataset.from_tensor_slices((features, labels)).shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
        buffer = self.config.task.shuffle_buffer
        if split == "train" and buffer:
            examples = examples.shuffle(buffer, seed=self.config.seed)
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        return examples.batch(batch, drop_remainder=split == "train")

    def examples(self, split: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The split's interactions (features, and a label 1: every pair was observed)."""
        t = self.config.task
        stream = interactions(t, self.config.seed)
        cut = int(t.interactions * (1 - t.eval_fraction))
        part = slice(0, cut) if split == "train" else slice(cut, None)
        features = {name: values[part] for name, values in stream.items()}
        if t.string_ids:
            features = {name: as_strings(ids, name) for name, ids in features.items()}
        return features, np.ones(len(features["item_id"]), np.float32)


class PairsTask(RetrievalTask):
    """The same towers scored on labelled pairs with a sigmoid (the benchmark's baseline).

    Each interaction is a positive pair (label 1) followed by its user with an
    item drawn uniformly from the catalogue (label 0); the logit is the dot
    product of the towers.
    """

    def build_model(self) -> keras.Model:
        query, item_tower = self.towers()
        user_id = keras.Input((), dtype="int64", name="user_id")
        item_id = keras.Input((), dtype="int64", name="item_id")
        vectors = query({"user_id": user_id}) * item_tower(item_id)
        logit = keras.layers.Lambda(lambda x: keras.ops.sum(x, axis=-1, keepdims=True))(vectors)
        model = keras.Model({"user_id": user_id, "item_id": item_id}, logit, name="pairs")
        model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
        return model

    def examples(self, split: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        features, _ = super().examples(split)
        rng = np.random.default_rng(self.config.seed)
        drawn = rng.integers(self.config.task.num_items, size=len(features["item_id"]))
        drawn = raw_item_ids(drawn)
        if self.config.task.string_ids:
            drawn = as_strings(drawn, "item_id")
        negatives = {"user_id": features["user_id"], "item_id": drawn}
        both = {k: np.stack([features[k], negatives[k]], 1).reshape(-1) for k in features}
        labels = np.tile(np.array([1.0, 0.0], np.float32), len(features["item_id"]))
        return both, labels
