"""A dynamic table outside training (eval, the export): exactly what training reads, read-only."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from strategies import sharding
from tests.fresh_process import run_script
from tests.helpers import IN_PROCESS_CLUSTER, assert_exit
from trainer.layers import DynamicEmbedding, tables
from trainer.loop import export, optim

WIDTH = 4
MIN_COUNT = 3
MASK = {"int64": 0, "string": ""}


def _ids(key_dtype: str, numbers: list[int]) -> tf.Tensor:
    """Ids 1, 2, ... as `key_dtype` (strings "id1", ...); 0 is the mask id."""
    if key_dtype == "int64":
        return tf.constant(numbers, tf.int64)
    return tf.constant([f"id{n}" if n else "" for n in numbers])


def _trained_layer(key_dtype: str, parts: int = 1) -> DynamicEmbedding:
    """A table of 4 rows (LRU) holding trained rows, rows never written, reused slots.

    Ids 1-4 are looked up and trained `MIN_COUNT` times (admitted at the last,
    their fallback rows trained before); 5 and 6 are then looked up
    `MIN_COUNT` times in training with no update (admitted into the slots
    of 1 and 2, whose trained values they hold, unwritten); 7 and 8 once
    (counted, seen, not admitted).
    """
    with sharding.policy("none", num_ps=parts):
        layer = DynamicEmbedding(
            WIDTH,
            key_dtype=key_dtype,
            capacity=4,
            eviction="lru",
            min_count=MIN_COUNT,
            fallback_rows=8,
            mask_id=MASK[key_dtype],
            seed=7,
        )
    layer.build()
    optimizer = optim.OPTIMIZERS["sgd"](0.5, None)
    optimizer.build(layer.trainable_variables)
    for _ in range(MIN_COUNT + 1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(_ids(key_dtype, [1, 2, 3, 4, 0]), training=True))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    for _ in range(MIN_COUNT):
        layer(_ids(key_dtype, [5, 6]), training=True)
    layer(_ids(key_dtype, [7, 8]), training=True)
    return layer


@pytest.fixture(scope="module")
def read_only_layer() -> DynamicEmbedding:
    """`_trained_layer("int64")`, built once for the tests that only read it.

    Read-only: lookups outside training, the index's marks, its content. A test
    that looks up in training or writes the table builds its own.
    """
    return _trained_layer("int64")


def _held(layer: DynamicEmbedding, key_dtype: str, numbers: list[int]) -> list[int]:
    """Those of `numbers` whose ids hold a row now."""
    slots, _ = layer.table.find(tables.key64(_ids(key_dtype, numbers)))
    return [n for n, slot in zip(numbers, slots.numpy(), strict=True) if slot >= 0]


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_outside_training_every_id_reads_exactly_what_a_training_lookup_reads(key_dtype):
    layer = _trained_layer(key_dtype)
    held = _held(layer, key_dtype, [1, 2, 3, 4, 5, 6])
    assert len(held) == 4 and held[-2:] == [5, 6], "5 and 6 took the slots of two others"
    ids = _ids(key_dtype, [*held, 7, 8, 0, held[0]])  # trained, unwritten, waiting, mask
    served = layer(ids, training=False).numpy()
    admitted = int(layer.table.counter("admitted"))
    np.testing.assert_array_equal(served, layer(ids, training=True).numpy())
    assert int(layer.table.counter("admitted")) == admitted, "7 and 8 still wait"
    # The unwritten rows of 5 and 6 read their initial rows (as row + (initial - row): rounded).
    initial = tables.initial_rows(7, tables.key64(ids[2:4]), WIDTH).numpy()
    np.testing.assert_allclose(served[2:4], initial, atol=1e-7)
    assert np.abs(served[4:6]).sum() > 0, "waiting ids read their (trained) fallback rows"
    np.testing.assert_array_equal(served[6], np.zeros(WIDTH))


def test_a_table_in_parts_reads_outside_training_what_training_reads():
    layer = _trained_layer("int64", parts=2)
    keys = tables.key64(_ids("int64", [1, 2, 3, 4, 5, 6]))
    held = [part.table.find(keys)[0].numpy() >= 0 for part in layer.parts]
    assert len(layer.parts) == 2 and all(h.any() for h in held), "each part holds ids"
    ids = _ids("int64", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    served = layer(ids, training=False).numpy()
    np.testing.assert_array_equal(served, layer(ids, training=True).numpy())


def test_an_id_training_never_saw_reads_zeros_outside_training(read_only_layer):
    np.testing.assert_array_equal(
        read_only_layer(_ids("int64", [99, 3]), training=False).numpy()[0], np.zeros(WIDTH)
    )


def test_a_lookup_outside_training_changes_nothing_in_the_table():
    layer = _trained_layer("string")
    before = layer.table.contents()
    layer(_ids("string", [1, 3, 5, 7, 99, 0]), training=False)
    after = layer.table.contents()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def _written(layer: DynamicEmbedding, key_dtype: str, numbers: list[int]) -> list[bool]:
    """Whether the index marks the row of each of `numbers`' ids written (`WRITTEN`)."""
    table = layer.table
    return table.written(table.codes(tables.key64(_ids(key_dtype, numbers)))).numpy().tolist()


