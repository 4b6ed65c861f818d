"""Synthetic click-through logs (`data.name=ctr`): categorical ids in, click or not out."""

from __future__ import annotations

import math

import ml_collections
import numpy as np
import tensorflow as tf

from towerflow.errors import UserError
from trainer.data.base import Dataset, check_positive, indexed_dataset, register

_CTR_SEED = 4321  # fixes the ctr examples, their hashing and the hidden click model

ID_SPACES = ("hashed", "raw")  # `data.ctr.id_space`
ID_DTYPES = ("int64", "string")  # `data.ctr.id_dtype` (raw ids only)
_MOST_RAW_RANKS = 2**40  # raw ids: `ids_per_field` at most this (keys stay below 2**62)
_MOST_RAW_FIELDS = 4096  # raw ids: `num_fields` at most this (for the same reason)
# The raw key of item k of field f is (k + _ITEM_OFFSET) * (fields + 1) + f: items are
# `time - rank`, so they go negative; the offset keeps keys positive.
_ITEM_OFFSET = 2**41
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: a key plus it is never 0
_WEIGHT_SALT = 0x5851F42D4C957F2D  # makes the hidden weight of an id another hash of it


@register("ctr")
def _ctr(config: ml_collections.ConfigDict) -> Dataset:
    """Synthetic click-through logs: categorical ids in, click (1) or not (0) out.

    Each of `num_fields` fields takes a value of popularity rank r, drawn with a
    probability that falls as 1/(r + 1)**`zipf_a` over `ids_per_field` ranks (a
    few values are common, most rare, as in real logs). A hidden click model,
    one weight per id plus a bias, gives the click logit, and the label is a
    Bernoulli draw of its sigmoid.

    `id_space` "hashed": a fixed permutation hashes every (field, value) into one
    shared vocabulary of `vocab_size` ids; `x` holds them as float32 (exact below
    2**24). "raw": each (field, item) is an int64 id anywhere in the 64-bit
    space (a bijective mix of the pair; never 0), or its decimal string
    (`id_dtype`), so a table of fewer rows than ids must collide or choose.
    With `drift_every` > 0 popularity drifts: every `drift_every` examples a new
    item of each field enters at rank 0 and every other item falls one rank,
    so new ids keep appearing and old ones fade (the eval split, the last
    indices, is the future of the training data). With `multi_valued` = m > 0,
    the last m columns of `x` are a list of 1 to m ids of one more field
    (e.g. the items a user saw), padded with 0 (or "") after its length; the
    hidden model adds their weights over sqrt(length).
    """
    options = config.ctr
    num_examples = check_positive("data.ctr.num_examples", options.num_examples)
    fields = check_positive("data.ctr.num_fields", options.num_fields)
    per_field = check_positive("data.ctr.ids_per_field", options.ids_per_field)
    vocab = check_positive("data.ctr.vocab_size", options.vocab_size)
    zipf_a = _check_options(options)
    if options.id_space == "raw":
        decode = _raw_decode(options, fields, per_field, zipf_a)
        width = fields + options.multi_valued
        return indexed_dataset(
            config, num_examples, (width,), 2, decode, "`data.ctr`", dtype=options.id_dtype
        )
    if not fields * per_field <= vocab <= 2**24:
        raise UserError(
            f"`data.ctr.vocab_size` ({vocab}) must hold `num_fields` x `ids_per_field` "
            f"({fields * per_field}) ids and be at most 2**24 (exact as float32); "
            "set e.g. `--config.data.ctr.vocab_size=200000`."
        )
    hidden = np.random.RandomState(_CTR_SEED).normal(0.0, options.weight_scale, size=vocab)
    weights = tf.constant(hidden, tf.float32)
    field_index = tf.range(fields, dtype=tf.int64)

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        draws = _uniforms(indices, fields + 1)  # a value per field, a click
        keys = _zipf_ranks(draws[:, :fields], per_field, zipf_a) * fields + field_index
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


def _check_options(options: ml_collections.ConfigDict) -> float:
    """The raw-id options, checked; returns `zipf_a` as a float."""
    if options.id_space not in ID_SPACES:
        raise UserError(
            f"`data.ctr.id_space` '{options.id_space}' is not an id space; use one of "
            f"{', '.join(ID_SPACES)}."
        )
    if options.zipf_a <= 0:
        raise UserError(
            f"`data.ctr.zipf_a` ({options.zipf_a}) must be > 0 (popularity falls as "
            "1/rank**zipf_a); set e.g. `--config.data.ctr.zipf_a=1.2`."
        )
    for field in ("drift_every", "multi_valued"):
        if options[field] < 0:
            raise UserError(
                f"`data.ctr.{field}` ({options[field]}) must be >= 0 (0: off); "
                f"set e.g. `--config.data.ctr.{field}=0`."
            )
    if options.id_dtype not in ID_DTYPES:
        raise UserError(
            f"`data.ctr.id_dtype` '{options.id_dtype}' is not an id dtype; use one of "
            f"{', '.join(ID_DTYPES)}."
        )
    if options.id_space == "hashed":
        raw_only = {"drift_every": 0, "multi_valued": 0, "id_dtype": "int64"}
        for field, off in raw_only.items():
            if options[field] != off:
                raise UserError(
                    f"`data.ctr.{field}` ({options[field]}) needs raw ids; set "
                    "`--config.data.ctr.id_space=raw` (or leave it at "
                    f"{off!r} for hashed ids)."
                )
    elif options.ids_per_field > _MOST_RAW_RANKS or options.num_fields > _MOST_RAW_FIELDS:
        raise UserError(
            f"`data.ctr.ids_per_field` ({options.ids_per_field}) must be at most 2**40 and "
            f"`data.ctr.num_fields` ({options.num_fields}) at most {_MOST_RAW_FIELDS} for "
            "raw ids; use smaller values."
        )
    return float(options.zipf_a)


