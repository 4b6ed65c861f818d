"""`DynamicEmbedding`: lookups of raw ids, combiners, bad arguments, sparse optimizer updates."""

import ast
import contextlib
import io
import json
import pathlib
from typing import NamedTuple

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
from tests.fresh_process import run_script
from tests.helpers import (
    IN_PROCESS_CLUSTER,
    assert_exit,
    config_flags,
    launched,
    tensorboard_scalars,
)
from tests.test_models import tiny_ctr_config
from towerflow.errors import UserError
from trainer import layers
from trainer.layers import DynamicEmbedding, tables
from trainer.loop import optim, train
from trainer.loop.checkpoints import Checkpointer

WIDTH = 4


def _rows_of(layer: DynamicEmbedding, ids) -> np.ndarray:
    """The vectors `layer` gives `ids` now, changing nothing."""
    return layer(tf.constant(ids, tf.int64), training=False).numpy()


def test_an_admitted_id_reads_its_initial_row_at_once_and_others_the_default_row():
    layer = DynamicEmbedding(WIDTH, min_count=2, seed=5)
    ids = tf.constant([[2**63 - 1, 7], [7, -3]], tf.int64)
    out = layer(ids, training=True).numpy()  # 7 seen twice: admitted, read at this step
    assert out.shape == (2, 2, WIDTH)
    initial = tables.initial_rows(5, tf.constant([7], tf.int64), WIDTH).numpy()[0]
    np.testing.assert_array_equal(out[0, 1], initial)
    np.testing.assert_array_equal(out[1, 0], initial)
    np.testing.assert_array_equal(out[0, 0], np.zeros(WIDTH))  # the default row starts at 0
    np.testing.assert_array_equal(out[1, 1], np.zeros(WIDTH))
    np.testing.assert_array_equal(_rows_of(layer, [12345]), np.zeros((1, WIDTH)))


def test_the_first_lookup_of_an_admitted_id_trains_its_row():
    layer = DynamicEmbedding(WIDTH, seed=2)
    optimizer = optim.OPTIMIZERS["sgd"](1.0, None)
    optimizer.build(_built(layer))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([9], tf.int64), training=True))
    grads = tape.gradient(loss, layer.trainable_variables)
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    initial = tables.initial_rows(2, tf.constant([9], tf.int64), WIDTH).numpy()[0]
    np.testing.assert_allclose(_rows_of(layer, [9])[0], initial - 1.0, rtol=1e-6)
    np.testing.assert_array_equal(layer.default_row.numpy(), np.zeros(WIDTH))


@pytest.mark.parametrize("fallback_rows", [0, 8])
def test_under_mixed_precision_rows_stay_float32_train_and_give_the_compute_dtype(fallback_rows):
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        layer = DynamicEmbedding(WIDTH, seed=2, fallback_rows=fallback_rows)
        optimizer = optim.OPTIMIZERS["sgd"](1.0, None)
        optimizer.build(_built(layer))

        @tf.function  # traced, as a step is: the rows' handle must be there too
        def step(ids):
            with tf.GradientTape() as tape:
                out = layer(ids, training=True)
                loss = tf.reduce_sum(tf.cast(out, tf.float32))
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            return out

        assert step(tf.constant([9], tf.int64)).dtype == tf.bfloat16
    finally:
        keras.config.set_dtype_policy(before)
    assert [v.dtype for v in layer.trainable_variables] == ["float32"] * 2
    initial = tables.initial_rows(2, tf.constant([9], tf.int64), WIDTH).numpy()[0]
    slot = int(layer.table.find(tf.constant([9], tf.int64))[0][0])
    np.testing.assert_allclose(layer.rows.numpy()[slot], initial - 1.0, rtol=1e-6)


