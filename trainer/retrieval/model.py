"""`Retrieval`: a query tower and an item tower over a dynamic table, as one Keras model.

The model is the query tower (its inputs are the query features, its output
the query vectors), compiled with its own loss and metrics, so towerflow's
loop trains, evaluates, checkpoints and exports it as it does any model a
user compiled (`trainer.loop.compiled.CompiledObjective`): no step of its own.

* Loss (`compute_loss`): the item tower runs on the data's item ids
  (`item_feature`), and the in-batch softmax (`InBatchSoftmax`) scores every
  query against every item of the (global) batch.
* Metrics (`compute_metrics`, eval only): each held-out query's rank of its
  item among every item the item table holds, exactly: recall@k for each of
  `ks` and the mean reciprocal rank, kept as sums (hits, reciprocal ranks,
  weight) so replicas and partial batches add up. An item the table does not
  hold counts as missed. The held items' vectors are computed once per eval
  pass (`HeldVectors`).
* Serving: called outside any strategy's scope and replicas and not
  training (as an export traces it), the model answers `{"item_ids",
  "scores", "query_vectors"}`, the top `k` items for each query from a
  `Catalogue` of every held item's vector, computed when the call is traced:
  each export (each version of a run's exports) holds the items held at its
  step. The loop cannot tell an export from an eval step that runs on the
  chief itself (`parameter_server`'s): that eval step's trace carries a
  catalogue too, which its answers use and its metrics ignore (they rank
  against the items held at each eval batch, from `query_vectors`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from strategies import tf_patches
from towerflow.errors import UserError
from trainer import layers
from trainer.layers import DynamicEmbedding, ShardedEmbedding, tables
from trainer.retrieval.held import HeldVectors
from trainer.retrieval.index import Catalogue, Partitioned
from trainer.retrieval.names import ItemNames
from trainer.retrieval.softmax import InBatchSoftmax, Negatives

KS = (10, 100)  # recall@k reported in eval


class RetrievalMetrics(keras.metrics.Metric):
    """Recall@k for each of `ks` and mean reciprocal rank, from weighted sums."""

    def __init__(self, ks: tuple[int, ...] = KS, name: str = "retrieval"):
        super().__init__(name=name)
        self.ks = tuple(ks)
        self.hits = [self.add_variable((), "zeros", name=f"hits_at_{k}") for k in self.ks]
        self.reciprocal_ranks = self.add_variable((), "zeros", name="reciprocal_ranks")
        self.weight = self.add_variable((), "zeros", name="weight")

    def update_state(self, ranks, held, sample_weight=None):
        """Adds queries whose items rank `ranks` (0: first), where `held` (else missed)."""
        weights = tf.ones_like(ranks, tf.float32) if sample_weight is None else sample_weight
        weights = tf.cast(weights, tf.float32)
        found = tf.cast(held, tf.float32) * weights
        for k, hits in zip(self.ks, self.hits, strict=True):
            hits.assign_add(tf.reduce_sum(found * tf.cast(ranks < k, tf.float32)))
        reciprocal = 1.0 / (tf.cast(ranks, tf.float32) + 1.0)
        self.reciprocal_ranks.assign_add(tf.reduce_sum(found * reciprocal))
        self.weight.assign_add(tf.reduce_sum(weights))

    def result(self) -> dict:
        total = tf.maximum(self.weight, 1e-12)
        named = {f"recall_at_{k}": h / total for k, h in zip(self.ks, self.hits, strict=True)}
        return {**named, "mrr": self.reciprocal_ranks / total}


class Retrieval(keras.Model):
    """Two towers trained with an in-batch softmax; serves the top `k` held items.

    A task returns it from `build_model()` (it comes compiled); its data yields
    the query features and `item_feature` (item ids, one per example: int64,
    or strings over a table of `key_dtype="string"`), and any label (not read).
    `examples/retrieval.py`'s `RetrievalTask` builds one; see docs/retrieval.md.

    Args:
      query_tower: a functional `keras.Model` of a dict of named query features.
      item_tower: a layer or model of item ids (1-D, int64 or strings) giving their
        vectors, of one `DynamicEmbedding` (the catalogue is the ids it holds,
        log-Q reads its counts; string ids are served as the strings, `ItemNames`)
        or one `ShardedEmbedding` (the catalogue is its row numbers).
      item_feature: the feature of the data holding each example's item id.
      softmax: the loss's options (`InBatchSoftmax`).
      k: the items the export returns per query.
      index: None (brute force) or `Partitioned` (an approximate index).
      ks: the k's of recall@k in eval.

    Raises:
      UserError: the item tower holds no dynamic or sharded table, `k` is more
        than the table can hold, or log-Q or uniform negatives over a table
        that keeps no counts.
    """

    def __init__(
        self,
        query_tower: keras.Model,
        item_tower: keras.layers.Layer,
        item_feature: str = "item_id",
        softmax: InBatchSoftmax | None = None,
        k: int = 100,
        index: Partitioned | None = None,
        ks: tuple[int, ...] = KS,
        name: str = "retrieval",
    ):
        table = item_table(item_tower)
        softmax = softmax or InBatchSoftmax()
        _check(table, softmax, k, index)
        inputs = {
            feature: keras.Input(tensor.shape[1:], dtype=tensor.dtype, name=feature)
            for feature, tensor in _named_inputs(query_tower).items()
        }
        super().__init__(inputs=inputs, outputs=query_tower(inputs), name=name)
        self.query_tower, self.item_tower, self.item_table = query_tower, item_tower, table
        self.item_feature, self.softmax, self.k, self.index = item_feature, softmax, k, index
        self.retrieval_metrics = RetrievalMetrics(ks)
        strings = isinstance(table, DynamicEmbedding) and table.key_dtype == "string"
        self.item_names = ItemNames(table) if strings else None
        # Eval's held vectors, once per pass: a dynamic table's clock says when they change.
        width = int(self.outputs[0].shape[-1])
        dynamic = isinstance(table, DynamicEmbedding)
        self._held = HeldVectors(table.capacity, width, self._held_now) if dynamic else None
        self._training = True  # what `compute_loss` was last traced for (`compute_metrics` reads)
        self.compile(loss=softmax)

    def call(self, inputs, training=None, mask=None):
        queries = super().call(inputs, training=training, mask=mask)
        if training or _in_a_strategy():
            return queries
        with tf.init_scope():  # eager: the items held now, whatever graph is being traced
            catalogue = self.catalogue()
        ids, scores = catalogue.top_k(queries, self.k)
        return {"item_ids": ids, "scores": scores, "query_vectors": queries}

    def catalogue(self) -> Catalogue:
        """Every item the table holds and its vector now (eager), indexed by `index`.

        String ids whose string is not known (a checkpoint of names lost) are
        left out, with one line saying how many.
        """
        keys = self.catalogue_ids()
        ids = self.raw_ids(keys)
        if self.item_names is not None:
            self.item_names.prune(keys.numpy())
            unnamed = int(tf.reduce_sum(tf.cast(tf.strings.length(ids) == 0, tf.int32)))
            if unnamed:
                print(
                    f"retrieval: {unnamed} items the item table holds have no known raw string "
                    "id (not trained since their names were lost): this catalogue leaves them out",
                    flush=True,
                )
                ids = tf.boolean_mask(ids, tf.strings.length(ids) > 0)
        vectors = self.item_tower(ids, training=False)
        index, held = self.index, int(tf.size(ids))
        if index is not None and index.partitions > held:
            print(
                f"retrieval: the item table holds {held} items, fewer than the index's "
                f"{index.partitions} partitions: this export searches them all (brute force)",
                flush=True,
            )
            index = None
        return Catalogue(ids.numpy(), np.asarray(vectors), index)

    def catalogue_ids(self) -> tf.Tensor:
        """The keys of the items the table holds (int64: a dynamic table's, or a sharded one's
        rows; string ids' fingerprints, `tables.key64`)."""
        if isinstance(self.item_table, DynamicEmbedding):
            return self.item_table.held_ids()
        return tf.range(self.item_table.input_dim, dtype=tf.int64)

    def raw_ids(self, keys: tf.Tensor) -> tf.Tensor:
        """The raw item ids of int64 `keys`: themselves, or the strings of a string table."""
        return keys if self.item_names is None else self.item_names.of(keys)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """This replica's share of the batch's in-batch softmax loss (Keras's `compute_loss`)."""
        self._training = training
        self.softmax.check_features(x)
        ids = _item_ids(x, self.item_feature)
        with _variables_themselves():
            items = self.item_tower(ids, training=training)
            first = [items]  # the batch counted first (admission), and its names noted
            if training and self.item_names is not None:
                first.append(self.item_names.remember(ids))
            with tf.control_dependencies(first):
                extra = self._negatives(x, ids) if training else None
        losses = self.softmax.per_example_loss(_queries(y_pred), items, tables.key64(ids), extra)
        weights = tf.ones_like(losses) if sample_weight is None else sample_weight
        penalty = tf.add_n([tf.cast(x, tf.float32) for x in self.losses] or [0.0])
        mean = tf.reduce_sum(tf.cast(weights, tf.float32) * losses) / tf.cast(
            tf.size(losses), tf.float32
        )
        return (mean + penalty) / tf.distribute.get_strategy().num_replicas_in_sync

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Eval only: each query's rank of its item among every item the table holds."""
        if self._training:
            return {}
        keys = tables.key64(_item_ids(x, self.item_feature))
        with _variables_themselves():
            if self._held is None:  # a sharded table: no clock, its vectors every batch
                held_keys, held_vectors = self._held_now()
            else:
                held_keys, held_vectors = self._held.read(self.item_table.table.now())
        scores = tf.matmul(tf.cast(_queries(y_pred), tf.float32), held_vectors, transpose_b=True)
        mine = tf.equal(keys[:, None], held_keys[None, :])
        held = tf.reduce_any(mine, 1)
        # The item's own score as the product gave it: a tie with itself never counts.
        positive = tf.reduce_max(tf.where(mine, scores, -np.inf), 1)
        ranks = tf.reduce_sum(tf.cast(scores > positive[:, None], tf.int32), 1)
        self.retrieval_metrics.update_state(ranks, held, sample_weight)
        return {}

    def _held_now(self) -> tuple[tf.Tensor, tf.Tensor]:
        """The keys of the items the table holds, and their vectors now (float32)."""
        keys = self.catalogue_ids()
        return keys, tf.cast(self.item_tower(self.raw_ids(keys), training=False), tf.float32)

    def get_metrics_result(self) -> dict:
        """Keras's, without the retrieval metrics where no eval example was added (training)."""
        results = super().get_metrics_result()
        if float(self.retrieval_metrics.weight) == 0:
            results = {k: v for k, v in results.items() if not k.startswith(("recall_at", "mrr"))}
        return results

    def _negatives(self, x: dict, ids: tf.Tensor) -> Negatives | None:
        """The frequencies log-Q needs and the extra negatives, for a training batch."""
        softmax, table = self.softmax, self.item_table
        if not (softmax.log_q or softmax.uniform_negatives or softmax.negatives_column):
            return None
        frequencies = table.frequencies(ids) if softmax.log_q else None
        more, held = [], None
        if softmax.uniform_negatives:
            pool = self.raw_ids(self.catalogue_ids())
            held = tf.cast(tf.size(pool), tf.float32)
            pool = tf.concat([pool, ids[:1]], 0)  # an empty table draws the batch's first
            draws = tf.random.uniform(
                [softmax.uniform_negatives], 0, tf.maximum(tf.size(pool) - 1, 1), tf.int32
            )
            more.append(tf.gather(pool, draws))
        if softmax.negatives_column:
            column = _flat_ids(x[softmax.negatives_column])
            if column.dtype != ids.dtype:
                raise UserError(
                    f"`negatives_column` '{softmax.negatives_column}' holds {column.dtype.name} "
                    f"ids and `item_feature` '{self.item_feature}' {ids.dtype.name} ids; give "
                    "both the item ids' type."
                )
            more.append(column)
        if not more:
            return Negatives(frequencies)
        extra_ids = tf.concat(more, 0)
        extra_frequencies = None
        if softmax.log_q:
            extra_frequencies = table.frequencies(extra_ids)
        return Negatives(
            frequencies,
            tables.key64(extra_ids),
            self.item_tower(extra_ids, training=False),
            extra_frequencies,
            softmax.uniform_negatives,
            held,
        )


def item_table(item_tower: keras.layers.Layer) -> DynamicEmbedding | ShardedEmbedding:
    """The one dynamic (or else sharded) table of `item_tower`.

    Raises:
      UserError: it holds none, or several.
    """
    dynamic = layers.dynamic_tables(item_tower)
    sharded = [x for x in layers.portable_layers(item_tower) if isinstance(x, ShardedEmbedding)]
    found = dynamic or sharded
    if len(found) == 1:
        return found[0]
    if not found:
        kinds = sorted({type(x).__name__ for x in tf_patches.flat_layers(item_tower)})
        raise UserError(
            f"The item tower '{item_tower.name}' holds no `DynamicEmbedding` or "
            f"`ShardedEmbedding` (its layers: {', '.join(kinds)}); retrieval serves the items a "
            "table holds: look the item ids up in a `trainer.layers.DynamicEmbedding`."
        )
    names = ", ".join(f"'{x.name}'" for x in found)
    raise UserError(
        f"The item tower '{item_tower.name}' holds several tables ({names}); retrieval's "
        "catalogue is the ids of one: look the item ids up in one table."
    )


def _check(table, softmax: InBatchSoftmax, k: int, index: Partitioned | None) -> None:
    """Raises `UserError` for a table, `k` or index retrieval cannot use."""
    if isinstance(table, DynamicEmbedding):
        size, what = table.capacity, "`capacity`"
    else:
        size, what = table.input_dim, "`input_dim`"
        if softmax.log_q or softmax.uniform_negatives:
            raise UserError(
                f"The item table '{table.name}' is a `ShardedEmbedding`, which keeps no counts "
                "or ids held; set `log_q=False` and `uniform_negatives=0`, or use a "
                "`DynamicEmbedding`."
            )
    if not 1 <= k <= size:
        raise UserError(
            f"`k` ({k}) is more than the item table '{table.name}' can hold ({what} {size}); "
            f"use a `k` of at most {size}."
        )
    if index is not None and index.partitions > size:
        raise UserError(
            f"`Partitioned.partitions` ({index.partitions}) is more than the item table "
            f"'{table.name}' can hold ({what} {size}); use at most {size}."
        )


def _named_inputs(query_tower: keras.Model) -> dict:
    inputs = getattr(query_tower, "input", None)
    if not isinstance(inputs, dict):
        raise UserError(
            f"The query tower '{query_tower.name}' must be a functional `keras.Model` of a "
            "dict of named features (`keras.Model({'user_id': keras.Input(...)}, vector)`)."
        )
    return inputs


def _item_ids(features: dict, item_feature: str) -> tf.Tensor:
    """The batch's item ids, 1-D: int64, or strings."""
    if item_feature not in features:
        names = ", ".join(f"`{name}`" for name in sorted(features))
        raise UserError(
            f"`item_feature` '{item_feature}' is not a feature of the data ({names}); name the "
            "feature that holds each example's item id."
        )
    return _flat_ids(features[item_feature])


def _flat_ids(ids) -> tf.Tensor:
    """`ids` 1-D: strings as they are, integers as int64."""
    ids = tf.reshape(tf.convert_to_tensor(ids), [-1])
    return ids if ids.dtype == tf.string else tf.cast(ids, tf.int64)


def _variables_themselves() -> keras.StatelessScope:
    """A scope in which the model's variables read as themselves, not a stateless scope's values.

    The loop computes a compiled model's loss and metrics inside a stateless
    scope that maps every variable to a tensor of its value
    (`trainer.loop.compiled`); a `DynamicEmbedding`'s lookup needs its
    variables' handles. An empty scope inside it maps none.
    """
    return keras.StatelessScope()


def _queries(outputs) -> tf.Tensor:
    """The query vectors of the model's outputs (the tensor, or the answer's `query_vectors`)."""
    return outputs["query_vectors"] if isinstance(outputs, dict) else outputs


def _in_a_strategy() -> bool:
    """Whether a strategy's scope is open or its replica runs this call (a step, mostly).

    Outside both, the replica context is the default one, which no replica
    enters (the default strategy's `run` enters a plain `ReplicaContext`): an
    export's trace, or an eval step that runs on the chief itself (the
    `parameter_server` plugin's), whose answer the metrics then ignore.
    """
    replica = tf.distribute.get_replica_context()
    return (
        tf.distribute.has_strategy()
        or replica is None
        or type(replica) is tf.distribute.ReplicaContext
    )