def _uniforms(indices: tf.Tensor, count: int) -> tf.Tensor:
    """`count` uniform draws in [0, 1) for each example index: example i alone fixes them."""

    def draws(index: tf.Tensor) -> tf.Tensor:
        seed = tf.stack([tf.constant(_CTR_SEED, tf.int64), index])
        return tf.random.stateless_uniform([count], seed)

    return tf.map_fn(draws, indices, fn_output_signature=tf.float32)


def _zipf_ranks(uniforms: tf.Tensor, ranks: int, a: float) -> tf.Tensor:
    """Ranks in [0, `ranks`) with probability about proportional to 1/(rank + 1)**a.

    The inverse of the distribution function of a power law x**-a on [1, ranks),
    floored, in the precision of `uniforms`; for a = 1, exp(u ln n) (the hashed
    source's draws, kept bit for bit).
    """
    if a == 1:
        x = tf.exp(uniforms * math.log(ranks))
    else:
        x = (1.0 + uniforms * (ranks ** (1.0 - a) - 1.0)) ** (1.0 / (1.0 - a))
    return tf.minimum(tf.cast(x, tf.int64) - 1, ranks - 1)


def _mix(keys: tf.Tensor) -> tf.Tensor:
    """splitmix64's finalizer: a bijection of uint64 that spreads nearby keys over 64 bits."""
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        keys = _xor_shifted(keys, shift) * tf.constant(factor, tf.uint64)
    return _xor_shifted(keys, 31)


def _xor_shifted(keys: tf.Tensor, shift: int) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(keys, tf.bitwise.right_shift(keys, tf.constant(shift, tf.uint64)))


def raw_ids(items: tf.Tensor, fields: tf.Tensor, num_fields: int) -> tf.Tensor:
    """The int64 id of item `items` (int64, any sign) of field `fields`: spread, never 0."""
    keys = (items + _ITEM_OFFSET) * (num_fields + 1) + fields
    return tf.bitcast(_mix(tf.cast(keys, tf.uint64) + _GOLDEN_GAMMA), tf.int64)


def hidden_weights(ids: tf.Tensor, scale: float) -> tf.Tensor:
    """The hidden click model's weight of each raw id: normal(0, `scale`), a function of the id."""
    salt = tf.constant(_WEIGHT_SALT, tf.uint64)
    salted = tf.bitwise.bitwise_xor(tf.bitcast(ids, tf.uint64), salt)
    top = tf.bitwise.right_shift(_mix(salted), tf.constant(40, tf.uint64))  # 24 bits
    uniform = (tf.cast(top, tf.float64) + 0.5) / 2**24
    return tf.cast(scale * tf.math.ndtri(uniform), tf.float32)


def _raw_decode(options: ml_collections.ConfigDict, fields: int, per_field: int, zipf_a: float):
    """Examples of raw ids: `fields` ids, then a list of up to `multi_valued` ids, padded."""
    draw = _raw_examples(options, fields, per_field, zipf_a)
    strings = options.id_dtype == "string"

    def decode(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        ids, _, labels = draw(indices)
        if strings:
            ids = tf.where(ids == 0, "", tf.strings.as_string(ids))
        return ids, labels

    return decode


def _raw_examples(options: ml_collections.ConfigDict, fields: int, per_field: int, zipf_a: float):
    """A function of example indices: their int64 ids (padded), click logits and labels."""
    listed = options.multi_valued
    columns = fields + listed
    # Column j's field: its own for the single ids, field `fields` for the whole list.
    field_of = tf.constant(list(range(fields)) + [fields] * listed, tf.int64)
    drift_every, scale, bias = options.drift_every, options.weight_scale, options.bias

    def draw(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        draws = _uniforms(indices, columns + 2)  # a rank per column, a click, a list length
        # float64: ranks up to 2**40 stay distinct.
        ranks = _zipf_ranks(tf.cast(draws[:, :columns], tf.float64), per_field, zipf_a)
        time = indices[:, None] // drift_every if drift_every else tf.zeros_like(indices)[:, None]
        ids = raw_ids(time - ranks, field_of, fields)
        weights = hidden_weights(ids, scale)
        logits = tf.reduce_sum(weights[:, :fields], axis=1) + bias
        if listed:
            length = 1 + tf.cast(draws[:, columns + 1] * listed, tf.int64)  # 1, ..., listed
            present = tf.range(listed, dtype=tf.int64)[None, :] < length[:, None]
            on = tf.cast(present, tf.float32)
            listed_sum = tf.reduce_sum(weights[:, fields:] * on, axis=1)
            logits += listed_sum / tf.sqrt(tf.cast(length, tf.float32))
            padded = tf.concat([tf.ones_like(ids[:, :fields], tf.bool), present], axis=1)
            ids = tf.where(padded, ids, tf.zeros_like(ids))
        labels = tf.cast(draws[:, columns] < tf.sigmoid(logits), tf.int32)
        return ids, logits, labels

    return draw


def hidden_clicks(options: ml_collections.ConfigDict, indices: tf.Tensor):
    """The hidden click model's probability and the label of raw-id examples `indices`.

    `options`: `data.ctr` with `id_space` "raw". The probabilities are what no
    model can beat on these examples: their AUC is the stream's ceiling.
    """
    draw = _raw_examples(
        options, options.num_fields, options.ids_per_field, _check_options(options)
    )
    _, logits, labels = draw(tf.cast(indices, tf.int64))
    return tf.sigmoid(logits), labels
