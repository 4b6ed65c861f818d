"""Synthetic click-through logs (`data.name=ctr`): categorical ids in, click or not out."""

from __future__ import annotations

import math

import ml_collections
import numpy as np
import tensorflow as tf

from strategies.errors import UserError
from trainer.data.base import Dataset, check_positive, indexed_dataset, register

_CTR_SEED = 4321  # fixes the ctr examples, their hashing and the hidden click model


@register("ctr")
def _ctr(config: ml_collections.ConfigDict) -> Dataset:
    """Synthetic click-through logs: categorical ids in, click (1) or not (0) out.

    Each of `num_fields` fields takes one of `ids_per_field` values, drawn with a
    probability that falls as 1/rank (a few values are common, most rare, as in
    real logs); a fixed permutation hashes every (field, value) into one shared
    vocabulary of `vocab_size` ids. A hidden click model, one weight per id plus
    a bias, gives the click logit, and the label is a Bernoulli draw of its
    sigmoid. `x` holds the ids as float32 (exact below 2**24).
    """
    options = config.ctr
    num_examples = check_positive("data.ctr.num_examples", options.num_examples)
    fields = check_positive("data.ctr.num_fields", options.num_fields)
    per_field = check_positive("data.ctr.ids_per_field", options.ids_per_field)
    vocab = check_positive("data.ctr.vocab_size", options.vocab_size)
    if not fields * per_field <= vocab <= 2**24:
        raise UserError(
            f"`data.ctr.vocab_size` ({vocab}) must hold `num_fields` x `ids_per_field` "
            f"({fields * per_field}) ids and be at most 2**24 (exact as float32); "
            "set e.g. `--config.data.ctr.vocab_size=200000`."
        )
    hidden = np.random.RandomState(_CTR_SEED).normal(0.0, options.weight_scale, size=vocab)
    weights = tf.constant(hidden, tf.float32)
    field_index = tf.range(fields, dtype=tf.int64)

    def uniforms(index: tf.Tensor) -> tf.Tensor:
        seed = tf.stack([tf.constant(_CTR_SEED, tf.int64), index])
        return tf.random.stateless_uniform([fields + 1], seed)  # a value per field, a click

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        draws = tf.map_fn(uniforms, indices, fn_output_signature=tf.float32)
        # exp(u * ln n) - 1 for uniform u: rank r in [0, n) with probability ~ 1 / (r + 1).
        ranks = tf.cast(tf.exp(draws[:, :fields] * math.log(per_field)), tf.int64) - 1
        keys = tf.minimum(ranks, per_field - 1) * fields + field_index
        ids = tf.raw_ops.RandomIndexShuffle(
            index=tf.reshape(keys, [-1]),
            seed=tf.constant([_CTR_SEED, 0, 0], tf.int64),
            max_index=tf.constant(vocab - 1, tf.int64),
            rounds=4,
        )
        ids = tf.reshape(ids, [-1, fields])
        logits = tf.reduce_sum(tf.gather(weights, ids), axis=1) + options.bias
        labels = tf.cast(draws[:, fields] < tf.sigmoid(logits), tf.int32)
        return tf.cast(ids, tf.float32), labels

    return indexed_dataset(config, num_examples, (fields,), 2, decode, "`data.ctr`")
