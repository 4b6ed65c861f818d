"""Dynamic tables (`trainer.tables`): initial rows, admission, eviction, without a model."""

import numpy as np
import tensorflow as tf

from trainer import tables

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]


def _table(**options) -> tables.DynamicTable:
    options = {"capacity": 4, "min_count": 1, "ttl_steps": 0, "eviction": "lru", **options}
    return tables.DynamicTable(tf.int64, **options)


def _slots(table: tables.DynamicTable, ids: list) -> list[int]:
    slots, _ = table.admit(tf.constant(ids, tf.int64))
    return slots.numpy().tolist()


def _held(table: tables.DynamicTable, ids: list) -> list[bool]:
    slots, _ = table.find(tf.constant(ids, tf.int64))
    return (slots.numpy() >= 0).tolist()


def test_initial_rows_depend_only_on_seed_and_id():
    ids = tf.constant(EXTREMES, tf.int64)
    rows = tables.initial_rows(7, ids, 8).numpy()
    reversed_rows = tables.initial_rows(7, tf.reverse(ids, [0]), 8).numpy()[::-1]
    np.testing.assert_array_equal(rows, reversed_rows)
    assert np.all(np.abs(rows) <= tables.ROW_SCALE)
    assert len({tuple(row) for row in rows}) == len(EXTREMES), "every id its own row"
    assert not np.allclose(rows, tables.initial_rows(8, ids, 8).numpy()), "the seed matters"
    # Columns are not copies of one number, and the values spread over the range.
    many = tables.initial_rows(0, tf.range(2000, dtype=tf.int64), 16).numpy()
    assert abs(many.mean()) < 0.002 and many.std() > 0.025


def test_string_ids_get_rows_by_their_fingerprint():
    keys = tf.constant(["user:1", "user:2", ""])
    rows = tables.initial_rows(1, keys, 4).numpy()
    assert len({tuple(row) for row in rows}) == 3
    np.testing.assert_array_equal(rows[:1], tables.initial_rows(1, keys[:1], 4).numpy())


def test_an_id_gets_a_row_once_seen_min_count_times():
    table = _table(min_count=3)
    assert _slots(table, [5, 5, 6]) == [-1, -1, -1]  # 5 seen twice, 6 once
    slots = _slots(table, [5, 6])  # 5: three times, admitted; 6: twice
    assert slots[0] >= 0 and slots[1] == -1
    assert _slots(table, [5])[0] == slots[0], "an admitted id keeps its slot"
    assert int(table.counter("admitted")) == 1 and int(table.size()) == 1


def test_admission_does_not_depend_on_the_order_within_a_batch():
    one, other = _table(min_count=2), _table(min_count=2)
    _slots(one, [1, 2, 2, 3, 1])
    _slots(other, [3, 1, 2, 1, 2])
    assert _held(one, [1, 2, 3]) == _held(other, [1, 2, 3]) == [True, True, False]


def test_a_full_table_evicts_the_least_recently_seen_id():
    table = _table(capacity=3)
    _slots(table, [1, 2, 3])  # step 0
    _slots(table, [1, 3])  # step 1: 2 is now the oldest
    slots = _slots(table, [4, 1])  # step 2
    assert _held(table, [1, 2, 3, 4]) == [True, False, True, True]
    assert slots[0] >= 0 and int(table.counter("evicted")) == 1
    assert int(table.size()) == 3, "never more rows than the capacity"


def test_ids_seen_this_step_are_never_evicted():
    table = _table(capacity=2)
    assert min(_slots(table, [1, 2, 3])) == -1, "a third id waits: both rows are in use now"
    assert _held(table, [1, 2]) == [True, True] and int(table.counter("refused")) == 1


def test_without_eviction_a_full_table_refuses_new_ids_and_counts_them():
    table = _table(capacity=2, eviction=None)
    _slots(table, [1, 2])
    assert _slots(table, [3, 4, 1])[:2] == [-1, -1]
    assert int(table.counter("refused")) == 2 and _held(table, [1, 2, 3]) == [True, True, False]


def test_ttl_frees_the_rows_of_ids_not_seen_for_ttl_steps():
    table = _table(capacity=8, ttl_steps=2)  # sweeps every step
    _slots(table, [1, 2])  # step 0
    _slots(table, [1])  # step 1
    _slots(table, [1])  # step 2: 2 last seen at step 0, expired
    assert _held(table, [1, 2]) == [True, False]
    assert int(table.counter("evicted")) == 1 and int(table.counter("free")) == 1
    slot = _slots(table, [9])[0]  # the freed slot is reused first
    assert int(table.counter("free")) == 0 and int(table.counter("fresh")) == 2 and slot < 2


def test_a_reused_slot_gets_a_new_stamp():
    table = _table(capacity=1)
    first, first_stamp = (t.numpy()[0] for t in table.admit(tf.constant([1], tf.int64)))
    second, second_stamp = (t.numpy()[0] for t in table.admit(tf.constant([2], tf.int64)))
    assert first == second == 0 and first_stamp != second_stamp
    assert table.keys_of(tf.constant([0], tf.int64)).numpy().tolist() == [2]


def test_concurrent_admissions_in_one_function_do_not_race():
    table = _table(capacity=64)

    @tf.function
    def both(a, b):
        return table.admit(a)[0], table.admit(b)[0]

    a, b = both(tf.range(0, 40, dtype=tf.int64), tf.range(20, 60, dtype=tf.int64))
    a, b = a.numpy(), b.numpy()
    np.testing.assert_array_equal(a[20:], b[:20])  # shared ids share slots
    slots = np.concatenate([a, b[20:]])
    assert sorted(slots) == list(range(60)), "no slot given twice"
