"""Checkpoints restore under any split of tables and sharded layers (`trainer.loop.portable`)."""

import glob
import json
import os
import re
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
from strategies import sharding
from tests.helpers import config_flags, launched, one_line_error, train_on_cluster
from tests.test_dynamic_embedding import SMALL_CTR, state_of
from towerflow.errors import UserError
from trainer.layers import DynamicEmbedding, ShardedDense, ShardedEmbedding, tables
from trainer.loop import optim, train
from trainer.loop.checkpoints import Checkpointer

WIDTH, CAPACITY = 3, 48


def _checkpointer(model_dir, model, optimizer) -> Checkpointer:
    job = types.SimpleNamespace(model=model, optimizer=optimizer)
    return Checkpointer(str(model_dir), True, 3, **train.checkpointed(job))


def _train(model, optimizer, batches) -> None:
    for ids in batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(ids, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _adam(model):
    optimizer = optim.OPTIMIZERS["adam"](0.05, None)
    optimizer.build(model.trainable_variables)
    return optimizer


# DynamicEmbedding: every id keeps its row, slots, counts and last-seen step.

POOL = np.random.RandomState(0).randint(-(2**62), 2**62, size=24, dtype=np.int64)


def _batches(steps: int, seed: int) -> list[tf.Tensor]:
    draw = np.random.RandomState(seed)
    return [tf.constant(draw.choice(POOL, size=(4, 3)), tf.int64) for _ in range(steps)]


def _dynamic_model(
    parts: int,
    capacity: int = CAPACITY,
    units: int = 1,
    ttl_steps: int = 0,
    mask_id=None,
    fallback_rows: int = 0,
    seen_bits: int = tables.SEEN_BITS,
) -> keras.Model:
    with sharding.policy("none", num_ps=parts):  # a part per ps member, here on this host
        inputs = keras.Input((3,), dtype="int64")
        table = DynamicEmbedding(
            WIDTH,
            combiner="sum",
            min_count=2,
            capacity=capacity,
            ttl_steps=ttl_steps,
            seed=1,
            mask_id=mask_id,
            fallback_rows=fallback_rows,
            seen_bits=seen_bits,
            name="embedding",
        )
        init = keras.initializers.GlorotUniform(seed=2)
        dense = keras.layers.Dense(units, kernel_initializer=init, name="dense")
        model = keras.Model(inputs, dense(table(inputs)))
    assert table.num_parts == parts
    return model


def _logical(model, optimizer) -> dict[str, np.ndarray]:
    """The table's content by id (rows, Adam's moments, steps), its counts and counters."""
    content = model.get_layer("embedding").export_logical(lambda v: optim.slots_of(optimizer, v))
    held, waiting = np.argsort(content["keys"]), np.argsort(content["waiting"])
    per_id = ("keys", "admitted", "last_seen", "fresh", "rows")
    by_id = {k: content[k][held] for k in content if k.startswith(per_id)}
    by_id.update(waiting=content["waiting"][waiting], counts=content["waiting_values"][waiting])
    by_id["held_counts"] = content["counts"][held]
    by_id["sketch"] = content["sketch"]  # the largest cell of every part's, whatever the split
    by_id["seen"] = content["seen"]  # the union of every part's seen-filter
    shared = ("default", "fallback", "counters")
    by_id.update({k: v for k, v in content.items() if k.startswith(shared)})
    return by_id


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_table_in_parts_trains_as_one_part_and_masked_ids_reach_no_part():
    """Each part looks up its own ids; a `mask_id` goes to none and reads zeros."""
    draw = np.random.RandomState(3)
    batches = [
        tf.constant(np.where(draw.rand(4, 3) < 0.3, 0, draw.choice(POOL, (4, 3))), tf.int64)
        for _ in range(6)
    ]
    probe = tf.constant(np.concatenate([POOL.reshape(8, 3), [[0, 0, 0], [0, POOL[0], 0]]]))
    seen = {}
    for parts in (1, 2):
        model = _dynamic_model(parts, mask_id=0)
        optimizer = _adam(model)
        _train(model, optimizer, batches)
        table = model.get_layer("embedding")
        seen[parts] = (_logical(model, optimizer), table(probe, training=True).numpy())
    (logical, vectors), (one, one_vectors) = seen[2], seen[1]
    assert 0 not in logical["keys"] and 0 not in logical["waiting"], "the mask id was counted"
    np.testing.assert_array_equal(vectors[8], np.zeros(WIDTH))
    for content in (logical, one):  # each part's sketch counts its own ids
        del content["sketch"]
        content["counters"][tables.COUNTERS.index("sketched")] = 0
    _assert_same(logical, one)
    np.testing.assert_array_equal(vectors, one_vectors)


def test_a_table_in_2_parts_restores_into_1_and_3_parts_and_back_exactly(tmp_path, capsys):
    model = _dynamic_model(2)
    optimizer = _adam(model)
    _train(model, optimizer, _batches(6, seed=1))
    model(tf.constant([[-5, -5, -6], [-6, -7, -8]], tf.int64), training=True)  # admitted, untrained
    want = _logical(model, optimizer)
    assert len(want["keys"]) > 8 and want["sketch"].any(), "ids on both sides of min_count"
    assert want["fresh"].any() and not want["fresh"].all(), "rows trained and rows not yet"
    every_id = tf.constant(POOL.reshape(8, 3))
    paths = {2: tmp_path / "2"}  # a checkpoint written with each number of parts
    _checkpointer(paths[2], model, optimizer).save(6)

    restored = {}
    for there, here in ((2, 1), (2, 3), (3, 2), (1, 2)):  # N -> M, and back
        again = _dynamic_model(here)
        again_optimizer = _adam(again)
        checkpointer = _checkpointer(paths[there], again, again_optimizer)
        assert checkpointer.restore().endswith("ckpt-6")
        line = f"restored ckpt-6 written with embedding in {there} parts into {here}"
        assert checkpointer.resplit == line
        _assert_same(_logical(again, again_optimizer), want)
        assert int(again_optimizer.iterations) == 6
        np.testing.assert_array_equal(again(every_id).numpy(), model(every_id).numpy())
        if here not in paths:
            paths[here] = tmp_path / str(here)
            _checkpointer(paths[here], again, again_optimizer).save(6)
        restored.setdefault(here, (again, again_optimizer))
    assert "warning" not in capsys.readouterr().err

    # Under `mirrored`, every replica's copy of the rows gets them.
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        mirrored = _dynamic_model(1)
        mirrored_optimizer = _adam(mirrored)
    _checkpointer(paths[2], mirrored, mirrored_optimizer).restore()
    _assert_same(_logical(mirrored, mirrored_optimizer), want)
    first, second = mirrored.get_layer("embedding").rows.value.values
    np.testing.assert_array_equal(second.numpy(), first.numpy())

    # Training goes on as it would have: the same step from the one part as from the two.
    next_batches = _batches(2, seed=2)
    one, one_optimizer = restored[1]
    _train(model, optimizer, next_batches)
    _train(one, one_optimizer, next_batches)
    got, want = _logical(one, one_optimizer), _logical(model, optimizer)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(
        one(tf.constant(POOL[:15].reshape(5, 3))), model(POOL[:15].reshape(5, 3)), rtol=1e-6
    )


def test_a_part_over_its_share_of_capacity_evicts_the_least_recently_seen_ids(tmp_path):
    owners = tables.part_of(tf.constant(POOL), 2).numpy()
    ids = np.concatenate([POOL[owners == 0][:5], POOL[owners == 1][:3]])  # 5 and 3 of 8 rows
    model = _dynamic_model(1, capacity=8)
    optimizer = _adam(model)
    for seen in ids:  # one id a step: the first seen is the least recent
        _train(model, optimizer, [tf.constant([[seen] * 3], tf.int64)])
    _checkpointer(tmp_path, model, optimizer).save(8)

    split = _dynamic_model(2, capacity=8)
    split_optimizer = _adam(split)
    checkpointer = _checkpointer(tmp_path, split, split_optimizer)
    checkpointer.restore()
    assert checkpointer.resplit == "restored ckpt-8 written with embedding in 1 parts into 2"
    got, want = _logical(split, split_optimizer), _logical(model, optimizer)
    kept = np.isin(want["keys"], ids[1:])
    assert sorted(got["keys"]) == sorted(ids[1:]), "the first seen of part 0's five is evicted"
    for name in ("rows", "rows/slot0", "rows/slot1", "last_seen", "admitted"):
        np.testing.assert_array_equal(got[name], want[name][kept], err_msg=name)
    evicted = tables.COUNTERS.index("evicted")
    assert got["counters"][evicted] == want["counters"][evicted] + 1


# Incremental checkpoints (`trainer.loop.deltas`): full ones, and deltas of the rows changed since.


def _deltas_checkpointer(model_dir, model, optimizer, full_every: int = 4) -> Checkpointer:
    job = types.SimpleNamespace(model=model, optimizer=optimizer)
    return Checkpointer(str(model_dir), True, 2, full_every=full_every, **train.checkpointed(job))


def test_deltas_between_full_checkpoints_restore_bit_identical_in_any_split(tmp_path):
    # 2 parts of 5 rows for 24 ids, a TTL of 3 steps: evictions, sweeps and reused slots.
    options = {"capacity": 10, "ttl_steps": 3}
    model = _dynamic_model(2, **options)
    optimizer = _adam(model)
    checkpointer = _deltas_checkpointer(tmp_path, model, optimizer)
    assert checkpointer.incremental
    live = {}
    for step, batch in enumerate(_batches(9, seed=3), start=1):
        _train(model, optimizer, [batch])
        checkpointer.save(step)
        live[step] = state_of(model, optimizer), _logical(model, optimizer)
    state_file = (tmp_path / "checkpoints" / "checkpoint").read_text()
    # Full at the first save and at 4 and 8; ckpt-8 and its delta 9 kept (`max_to_keep` 2).
    assert re.findall(r'all_model_checkpoint_paths: "(\S+)"', state_file) == ["ckpt-8", "ckpt-9"]
    evicted = tables.COUNTERS.index("evicted")
    assert live[9][1]["counters"][evicted] > 0, "ids evicted on the way"

    for parts in (2, 1):  # as written, and re-split: the delta replayed over the twins
        again = _dynamic_model(parts, **options)
        again_optimizer = _adam(again)
        restorer = _deltas_checkpointer(tmp_path, again, again_optimizer)
        assert restorer.restore().endswith("ckpt-9")
        if parts == 2:
            _assert_same(state_of(again, again_optimizer), live[9][0])
        else:
            assert restorer.resplit == "restored ckpt-9 written with embedding in 2 parts into 1"
            _assert_same(_logical(again, again_optimizer), live[9][1])


def test_a_checkpoint_without_seen_filters_restores_into_tables_with_them_empty(tmp_path):
    """Written before the filters (or with `seen_bits` 0): as written, re-split, with a delta."""
    options = {"capacity": 10, "ttl_steps": 3, "fallback_rows": 8}
    model = _dynamic_model(2, seen_bits=0, **options)
    optimizer = _adam(model)
    checkpointer = _deltas_checkpointer(tmp_path, model, optimizer)
    for step, batch in enumerate(_batches(5, seed=3), start=1):
        _train(model, optimizer, [batch])
        checkpointer.save(step)  # full at 1 and 4, a delta at 5
    want = _logical(model, optimizer)
    assert want.pop("seen").size == 0
    probe = tf.constant(POOL.reshape(8, 3))
    for parts in (2, 1):  # as written, and re-split: the delta replayed over the twins
        again = _dynamic_model(parts, **options)
        again_optimizer = _adam(again)
        assert _deltas_checkpointer(tmp_path, again, again_optimizer).restore().endswith("ckpt-5")
        got = _logical(again, again_optimizer)
        seen = got.pop("seen")
        assert seen.shape == (2, tables.SEEN_BITS // 64) and not seen.any()
        _assert_same(got, want)
        # Until the ids come back, an id without a row reads zeros; the held ids their rows.
        table = again.get_layer("embedding")
        assert not any(part.table.seen_ids(tf.constant(POOL)).numpy().any() for part in table.parts)
        _train(again, again_optimizer, _batches(1, seed=4))
        assert np.abs(again(probe).numpy()).sum() > 0


def test_a_delta_holds_the_rows_of_ids_the_ttl_freed_after_the_full_checkpoint(tmp_path):
    a, b = POOL[:3], POOL[3:6]
    both, only_b = tf.constant([a, b, a, b]), tf.constant([b, b])
    model = _dynamic_model(1, ttl_steps=3)
    optimizer = _adam(model)
    checkpointer = _deltas_checkpointer(tmp_path, model, optimizer, full_every=100)
    for step, batch in enumerate([both] * 6 + [only_b] * 3, start=1):
        _train(model, optimizer, [batch])  # a's rows change until step 6, then are freed
        checkpointer.save(step)  # full at 1, then deltas of it
    assert sorted(_logical(model, optimizer)["keys"]) == sorted(b)
    again = _dynamic_model(1, ttl_steps=3)
    again_optimizer = _adam(again)
    assert _deltas_checkpointer(tmp_path, again, again_optimizer).restore().endswith("ckpt-9")
    _assert_same(state_of(again, again_optimizer), state_of(model, optimizer))


def test_a_full_checkpoint_is_kept_while_a_kept_delta_needs_it_and_missing_is_one_line(tmp_path):
    model = _dynamic_model(2)
    optimizer = _adam(model)
    checkpointer = _deltas_checkpointer(tmp_path, model, optimizer, full_every=100)
    for step, batch in enumerate(_batches(4, seed=4), start=1):
        _train(model, optimizer, [batch])
        checkpointer.save(step)
    # Deltas 3 and 4 kept (`max_to_keep` 2), and the full checkpoint 1 they build on.
    listed = (tmp_path / "checkpoints" / "checkpoint").read_text()
    assert re.findall(r'all_model_checkpoint_paths: "(\S+)"', listed) == [
        "ckpt-1",
        "ckpt-3",
        "ckpt-4",
    ]
    assert not glob.glob(str(tmp_path / "checkpoints" / "ckpt-2.*"))
    reader = tf.train.load_checkpoint(str(tmp_path / "checkpoints" / "ckpt-4"))
    rows = reader.get_tensor("delta/.ATTRIBUTES/part0_0")  # part 0's changed rows, and spare
    assert 1 < len(rows) < CAPACITY // 2 + 1
    for name in glob.glob(str(tmp_path / "checkpoints" / "ckpt-1.*")):
        os.remove(name)
    again = _dynamic_model(2)
    one_line_error(
        r"checkpoint \S+ckpt-4 is a delta of the full checkpoint \S+ckpt-1, which is missing; put",
        _deltas_checkpointer(tmp_path, again, _adam(again)).restore,
    )


# ShardedEmbedding and ShardedDense: the whole table and kernel, and their slots.

VOCAB = 10


def _sharded_model(shards: int) -> keras.Model:
    with sharding.policy("fixed", num_shards=shards, num_ps=shards):
        inputs = keras.Input((3,))
        init = keras.initializers.RandomNormal(seed=4)
        x = ShardedEmbedding(VOCAB, WIDTH, embeddings_initializer=init, name="table")(inputs)
        x = keras.layers.Flatten()(x)
        init = keras.initializers.GlorotUniform(seed=5)
        outputs = ShardedDense(2, kernel_initializer=init, name="wide")(x)
        return keras.Model(inputs, outputs)


def _whole(model, optimizer) -> dict[str, np.ndarray]:
    slots = lambda v: optim.slots_of(optimizer, v)  # noqa: E731
    table, wide = model.get_layer("table"), model.get_layer("wide")
    return {**table.export_logical(slots), **wide.export_logical(slots)}


def test_sharded_layers_restore_into_any_shard_count_with_their_adam_slots(tmp_path):
    ids = [tf.constant([[0.0, 3.0, 9.0], [4.0, 4.0, 7.0]]), tf.constant([[1.0, 2.0, 9.0]] * 2)]
    model = _sharded_model(3)
    optimizer = _adam(model)
    _train(model, optimizer, ids)
    want = _whole(model, optimizer)
    names = ("embeddings", "kernel", "bias")
    assert sorted(want) == sorted(f"{n}{slot}" for n in names for slot in ("", "/slot0", "/slot1"))
    paths = {3: tmp_path / "3"}
    _checkpointer(paths[3], model, optimizer).save(2)
    restored = {}
    for there, here in ((3, 1), (3, 2), (2, 3)):  # N -> M, and back
        again = _sharded_model(here)
        again_optimizer = _adam(again)
        checkpointer = _checkpointer(paths[there], again, again_optimizer)
        checkpointer.restore()
        assert checkpointer.resplit == (
            f"restored ckpt-2 written with table in {there} parts into {here}, "
            f"wide in {there} parts into {here}"
        )
        _assert_same(_whole(again, again_optimizer), want)
        paths[here] = tmp_path / str(here)
        _checkpointer(paths[here], again, again_optimizer).save(2)
        restored[here] = again, again_optimizer

    # The next step: the same as the three shards' (the one-shard kernel's sums in another order).
    for net, net_optimizer in (model, optimizer), *restored.values():
        _train(net, net_optimizer, ids[:1])
    want = _whole(model, optimizer)
    _assert_same(_whole(*restored[3]), want)
    for name, value in _whole(*restored[1]).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_real_shape_difference_is_still_a_one_line_error(tmp_path):
    model = _sharded_model(2)
    _checkpointer(tmp_path, model, _adam(model)).save(0)
    with sharding.policy("fixed", num_shards=2):
        inputs = keras.Input((3,))
        x = keras.layers.Flatten()(ShardedEmbedding(VOCAB + 1, WIDTH, name="table")(inputs))
        other = keras.Model(inputs, ShardedDense(2, name="wide")(x))
    with pytest.raises(
        UserError,
        match=r"of a different model or optimizer \(`table/embeddings_0` "
        r"is \(5, 3\) there and \(6, 3\) here\)",
    ) as error:
        _checkpointer(tmp_path, other, _adam(other)).restore()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("other", [{"capacity": CAPACITY + 2}, {"units": 2}])
def test_a_table_split_otherwise_and_another_difference_is_refused(tmp_path, other):
    model = _dynamic_model(2)
    _checkpointer(tmp_path, model, _adam(model)).save(0)
    again = _dynamic_model(1, **other)
    with pytest.raises(UserError, match=r"of a different model or optimizer \(`embedding/rows`"):
        _checkpointer(tmp_path, again, _adam(again)).restore()


# A parameter-server cluster's checkpoint, under one_device and on fewer ps members.

# The small ctr job of the equivalence tests; op determinism is of no use to async workers.
# Incremental checkpoints: the cluster's at steps 10 and 20 are deltas of step 0's.
CTR = {k: v for k, v in SMALL_CTR.items() if k != "train.deterministic"}
CTR["train.full_checkpoint_every"] = 100


@pytest.mark.slow  # a cluster, then three runs
def test_a_table_trained_on_2_ps_evaluates_exports_on_one_device_and_resumes_on_1_ps(
    tmp_path, capsys
):
    config = configs.ctr.get_config()
    config.update_from_flattened_dict(CTR)
    flags = ["--config=configs/ctr.py", *config_flags(config, tuple(CTR))]
    on_cluster = train_on_cluster(tmp_path, "--strategy=parameter_server", *flags, ps=2)
    assert [p["ids_held"] > 0 for p in on_cluster["tables"]["embedding"]["parts"]] == [True] * 2
    newest = tf.train.load_checkpoint(str(tmp_path / "model" / "checkpoints"))
    assert newest.get_tensor("delta/.ATTRIBUTES/base_step") == 0, "the ps members wrote deltas"

    config.strategy.name = "one_device"
    here = train.train_and_evaluate(config, str(tmp_path / "model"), mode="eval")
    said = capsys.readouterr().out
    assert "restored ckpt-20 written with embedding in 2 parts into 1" in said, said
    held = sum(p["ids_held"] for p in on_cluster["tables"]["embedding"]["parts"])
    assert here["step"] == 20 and here["tables"]["embedding"]["ids_held"] == held
    for name in ("loss", "auc"):  # the chief evaluated the same weights and table
        assert here["eval"][name] == pytest.approx(on_cluster["eval"][name], rel=1e-5), name
    config.train.export = True
    train.train_and_evaluate(config, str(tmp_path / "model"), mode="train")  # at step 20 already
    assert (tmp_path / "model" / "export" / "saved_model.pb").exists()

    resumed = launched(
        "--workers=1",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        *flags,
        "--config.train.steps=25",
        f"--model_dir={tmp_path / 'model'}",
        cwd=tmp_path,
    )
    assert "restored ckpt-20 written with embedding in 2 parts into 1" in resumed.stdout
    results = json.loads((tmp_path / "model" / "results.json").read_text())
    assert results["step"] == 25 and len(results["tables"]["embedding"]["parts"]) == 1