def test_ids_without_a_row_train_the_default_row_by_what_they_read():
    layer = DynamicEmbedding(WIDTH, min_count=2, seed=1)
    ids = tf.constant([1, 2, 2, 3], tf.int64)  # 2 is admitted; 1 and 3 read the default row
    weights = tf.constant([[1.0], [1.0], [1.0], [2.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True) * weights)
    grads = tape.gradient(loss, [layer.default_row, layer.rows])
    np.testing.assert_allclose(grads[0], np.full(WIDTH, 3.0))
    slot = int(layer.table.find(tf.constant([2], tf.int64))[0][0])
    rows = tf.math.unsorted_segment_sum(grads[1].values, grads[1].indices, layer.capacity + 1)
    np.testing.assert_allclose(rows[slot], np.full(WIDTH, 2.0))


@pytest.mark.parametrize(("hashes", "combiner"), [(1, "mean"), (2, "mean"), (2, "sum")])
def test_ids_without_a_row_read_and_train_the_mean_or_sum_of_their_fallback_rows(hashes, combiner):
    layer = DynamicEmbedding(
        WIDTH,
        capacity=1,
        eviction=None,
        fallback_rows=3,
        fallback_hashes=hashes,
        fallback_combiner=combiner,
    )
    optimizer = optim.OPTIMIZERS["sgd"](1.0, None)
    optimizer.build(_built(layer))
    ids = [1, 2, 3, 4, 5, 6]  # 1 takes the only row; the rest are refused
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant(ids, tf.int64), training=True))
    grads = tape.gradient(loss, layer.trainable_variables)
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    buckets = tables.buckets_of(tf.constant(ids[1:], tf.int64), 3, hashes).numpy()
    assert buckets.shape == (5, hashes)
    share = 1.0 / hashes if combiner == "mean" else 1.0  # each row's part of an id's vector
    lookups = np.bincount(buckets.ravel(), minlength=3).astype(np.float32)
    np.testing.assert_allclose(layer.fallback.numpy(), -share * lookups[:, None] * np.ones(WIDTH))
    read = share * layer.fallback.numpy()[buckets].sum(axis=1)
    np.testing.assert_allclose(_rows_of(layer, ids[1:]), read)
    width_bytes = WIDTH * 4 * (1 + 0)  # sgd: no slots
    described = layer.describe()
    assert described["fallback_rows"] == 3 and described["fallback_hashes"] == hashes
    seen = f"seen_bits {tables.SEEN_BITS}"  # the seen-filter: with fallback rows only
    assert f"fallback_rows 3 (read {hashes} at a time, {combiner}; {seen})" in described["line"]
    plain = DynamicEmbedding(WIDTH, capacity=1)
    plain.build()
    index_bytes = tables.ENTRY_BYTES + tables.INFO_ENTRY_BYTES  # 1 id held; refused: none
    assert described["bytes_held"] - plain.describe()["bytes_held"] == (
        3 * width_bytes + index_bytes + 2 * tables.SEEN_BITS // 8
    )


def test_one_fallback_hash_is_the_single_hashed_row_and_two_rarely_share_both():
    keys = tf.constant(np.arange(1, 2001, dtype=np.int64) * 7919)
    one, two = tables.buckets_of(keys, 200, 1).numpy(), tables.buckets_of(keys, 200, 2).numpy()
    mixed = tables.splitmix64(tf.bitcast(keys, tf.uint64) + tables.u64(tables.GOLDEN))
    np.testing.assert_array_equal(one[:, 0], (mixed % tables.u64(200)).numpy())  # as before
    np.testing.assert_array_equal(two[:, 0], one[:, 0])  # the first of two is the same row
    assert (two[:, 0] != two[:, 1]).mean() > 0.9  # independent hashes, not one row twice

    def sharing(buckets: np.ndarray) -> int:  # ids whose every row another id reads too
        _, index, counts = np.unique(buckets, axis=0, return_inverse=True, return_counts=True)
        return int((counts[index.ravel()] > 1).sum())

    # 2,000 ids in 200 rows: each shares its one row; of 40,000 pairs of rows, few are shared.
    assert sharing(one) == 2000 and sharing(two) < 200


def test_a_tables_seed_keys_which_ids_share_fallback_rows():
    keys = tf.constant(np.arange(1, 2001, dtype=np.int64) * 7919)
    unseeded = tables.buckets_of(keys, 200, 2).numpy()
    np.testing.assert_array_equal(tables.buckets_of(keys, 200, 2, seed=0).numpy(), unseeded)
    seeded = tables.buckets_of(keys, 200, 2, seed=3).numpy()
    assert (seeded != unseeded).mean() > 0.9  # another draw of who collides with whom
    np.testing.assert_array_equal(tables.buckets_of(keys, 200, 2, seed=3).numpy(), seeded)
    layer = DynamicEmbedding(WIDTH, capacity=1, eviction=None, fallback_rows=200, seed=3)
    layer.build()
    layer.fallback.assign(np.arange(200, dtype=np.float32)[:, None] * np.ones(WIDTH, np.float32))
    read = layer.defaults(keys, tf.ones_like(keys, tf.bool)).numpy()[:, 0]
    np.testing.assert_array_equal(read, seeded.mean(axis=1))  # the default: their mean