def test_the_optimizer_marks_written_the_rows_it_reset_and_no_others(read_only_layer):
    layer = read_only_layer
    held = _held(layer, "int64", [1, 2, 3, 4, 5, 6])
    # 5 and 6 were admitted by lookups that no update followed; 7, 8 and 99 hold no row.
    assert _written(layer, "int64", [*held, 7, 8, 99]) == [True, True, False, False] + [False] * 3


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_a_batch_of_written_ids_reads_their_rows_as_they_are(key_dtype):
    layer = _trained_layer(key_dtype)
    trained = _held(layer, key_dtype, [1, 2, 3, 4])
    ids = _ids(key_dtype, trained * 2)
    slots, _ = layer.table.find(tables.key64(ids))
    served = layer(ids, training=False).numpy()
    np.testing.assert_array_equal(served, tf.gather(layer.rows, slots).numpy())
    np.testing.assert_array_equal(served, layer(ids, training=True).numpy())


def test_a_row_reset_for_an_id_that_has_left_its_slot_leaves_the_new_id_unmarked():
    """An asynchronous worker's reset, for the slot's id before: its row stamp is not the slot's."""
    layer = _trained_layer("int64")
    trained = _held(layer, "int64", [1, 2, 3, 4])[0]
    keys = tables.key64(_ids("int64", [trained]))
    slots, stamps = layer.table.find(keys)
    written = layer(keys, training=False).numpy()
    row_stamps = layer.row_stamps.numpy()
    row_stamps[slots.numpy()] = stamps.numpy() - 1  # another stamp: the slot's id before
    layer.row_stamps.assign(row_stamps)
    layer.table.mark_written(slots, lambda at: tf.gather(layer.row_stamps, at))
    assert _written(layer, "int64", [trained]) == [False]
    served = layer(keys, training=False).numpy()
    np.testing.assert_array_equal(served, layer(keys, training=True).numpy())
    np.testing.assert_allclose(served, tables.initial_rows(7, keys, WIDTH).numpy(), atol=1e-7)
    assert np.abs(served - written).max() > 0, "no longer the row as written"


def test_an_index_without_marks_reads_what_the_index_with_them_reads():
    """As checkpoints written before the index marked written rows hold it."""
    layer = _trained_layer("int64")
    ids = _ids("int64", [1, 2, 3, 4, 5, 6, 7, 8, 0, 99])
    served = layer(ids, training=False).numpy()
    keys, codes = (t.numpy() for t in layer.table.index.export())
    assert (codes >= tables.WRITTEN).sum() == 2, "3 and 4 marked"
    layer.table.index.insert(keys, np.where(codes >= 0, codes & (tables.WRITTEN - 1), codes))
    assert not any(_written(layer, "int64", [1, 2, 3, 4, 5, 6]))
    np.testing.assert_array_equal(layer(ids, training=False).numpy(), served)


def test_a_table_loaded_from_its_content_marks_the_rows_written_as_they_were(read_only_layer):
    layer = read_only_layer
    content = layer.export_logical(lambda variable: [])  # plain SGD: no optimizer slots
    numbers = [1, 2, 3, 4, 5, 6, 7, 8, 0, 99]
    ids, marks = _ids("int64", numbers), _written(layer, "int64", numbers)
    served = layer(ids, training=False).numpy()
    loaded = DynamicEmbedding.from_config(layer.get_config())
    loaded.build()
    loaded.import_logical(content, lambda variable: [])
    assert _written(loaded, "int64", numbers) == marks
    np.testing.assert_array_equal(loaded(ids, training=False).numpy(), served)


def test_an_index_written_before_it_held_stamps_restores_and_reads_the_same(tmp_path):
    """A checkpoint whose index holds each id's slot alone (as written before) reads as ever."""
    layer = _trained_layer("int64")
    ids = _ids("int64", [1, 2, 3, 4, 5, 6, 7, 8, 0, 99])
    keys = tables.key64(ids)
    served, (slots, stamps) = layer(ids, training=False).numpy(), layer.table.find(keys)
    index = layer.table.index
    held_keys, codes = (t.numpy() for t in index.export())
    held = codes >= 0
    assert (codes[held] >= layer.capacity).all(), "the index holds stamps now"
    slots_alone = (codes[held] & (tables.WRITTEN - 1)) % layer.capacity
    index.insert(held_keys[held], slots_alone)  # the slots, as before
    tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))
    restored = DynamicEmbedding.from_config(layer.get_config())
    restored.build()
    status = tf.train.Checkpoint(layer=restored).read(str(tmp_path / "ckpt"))
    status.assert_existing_objects_matched().expect_partial()  # the clock: no optimizer here
    found = restored.table.find(keys)
    np.testing.assert_array_equal(found[0].numpy(), slots.numpy())
    np.testing.assert_array_equal(found[1].numpy(), stamps.numpy())
    np.testing.assert_array_equal(restored(ids, training=False).numpy(), served)
    # Training goes on from it: held ids read their rows, 5 and 6 still their initial ones.
    np.testing.assert_array_equal(restored(ids[:6], training=True).numpy(), served[:6])


_SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
ids = json.loads(sys.argv[2])
dtype = tf.string if isinstance(ids[0], str) else tf.int64
print(json.dumps(serve(inputs=tf.constant(ids, dtype))["outputs"].numpy().tolist()))
"""


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_the_export_serves_in_a_fresh_process_exactly_what_training_reads(tmp_path, key_dtype):
    layer = _trained_layer(key_dtype)
    inputs = keras.Input(shape=(), dtype=key_dtype, name="ids")
    model = keras.Model(inputs, layer(inputs))
    path = export.export(model, str(tmp_path / "export"), None, 0, raw_outputs=True)
    ids = _ids(key_dtype, [*_held(layer, key_dtype, [1, 2, 3, 4, 5, 6]), 7, 8, 0, 99])
    as_json = [i.decode() if isinstance(i, bytes) else int(i) for i in ids.numpy().tolist()]
    served = run_script(_SERVE, path, json.dumps(as_json), cwd=tmp_path)
    assert_exit(served)
    got = np.array(json.loads(served.stdout.strip().splitlines()[-1]), np.float32)
    np.testing.assert_array_equal(got, layer(ids, training=False).numpy())
    np.testing.assert_array_equal(got[:-1], layer(ids[:-1], training=True).numpy())


# A table split over 2 in-process ps members, exported from the coordinator: its eval vectors.
_EXPORT_FROM_PS = (
    IN_PROCESS_CLUSTER
    + """
import json, sys
import keras
from trainer.layers import DynamicEmbedding
from trainer.loop import export

strategy = bare_parameter_server()
with strategy.scope():
    layer = DynamicEmbedding(4, capacity=10, fallback_rows=8, seed=3)
    inputs = keras.Input(shape=(), dtype="int64", name="ids")
    model = keras.Model(inputs, layer(inputs))
layer(tf.constant([1, 2, 3, 4, 5, 6], tf.int64), training=True)
layer.fallback.assign(tf.ones_like(layer.fallback))
ids = tf.constant(json.loads(sys.argv[2]), tf.int64)
export.export(model, sys.argv[1], None, 0, raw_outputs=True)
print(json.dumps(layer(ids, training=False).numpy().tolist()))
"""
)


@pytest.mark.slow  # an in-process cluster, then a fresh process: over a minute here
def test_the_export_of_a_table_on_ps_members_serves_in_a_fresh_process_what_eval_reads(tmp_path):
    path, ids = str(tmp_path / "export"), json.dumps([1, 2, 3, 4, 5, 6, 7, 0])
    exported = run_script(_EXPORT_FROM_PS, path, ids, cwd=tmp_path)
    assert_exit(exported)
    expected = np.array(json.loads(exported.stdout.strip().splitlines()[-1]), np.float32)
    served = run_script(_SERVE, path, ids, cwd=tmp_path)
    assert_exit(served)
    got = np.array(json.loads(served.stdout.strip().splitlines()[-1]), np.float32)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(expected[:6]).sum() > 0 and (expected[6] == 0).all(), "7: never seen"


# A table split over 2 in-process ps members, trained by a worker through the coordinator (the
# asynchronous path), 30 steps of ids that overflow it; then its marks and both reads.
_TRAINED_ON_PS = (
    IN_PROCESS_CLUSTER
    + """
import json
import numpy as np
import configs.default
from trainer.layers import DynamicEmbedding, tables
from trainer.loop import optim

strategy = bare_parameter_server()
with strategy.scope():
    layer = DynamicEmbedding(4, capacity=40, fallback_rows=8, seed=3, eviction="lru")
    layer.build()
    optimizer = optim.build(configs.default.get_config().optimizer, 1)
    optimizer.build(layer.trainable_variables)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)


@tf.function
def step(ids):
    def replica(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) ** 2)
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    return strategy.run(replica, args=(ids,))


draw = np.random.default_rng(0)
for _ in range(30):
    coordinator.schedule(step, args=(tf.constant(draw.integers(1, 60, 16), tf.int64),))
coordinator.join()
keys = tf.constant(np.arange(1, 60), tf.int64)
held = [int(tf.reduce_sum(tf.cast(p.table.find(keys)[0] >= 0, tf.int32))) for p in layer.parts]
marked = [int(tf.reduce_sum(tf.cast(p.table.written(p.table.codes(keys)), tf.int32)))
          for p in layer.parts]
served = layer(keys, training=False).numpy()
print(json.dumps([held, marked, float(np.abs(served - layer(keys, training=True).numpy()).max())]))
"""
)


@pytest.mark.slow  # an in-process cluster: about a minute here
def test_under_parameter_server_every_row_trained_is_marked_and_eval_reads_what_training_reads(
    tmp_path,
):
    trained = run_script(_TRAINED_ON_PS, cwd=tmp_path)
    assert_exit(trained)
    held, marked, difference = json.loads(trained.stdout.strip().splitlines()[-1])
    assert min(held) > 0 and sum(held) > 20, "ids on both parts, evicting"
    assert marked == held, "each update wrote the rows its step admitted"
    assert difference == 0
