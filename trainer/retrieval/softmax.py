"""The retrieval loss: a softmax over the batch's items, corrected for how often each is shown.

Each query's positive is its own item; the negatives are the other items of
the batch (under `mirrored` and `multi_worker` the whole global batch's,
gathered from every replica: `ReplicaContext.all_gather`, whose gradient
brings each replica its items' share of every replica's loss), and
optionally more: ids drawn uniformly from those the item table holds, or a
column of the data. Popular items are in-batch negatives more often than
rare ones, so without a correction the model learns to score them down;
the log-Q correction subtracts from each candidate's logit the log of its
expected count among the candidates, from the item table's own frequencies
(`DynamicEmbedding.frequencies`: the count it keeps for admission and
eviction, decayed, over the decayed total):

    q_j = global_batch * p_j + extra_uniform / items_held    (and 1 for a column's negative)

An item that appears twice in the candidates (an accidental hit: the same
item for two queries, or drawn again as an extra negative) is not a negative
of the query whose positive it is: its logit is masked.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from towerflow.errors import UserError

_MASKED = -1e9  # the logit of a candidate that is not a negative (an accidental hit)


@dataclasses.dataclass(frozen=True)
class InBatchSoftmax:
    """The in-batch softmax's options; `per_example_loss` computes it.

    Attributes:
      temperature: logits are dot products divided by it (> 0).
      log_q: subtract the log of each candidate's expected count among the
        candidates, from the item table's frequencies.
      remove_accidental_hits: mask a candidate that is the query's own item
        but not its positive's position.
      uniform_negatives: this many more negatives a step, drawn uniformly from
        the ids the item table holds (shared by the replica's queries).
      negatives_column: a feature of the data holding more negative item ids
        per example (one, or a list per example); "" for none. Each replica's
        are shared by its queries.
    """

    temperature: float = 1.0
    log_q: bool = True
    remove_accidental_hits: bool = True
    uniform_negatives: int = 0
    negatives_column: str = ""

    def __post_init__(self):
        if not self.temperature > 0:
            raise UserError(
                f"`temperature` ({self.temperature}) of the retrieval softmax must be > 0; "
                "e.g. 0.05 (logits are dot products divided by it)."
            )
        if self.uniform_negatives < 0:
            raise UserError(
                f"`uniform_negatives` ({self.uniform_negatives}) must be >= 0; 0 draws none."
            )

    def check_features(self, features: dict) -> None:
        """Raises `UserError` if `negatives_column` is not among the data's `features`."""
        column = self.negatives_column
        if column and column not in features:
            names = ", ".join(f"`{name}`" for name in sorted(features))
            raise UserError(
                f"`negatives_column` '{column}' is not a feature of the data ({names}); name "
                'one of them, or set `negatives_column=""` for in-batch negatives only.'
            )

    def per_example_loss(self, queries, items, item_ids, extra=None) -> tf.Tensor:
        """The softmax cross-entropy of each query against its item, `[batch]` float32.

        Args:
          queries: `[batch, d]` this replica's query vectors.
          items: `[batch, d]` the vectors of their items.
          item_ids: `[batch]` int64 keys of their items (`tables.key64`).
          extra: `Negatives` beyond the batch's items, or None.
        """
        replica = tf.distribute.get_replica_context()
        local = tf.shape(item_ids)[0]
        offset, all_ids = 0, item_ids
        frequencies = extra.batch_frequencies if extra is not None else None
        if replica is not None and replica.num_replicas_in_sync > 1:
            offset = replica.replica_id_in_sync_group * local  # train batches are equal
            items = replica.all_gather(items, 0)
            all_ids = replica.all_gather(item_ids, 0)  # apart: one gather takes one dtype
            if frequencies is not None:
                frequencies = replica.all_gather(frequencies, 0)
        queries = tf.cast(queries, tf.float32)
        logits = tf.matmul(queries, tf.cast(items, tf.float32), transpose_b=True)
        labels = offset + tf.range(local)
        candidate_ids = all_ids
        if extra is not None and extra.vectors is not None:
            more = tf.matmul(queries, tf.cast(extra.vectors, tf.float32), transpose_b=True)
            logits = tf.concat([logits, more], 1)
            candidate_ids = tf.concat([all_ids, extra.ids], 0)
        logits /= self.temperature
        if self.log_q and frequencies is not None:
            logits -= tf.math.log(extra.expected_counts(frequencies, tf.shape(all_ids)[0]))[None]
        if self.remove_accidental_hits:
            same = tf.equal(item_ids[:, None], candidate_ids[None, :])
            own = tf.one_hot(labels, tf.shape(candidate_ids)[0], on_value=True, off_value=False)
            logits = tf.where(same & ~own, _MASKED, logits)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)


@dataclasses.dataclass
class Negatives:
    """What the softmax needs beyond the batch: frequencies, and any extra negatives.

    Attributes:
      batch_frequencies: `[batch]` float32, this replica's items' frequencies
        in the item table (None without log-Q).
      ids: `[m]` int64 keys of the extra negatives (uniform draws, then a column's).
      vectors: `[m, d]` their vectors (None: none).
      frequencies: `[m]` the uniform draws' frequencies, then 0 for a column's.
      uniform: how many of them are uniform draws (the rest come from a column).
      items_held: the ids the table held when they were drawn (float32).
    """

    batch_frequencies: tf.Tensor | None
    ids: tf.Tensor | None = None
    vectors: tf.Tensor | None = None
    frequencies: tf.Tensor | None = None
    uniform: int = 0
    items_held: tf.Tensor | None = None

    def expected_counts(self, batch_frequencies: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
        """Each candidate's expected count among the candidates (the batch's, then the extra's).

        A batch item or uniform draw: `batch * p + uniform / items_held`; a
        column's negative: 1 (nothing is known of how the column was drawn).
        """
        batch = tf.cast(batch, tf.float32)
        drawn = 0.0
        if self.uniform:
            drawn = self.uniform / tf.maximum(self.items_held, 1.0)
        counts = [batch * batch_frequencies + drawn]
        if self.ids is not None:
            from_table = tf.range(tf.size(self.ids)) < self.uniform
            counts.append(tf.where(from_table, batch * self.frequencies + drawn, 1.0))
        return tf.maximum(tf.concat(counts, 0), 1e-12)