@pytest.mark.parametrize("seen_bits", [tables.SEEN_BITS, 0])
def test_outside_training_an_id_the_table_never_saw_reads_zeros_not_its_fallback_rows(seen_bits):
    layer = DynamicEmbedding(
        WIDTH, capacity=1, eviction=None, fallback_rows=16, seen_bits=seen_bits
    )
    layer(tf.constant([5, 6, 7], tf.int64), training=True)  # 5 holds the row, 6 and 7 refused
    layer.fallback.assign(np.arange(1, 17, dtype=np.float32)[:, None] * np.ones(WIDTH, np.float32))
    ids = tf.constant([5, 6, 7, 8, 9], tf.int64)
    fallback = layer.defaults(ids, tf.ones_like(ids, tf.bool)).numpy()
    got = _rows_of(layer, ids)
    np.testing.assert_array_equal(got[0], tables.initial_rows(0, ids[:1], WIDTH).numpy()[0])
    np.testing.assert_array_equal(got[1:3], fallback[1:3])  # seen in training: fallback rows
    unseen = np.zeros((2, WIDTH)) if seen_bits else fallback[3:]  # never seen: zeros
    np.testing.assert_array_equal(got[3:], unseen)
    assert layer.describe()["seen_bits"] == seen_bits
    # In training every id reads its fallback rows, a new one too (it is noted first).
    np.testing.assert_array_equal(layer(ids[3:], training=True).numpy(), fallback[3:])


@pytest.mark.parametrize(
    ("field", "now", "before"),
    [
        ("fallback_hashes", 2, 1),
        ("fallback_combiner", "mean", "sum"),
        ("seen_bits", tables.SEEN_BITS, 0),
    ],
)
def test_a_layer_saved_before_a_fallback_field_reads_its_rows_as_it_did(field, now, before):
    """Saved without `fallback_hashes`, a layer read one row; without `fallback_combiner`, sums.

    Without `seen_bits`, every id without a row read its fallback rows.
    """
    layer = DynamicEmbedding(WIDTH, fallback_rows=8)
    assert getattr(DynamicEmbedding.from_config(layer.get_config()), field) == now
    older = {k: v for k, v in layer.get_config().items() if k != field}
    assert getattr(DynamicEmbedding.from_config(older), field) == before
    table = layers.TableConfig("t", embedding_dim=4, fallback_rows=8)
    assert getattr(layers.TableConfig.from_config(table.get_config()).layer(), field) == now
    older = {k: v for k, v in table.get_config().items() if k != field}
    assert getattr(layers.TableConfig.from_config(older).layer(), field) == before


def test_the_docstring_example_gives_a_vector_per_list():
    layer = DynamicEmbedding(16, key_dtype="string", combiner="mean", mask_id="")
    out = layer(tf.ragged.constant([["a", "b"], ["c"]]), training=True)
    assert out.shape == (2, 16)


def test_eval_lookups_admit_nothing():
    layer = DynamicEmbedding(WIDTH)
    layer(tf.constant([1, 2], tf.int64), training=False)
    assert int(layer.table.size()) == 0 and int(layer.table.counter("admitted")) == 0


@pytest.mark.parametrize("combiner, divisor", [("sum", 1.0), ("mean", 2.0), ("sqrtn", 2**0.5)])
def test_combiners_reduce_each_list_leaving_out_the_mask_id(combiner, divisor):
    layer = DynamicEmbedding(1, key_dtype="string", combiner=combiner, mask_id="")
    ragged = tf.ragged.constant([["a", "b"], ["a"]])
    layer(ragged, training=True)
    a, b = (tables.initial_rows(0, tf.constant([k]), 1).numpy()[0, 0] for k in "ab")
    want = np.array([(a + b) / divisor, a])
    np.testing.assert_allclose(layer(ragged).numpy()[:, 0], want, rtol=1e-6)
    padded = tf.constant([["a", "b", ""], ["a", "", ""]])
    np.testing.assert_allclose(layer(padded).numpy()[:, 0], want, rtol=1e-6)


def test_without_a_combiner_ragged_ids_give_ragged_vectors_and_the_mask_id_zeros():
    layer = DynamicEmbedding(WIDTH, mask_id=0)
    out = layer(tf.ragged.constant([[3, 0], [4]], tf.int64), training=True)
    assert isinstance(out, tf.RaggedTensor) and out.row_lengths().numpy().tolist() == [2, 1]
    np.testing.assert_array_equal(out[0][1].numpy(), np.zeros(WIDTH))
    assert int(layer.table.size()) == 2, "the mask id is never admitted"


@pytest.mark.parametrize(
    "argument, match",
    [
        ({"capacity": 0}, r"`capacity` \(0\) must be >= 1"),
        ({"ttl_steps": -1}, r"`ttl_steps` \(-1\) must be >= 0"),
        ({"min_count": 0}, r"`min_count` \(0\) must be in \[1, 65535\]"),
        ({"combiner": "max"}, r"`combiner` 'max' must be one of None, sum, mean, sqrtn"),
        ({"key_dtype": "int32"}, r"`key_dtype` 'int32' must be one of int64, string"),
        ({"eviction": "lfru"}, r"`eviction` 'lfru' must be one of 'lfu', 'lru', None"),
        ({"fallback_rows": -1}, r"`fallback_rows` \(-1\) must be >= 0"),
        ({"fallback_hashes": 0}, r"`fallback_hashes` \(0\) must be >= 1"),
        ({"fallback_combiner": "max"}, r"`fallback_combiner` 'max' must be one of mean, sum"),
        ({"seen_bits": -1}, r"`seen_bits` \(-1\) must be >= 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(argument, match):
    with pytest.raises(UserError, match=match) as error:
        DynamicEmbedding(WIDTH, **argument)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "key_dtype, ids", [("int64", tf.constant(["a"])), ("string", tf.constant([1], tf.int64))]
)
def test_ids_of_the_other_kind_are_a_one_line_error(key_dtype, ids):
    layer = DynamicEmbedding(WIDTH, key_dtype=key_dtype, name="users")
    with pytest.raises(UserError, match=f"'users' has `key_dtype` {key_dtype} but got") as error:
        layer(ids, training=True)
    assert "\n" not in str(error.value)


def test_ragged_ids_across_processes_are_a_one_line_error(monkeypatch):
    """Under `multi_worker` (more replicas in sync than one process holds): one width a list."""

    class Workers:  # two processes of one replica each, as this process sees them
        num_replicas_in_sync = 2
        extended = type("Extended", (), {"worker_devices": ("/job:worker/task:0/CPU:0",)})

    layer = DynamicEmbedding(WIDTH, combiner="mean", name="tags")
    tags = tf.ragged.constant([[1, 2], [3]], tf.int64)
    layer(tags, training=True)  # one process: a ragged batch is fine
    monkeypatch.setattr(tf.distribute, "get_strategy", Workers)
    with pytest.raises(UserError, match="'tags' cannot take lists of ids of no fixed") as error:
        layer(tags, training=True)
    assert "\n" not in str(error.value) and "mask_id" in str(error.value)
    layer(tags.to_tensor(shape=[None, 3]), training=True)  # padded to one width: fine


def test_a_model_of_string_ids_trains_from_keras_inputs():
    inputs = keras.Input(shape=(None,), dtype="string")
    x = DynamicEmbedding(WIDTH, key_dtype="string", combiner="mean", mask_id="")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    assert model.output_shape == (None, 1)
    optimizer = optim.OPTIMIZERS["adagrad"](0.1, None)
    ids = tf.constant([["x", "y"], ["z", ""]])
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(ids, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    assert int(model.layers[1].table.size()) == 3


# Sparse updates: rows looked up, and only they, change as Keras's dense update changes them.

ROWS = 6
FIRST, SECOND = [0, 2, 2], [3, 4]


def _step(optimizer, variable, rows: list, dense: bool) -> None:
    with tf.GradientTape() as tape:
        out = tf.gather(variable.value, tf.constant(rows))
        loss = tf.reduce_sum(out * tf.range(1.0, WIDTH + 1.0))
    (grad,) = tape.gradient(loss, [variable])
    assert isinstance(grad, tf.IndexedSlices)
    optimizer.apply_gradients([(tf.convert_to_tensor(grad) if dense else grad, variable)])


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad", "ftrl"])
def test_a_sparse_update_changes_only_the_rows_looked_up_as_keras_would(name):
    config = type("Options", (), {"momentum": 0.9, "weight_decay": 0.0})
    start = np.random.RandomState(0).normal(size=(ROWS, WIDTH)).astype(np.float32)
    sparse, dense = keras.Variable(start), keras.Variable(start)
    ours = optim.OPTIMIZERS[name](0.1, config)
    theirs = optim.KERAS_OPTIMIZERS[name](0.1, config)
    _step(ours, sparse, FIRST, dense=False)
    _step(theirs, dense, FIRST, dense=True)
    np.testing.assert_allclose(sparse.numpy()[[0, 2]], dense.numpy()[[0, 2]], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sparse.numpy()[[1, 3, 4, 5]], start[[1, 3, 4, 5]])
    after_first = sparse.numpy()
    _step(ours, sparse, SECOND, dense=False)  # lazy: rows 0 and 2 stay as they are
    np.testing.assert_array_equal(sparse.numpy()[[0, 1, 2, 5]], after_first[[0, 1, 2, 5]])
    for slot in ours.variables[2:]:  # slots of rows never looked up keep their initial value
        untouched = slot.numpy()[[1, 5]]
        np.testing.assert_array_equal(untouched, np.full_like(untouched, untouched[0, 0]))


def test_a_new_id_in_a_reused_slot_starts_from_its_initial_row_and_fresh_slots():
    # LRU: a new id takes the slot whatever its count ("lfu" would keep 1, counted more).
    layer = DynamicEmbedding(WIDTH, capacity=1, seed=3, eviction="lru")
    optimizer = optim.OPTIMIZERS["adam"](0.5, None)
    optimizer.build(layer.trainable_variables if layer.built else _built(layer))

    def train(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(tf.constant(ids, tf.int64), training=True))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))

    train([1])  # step 0: 1 admitted, read and trained
    train([1])  # step 1: trained again
    trained = _rows_of(layer, [1])[0]
    assert not np.allclose(trained, tables.initial_rows(3, tf.constant([1], tf.int64), WIDTH)[0])
    train([2])  # step 2: evicts 1, admits 2 into its slot: its row and moments start again
    train([2])  # step 3
    fresh = keras.Variable(tables.initial_rows(3, tf.constant([2], tf.int64), WIDTH))
    reference = optim.OPTIMIZERS["adam"](0.5, None)
    _one_row_step(reference, fresh, at_step=2)
    _one_row_step(reference, fresh, at_step=3)
    np.testing.assert_allclose(_rows_of(layer, [2])[0], fresh.numpy()[0], rtol=1e-6)
    assert optimizer.iterations.numpy() == 4 and int(layer.table.counter("evicted")) == 1


def _built(layer: DynamicEmbedding) -> list:
    layer.build()
    return layer.trainable_variables


def _one_row_step(optimizer, variable, at_step: int) -> None:
    """What the layer's step does to a new id's row: gradient 1 in every column."""
    optimizer.iterations.assign(at_step)
    grad = tf.IndexedSlices(tf.ones([1, WIDTH]), tf.constant([0]), tf.constant([1, WIDTH]))
    optimizer.apply_gradients([(grad, variable)])


# Under the trainer: strategies agree, and a resumed run equals an uninterrupted one.


def _ctr_config(strategy: str, steps: int, **model):
    config = tiny_ctr_config(
        **{"strategy.name": strategy, "train.steps": steps, "train.deterministic": True}
    )
    config.model.update({"embedding": "dynamic", "min_count": 2, **model})
    return config


def _restored_job(config, model_dir) -> train.BuiltJob:
    """The job of `config` with everything of `model_dir`'s newest checkpoint (full or delta)."""
    job = train.build(config, str(model_dir))
    Checkpointer(str(model_dir), True, 1, **train.checkpointed(job)).restore()
    return job


def _restored(config, model_dir) -> keras.Model:
    """The model of `config` with the weights and table of `model_dir`'s newest checkpoint."""
    return _restored_job(config, model_dir).model


def trained_job(config, model_dir) -> tuple[train.BuiltJob, dict]:
    """The job of `config` trained (no eval) into `model_dir`, and its results.

    Its state after the last step, in this process: the reference a restored or
    resumed run is compared with.
    """
    job = train.build(config, str(model_dir))
    return job, train.run(job, "train")


def test_a_checkpoint_of_the_earlier_index_format_is_one_line_and_left_alone(tmp_path):
    config = _ctr_config("one_device", 2)
    job = train.build(config, str(tmp_path))
    table = job.model.get_layer("embedding").parts[0].table
    # The earlier format: ids in a slot -> id table of their own beside `slot_info`.
    table.slot_keys = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
    Checkpointer(str(tmp_path), True, 1, **train.checkpointed(job)).save(0)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match="earlier index format .* `slot_keys`.* new `--model_dir`"):
        _restored_job(config, tmp_path)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def state_of(model: keras.Model, optimizer) -> dict[str, np.ndarray]:
    """Every variable of `model` and `optimizer`, and every entry of the table's indexes."""
    state = {f"model/{i}": v.numpy() for i, v in enumerate(model.variables)}
    state.update({f"optimizer/{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
    for index in model.get_layer("embedding").indexes():
        for name in ("index", "slot_info", "free", "counters"):
            keys, values = (t.numpy() for t in getattr(index, name).export())
            order = np.argsort(keys, kind="stable")
            state[f"{index.name}/{name}"] = np.concatenate([keys[order], values[order].ravel()])
    return state


def _rows_by_id(model: keras.Model) -> dict[int, np.ndarray]:
    """The row of every id the table of `model` holds."""
    layer = model.get_layer("embedding")
    keys, values = layer.table.index.export()
    ids = tf.boolean_mask(keys, values >= 0)
    return dict(zip(ids.numpy().tolist(), layer(ids).numpy(), strict=True))


class Trained(NamedTuple):
    """A run of the ctr model under one strategy."""

    config: ml_collections.ConfigDict
    model_dir: pathlib.Path
    results: dict
    printed: str
    rows: dict[int, np.ndarray]  # every held id's row at the end


@pytest.fixture(scope="module")
def one_device_and_mirrored(tmp_path_factory) -> dict[str, Trained]:
    """The ctr model with a dynamic table, 20 steps in blocks of 5 under each strategy.

    `mirrored` on 2 replicas: each admits the ids of the whole global batch with 2
    as with 4. Trained only (no eval: nothing here reads it), by strategy; the rows
    of `mirrored` restored from its checkpoint, those of `one_device` as trained.
    """
    runs = {}
    for strategy in ("one_device", "mirrored"):
        config, model_dir = _ctr_config(strategy, 20), tmp_path_factory.mktemp(strategy)
        config.strategy.mirrored.devices = "/cpu:0,/cpu:1"
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            job, results = trained_job(config, model_dir)
        model = job.model if strategy == "one_device" else _restored(config, model_dir)
        runs[strategy] = Trained(config, model_dir, results, printed.getvalue(), _rows_by_id(model))
    return runs


def test_one_device_and_mirrored_admit_the_same_ids_with_the_same_rows(one_device_and_mirrored):
    for run in one_device_and_mirrored.values():
        assert run.results["step"] == 20
    one, mirrored = (run.rows for run in one_device_and_mirrored.values())
    assert len(one) > 100 and sorted(one) == sorted(mirrored)
    for key, row in one.items():
        np.testing.assert_allclose(mirrored[key], row, rtol=1e-5, atol=1e-6)


def test_tensorboard_shows_each_blocks_ids_admissions_default_row_share_and_bytes(
    one_device_and_mirrored,
):
    figures = {}
    for strategy, (config, model_dir, results, printed, _) in one_device_and_mirrored.items():
        scalars = tensorboard_scalars(model_dir, "tables/embedding/")
        figures[strategy] = {tag.rsplit("/", 1)[1]: values for tag, values in scalars.items()}
        table = results["tables"]["embedding"]
        held = figures[strategy]["ids_held"]
        assert sorted(held) == [5, 10, 15, 20] and held[20] == table["ids_held"] > 100
        assert tensorboard_scalars(model_dir, "ids_held") == {"ids_held": held}
        for step, ids in held.items():  # the progress line says it too
            assert f"step: {step}/20 | " in printed and f" | ids: {int(ids)}" in printed
        # Nothing evicted: the block's admissions add up to the ids held.
        assert sum(figures[strategy]["admitted"].values()) == held[20]
        assert set(figures[strategy]["evicted"].values()) == {0}
        share = figures[strategy]["default_row_share"]
        assert 1 >= share[5] > share[20] >= 0, "ids admitted as they come back: fewer defaults"
        # Rows and two Adam moments of 32 float32 and a stamp, for capacity + 1 rows; the index.
        rows_bytes = (config.data.ctr.vocab_size + 1) * (32 * 4 * 3 + 8)
        index_bytes = table["bytes_held"] - rows_bytes
        per_id = tables.ENTRY_BYTES + tables.INFO_ENTRY_BYTES
        assert figures[strategy]["bytes_held"][20] == table["bytes_held"]
        sketch = tables.SKETCH_DEPTH * tables.SKETCH_WIDTH * 4  # min_count 2: the sketch
        assert index_bytes == held[20] * per_id + sketch, "no entry per id not admitted"
    # The replicas of `mirrored` admit the ids of the whole global batch, as one device does.
    assert figures["mirrored"] == figures["one_device"]


EVICTING = {"capacity": 300, "ttl_steps": 8, "fallback_rows": 50}  # evictions and sweeps


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple:
    """20 steps of a table that evicts, full checkpoints every 5, exported.

    Returns:
      Its config, model_dir and trained job.
    """
    config = _ctr_config("one_device", 20, **EVICTING)
    config.train.update({"checkpoint_every": 5, "export": True})
    model_dir = tmp_path_factory.mktemp("straight")
    job, _ = trained_job(config, model_dir)
    return config, model_dir, job


def test_a_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(tmp_path, straight_run):
    """Also resumed from incremental checkpoints: they restore the straight run's state."""
    _, straight_dir, straight = straight_run
    # Full at step 0, then deltas of it: the second run restores the one of step 10.
    resumed = _ctr_config("one_device", 10, **EVICTING)
    resumed.train.update({"checkpoint_every": 5, "full_checkpoint_every": 100})
    train.train_and_evaluate(resumed, str(tmp_path / "resumed"), mode="train")
    resumed.train.steps = 20
    results = train.train_and_evaluate(resumed, str(tmp_path / "resumed"), mode="train")
    assert results["step"] == 20
    newest = tf.train.load_checkpoint(str(tmp_path / "resumed" / "checkpoints"))
    assert newest.get_tensor("delta/.ATTRIBUTES/base_step") == 0, "a delta of step 0's"
    job = _restored_job(resumed, tmp_path / "resumed")
    states = [state_of(straight.model, straight.optimizer), state_of(job.model, job.optimizer)]
    assert sorted(states[0]) == sorted(states[1])
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)
    reader = tf.train.load_checkpoint(str(straight_dir / "checkpoints"))
    (keys,) = [
        n for n in reader.get_variable_to_shape_map() if "counters/.ATTRIBUTES/table-keys" in n
    ]
    counters = dict(zip(reader.get_tensor(keys), reader.get_tensor(keys.replace("keys", "values"))))
    assert counters[tables.COUNTERS.index("evicted")] > 0, "rows were evicted on the way"


@pytest.mark.slow  # 4 members, the export served in a fresh process: over a minute
def test_under_parameter_server_the_table_is_split_over_the_ps_members_and_learns(tmp_path, capsys):
    result = launched(
        "--workers=2",
        "--ps=2",
        "--",
        "--strategy=parameter_server",
        "--config=configs/ctr.py",
        "--config.model.embedding=dynamic",
        "--config.train.steps=100",
        "--config.train.steps_per_loop=50",
        "--config.train.checkpoint_every=0",
        "--model_dir=run",
        cwd=str(tmp_path),
    )
    # The export (tables from both ps members) serves raw ids in a fresh process with no ps.
    ids = [[1, 2, 3, 4, 5, 6, 7, 8], [2**40, 2**41, 3, 4, 5, 6, 7, 9]]
    export = str(tmp_path / "run" / "export")
    served = run_script(_SERVE, export, json.dumps(ids), cwd=tmp_path)
    assert_exit(served)
    logits = np.array(json.loads(served.stdout.splitlines()[-1]))
    assert logits.shape == (2, 2) and np.isfinite(logits).all()
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    table = results["tables"]["embedding"]
    ps = [f"/job:ps/replica:0/task:{task}/device:CPU:0" for task in (0, 1)]
    # Each part's index, lock and variables on its own ps member; ids spread over both.
    assert [part["device"] for part in table["parts"]] == ps
    assert [part["lock"] for part in table["parts"]] == ps
    assert [part["capacity"] for part in table["parts"]] == [100_000, 100_000]
    held = [part["ids_held"] for part in table["parts"]]
    assert min(held) > 0.4 * sum(held) and sum(held) == table["ids_held"] > 1000, table
    variables = results["placement"]["variables"]
    for name, task in (("rows", 0), ("row_stamps", 0), ("rows_1", 1), ("row_stamps_1", 1)):
        assert variables[f"embedding/{name}"] == [ps[task]], variables
    assert "[chief] table embedding: dynamic int64 ids, 32 wide, at most 200000 rows" in (
        result.stdout
    )
    assert "split by id hash over 2 parts" in result.stdout
    # TensorBoard has each part's figures, read from its ps member, and the table's.
    scalars = tensorboard_scalars(tmp_path / "run", "tables/embedding/")
    for index, part in enumerate(table["parts"]):
        figures = f"tables/embedding/part_{index}"
        assert scalars[f"{figures}/ids_held"][100] == part["ids_held"]
        assert scalars[f"{figures}/bytes_held"][100] == part["bytes_held"]
        assert 0 <= scalars[f"{figures}/default_row_share"][50] <= 1
    for figure in ("ids_held", "admitted", "bytes_held"):
        by_part = [scalars[f"tables/embedding/part_{index}/{figure}"][100] for index in (0, 1)]
        assert scalars[f"tables/embedding/{figure}"][100] == sum(by_part) > 0, figure
    assert results["eval"]["auc"] >= 0.7, results["eval"]  # ~0.74 here at 100 steps

    # Portable: the 2 ps members' checkpoint evaluates on one device, the same eval as
    # the chief's, and trains on with 1 ps member.
    config = configs.ctr.get_config()
    config.model.embedding, config.strategy.name = "dynamic", "one_device"
    here = train.train_and_evaluate(config, str(tmp_path / "run"), mode="eval")
    assert "restored ckpt-100 written with embedding in 2 parts into 1" in capsys.readouterr().out
    assert here["tables"]["embedding"]["ids_held"] == table["ids_held"]
    for name in ("loss", "auc"):
        assert here["eval"][name] == pytest.approx(results["eval"][name], rel=1e-5), name
    resumed = launched(
        "--workers=1",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        "--config=configs/ctr.py",
        "--config.model.embedding=dynamic",
        "--config.train.steps=110",
        "--config.train.export=False",
        "--model_dir=run",
        cwd=str(tmp_path),
    )
    assert "restored ckpt-100 written with embedding in 2 parts into 1" in resumed.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] == 110 and len(results["tables"]["embedding"]["parts"]) == 1


_SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
(name,) = serve.structured_input_signature[1]
outputs = serve(**{name: tf.constant(json.loads(sys.argv[2]), tf.float32)})
print(json.dumps(outputs["logits"].numpy().tolist()))
"""


# A bare `tf.distribute` ParameterServerStrategy over in-process servers on 127.0.0.1.
_BARE_PARAMETER_SERVER = (
    IN_PROCESS_CLUSTER
    + """
from trainer.layers import DynamicEmbedding

strategy = bare_parameter_server()
with strategy.scope():
    layer = DynamicEmbedding(4, capacity=10)
    layer.build()
print([part.rows.value.device for part in layer.parts] + [layer.default_row.value.device])
print(layer(tf.constant([0, 1], tf.int64), training=False).shape)


@tf.function
def gradients(ids):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    return tape.gradient(loss, [part.rows for part in layer.parts] + [layer.default_row])


def made_on(tensor):
    while tensor.op.type == "Identity":  # the function's outputs
        tensor = tensor.op.inputs[0]
    return tensor.op.device


with strategy.scope():
    traced = gradients.get_concrete_function(tf.TensorSpec([None], tf.int64))
*rows, default = traced.structured_outputs
print([(made_on(g.indices), made_on(g.values)) for g in rows] + [made_on(default)])
"""
)


def test_under_tensorflows_own_parameter_server_strategy_a_table_has_a_part_on_each_ps_member(
    tmp_path,
):
    """Each part's rows live on a ps member, and their gradient is made there.

    Made where the gradient is taken (the worker), its indices, the rows and
    their shapes would each cross back from the member every step. The
    default row lives with the first part, whose lookups carry it: its value
    and its gradient (made there too) cross with the part's.
    """
    result = run_script(_BARE_PARAMETER_SERVER, cwd=tmp_path)
    assert_exit(result, 0)
    devices, shape, gradients = result.stdout.strip().splitlines()[-3:]
    member = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
    assert devices == str([*member, member[0]])
    assert shape == "(2, 4)"
    *rows, default = ast.literal_eval(gradients)
    for i, made_on in enumerate(rows):
        assert made_on == (f"/job:ps/task:{i}/device:CPU:0",) * 2, gradients
    assert default == "/job:ps/task:0/device:CPU:0", gradients


def test_the_export_serves_raw_ids_in_a_fresh_process_as_eval_does(tmp_path, straight_run):
    config, model_dir, job = straight_run
    model = job.model
    held = sorted(_rows_by_id(model))
    layer = model.get_layer("embedding")
    candidates = np.arange(config.data.ctr.vocab_size)
    seen = layer.table.seen_ids(tf.constant(candidates, tf.int64)).numpy()
    waiting = sorted(set(candidates[seen].tolist()) - set(held))  # refused or evicted: fallback
    assert waiting and np.abs(layer.fallback.numpy()).sum() > 0
    ids = np.array([held[:8], held[8:14] + waiting[:1] + [2**23]], np.float32)  # 2**23: unseen
    expected = model(ids, training=False).numpy()
    served = run_script(_SERVE, str(model_dir / "export"), json.dumps(ids.tolist()), cwd=tmp_path)
    assert_exit(served)
    logits = np.array(json.loads(served.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


SMALL_CTR = {  # configs/ctr.py made small, as flags and as overrides
    "data.ctr.num_examples": 2000,
    "data.ctr.ids_per_field": 100,
    "data.ctr.vocab_size": 1000,
    "model.embedding": "dynamic",
    "model.min_count": 2,
    "train.steps": 20,
    "train.steps_per_loop": 5,
    "train.checkpoint_every": 10,
    "train.export": False,
    "train.deterministic": True,
    "eval.every": 0,
}
# Where `tiny_ctr_config` (the runs in this process) differs from configs/ctr.py for `multi_worker`.
TINY_CTR = (
    "model.hidden_units",
    "train.global_batch_size",
    "eval.global_batch_size",
    "optimizer.learning_rate",
)


def test_multi_worker_workers_end_with_the_rows_of_one_device(tmp_path, one_device_and_mirrored):
    one = one_device_and_mirrored["one_device"]
    config = one.config
    launched(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        "--mode=train",  # as the one_device run: no eval
        "--config=configs/ctr.py",
        *config_flags(config, (*SMALL_CTR, *TINY_CTR)),  # the one_device run's config
        "--config.train.full_checkpoint_every=100",  # each worker writes deltas of step 0's
        f"--model_dir={tmp_path / 'workers'}",
        cwd=str(tmp_path),
    )
    newest = tf.train.load_checkpoint(str(tmp_path / "workers" / "checkpoints"))
    assert newest.get_tensor("delta/.ATTRIBUTES/base_step") == 0
    workers = _rows_by_id(_restored(config, tmp_path / "workers"))  # restored on one device
    assert len(one.rows) > 100 and sorted(one.rows) == sorted(workers)
    for key, row in one.rows.items():
        np.testing.assert_allclose(workers[key], row, rtol=1e-5, atol=1e-6)
