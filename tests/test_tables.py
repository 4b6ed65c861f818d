"""Dynamic tables (`trainer.layers.tables`): initial rows, admission, eviction, without a model."""

import numpy as np
import tensorflow as tf

from trainer.layers import table_policy, table_seen, table_store, tables

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]


def _table(**options) -> tables.DynamicTable:
    options = {"capacity": 4, "min_count": 1, "ttl_steps": 0, "eviction": "lru", **options}
    return tables.DynamicTable(**options)


def _admit(table: tables.DynamicTable, ids: list) -> None:
    """One step's lookups of `ids` (the table counts steps by its calls)."""
    table.admit(tf.constant(ids, tf.int64))


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
    _admit(table, [5, 5, 6])  # 5 seen twice, 6 once
    assert _held(table, [5, 6]) == [False, False]
    _admit(table, [5, 6])  # 5: three times, admitted; 6: twice
    assert _held(table, [5, 6]) == [True, False]
    slot = table.find(tf.constant([5], tf.int64))[0].numpy()[0]
    _admit(table, [5])
    assert table.find(tf.constant([5], tf.int64))[0].numpy()[0] == slot, "it keeps its slot"
    assert int(table.counter("admitted")) == 1 and int(table.size()) == 1


def test_an_id_admitted_at_a_step_is_found_at_that_step():
    table = _table()
    _admit(table, [1])  # step 0
    slots, stamps = table.find(tf.constant([1, 2], tf.int64))
    assert slots.numpy().tolist() == [0, -1] and stamps.numpy()[0] == 0 * 4 + 0


def test_admission_does_not_depend_on_the_order_within_a_batch():
    one, other = _table(min_count=2), _table(min_count=2)
    _admit(one, [1, 2, 2, 3, 1])
    _admit(other, [3, 1, 2, 1, 2])
    assert _held(one, [1, 2, 3]) == _held(other, [1, 2, 3]) == [True, True, False]


def test_a_full_table_evicts_the_least_recently_seen_id():
    table = _table(capacity=3)
    _admit(table, [1, 2, 3])  # step 0
    _admit(table, [1, 3])  # step 1: 2 is now the oldest
    _admit(table, [4, 1])  # step 2
    assert _held(table, [1, 2, 3, 4]) == [True, False, True, True]
    assert int(table.counter("evicted")) == 1
    assert int(table.size()) == 3, "never more rows than the capacity"


def test_eviction_among_ids_seen_at_one_step_goes_by_id():
    table = _table(capacity=3)
    _admit(table, [30, 10, 20])
    _admit(table, [7, 5])  # evicts the two smallest ids of those seen at step 0
    assert _held(table, [10, 20, 30, 5, 7]) == [False, False, True, True, True]


def test_ids_seen_this_step_are_never_evicted():
    table = _table(capacity=2)
    _admit(table, [1, 2, 3])  # a third id waits: both rows are taken now
    assert _held(table, [1, 2, 3]) == [True, True, False]
    assert int(table.counter("refused")) == 1


def test_without_eviction_a_full_table_refuses_new_ids_and_counts_them():
    table = _table(capacity=2, eviction=None)
    _admit(table, [1, 2])
    _admit(table, [3, 4, 1])
    assert int(table.counter("refused")) == 2 and _held(table, [1, 2, 3]) == [True, True, False]


def test_ttl_frees_the_rows_of_ids_not_seen_for_ttl_steps():
    table = _table(capacity=8, ttl_steps=2)  # sweeps every step
    _admit(table, [1, 2])  # step 0
    _admit(table, [1])  # step 1
    _admit(table, [1])  # step 2: 2 last seen at step 0, expired
    assert _held(table, [1, 2]) == [True, False]
    assert int(table.counter("evicted")) == 1 and int(table.counter("free")) == 1
    _admit(table, [9])  # the freed slot is reused first
    assert int(table.counter("free")) == 0 and int(table.counter("fresh")) == 2


def test_counts_of_ids_not_admitted_live_in_a_fixed_sketch_and_age_by_halving():
    table = _table(min_count=3, sketch_width=64, sketch_depth=2)
    _admit(table, [5, 5])  # step 0: 5 counted twice
    _admit(table, list(range(100, 160)))  # 60 other ids once each: no entry per id
    assert int(table.index.size()) == 0 and table.figures()["index_bytes"] == 2 * 64 * 4
    cells = table.contents()["sketch"]
    assert cells.shape == (2, 64) and cells.max() == 2 and (cells > 0).sum() >= 60
    _admit(table, [7, 8])  # 64 lookups taken: every cell halves
    assert table.contents()["sketch"].max() == 1
    _admit(table, [5])  # 5's count: 2 halved, + 1: not admitted
    assert _held(table, [5]) == [False]


def test_a_sketched_count_is_never_under_the_true_count():
    table = _table(capacity=1000, min_count=4, sketch_width=128, sketch_depth=2)
    draw = np.random.RandomState(0)
    for _ in range(3):  # 128 cells a row for 40 ids: collisions, never undercounts
        _admit(table, draw.permutation(40).tolist())
    assert int(table.counter("admitted")) == 0
    estimates = table.count_sketch.estimates(tf.range(40, dtype=tf.int64))
    assert (estimates.numpy() >= 3).all()


def test_a_count_kept_across_steps_admits_at_min_count():
    table = _table(min_count=3, ttl_steps=100)
    for _ in range(2):
        _admit(table, [5])
        assert _held(table, [5]) == [False]
    _admit(table, [5])
    assert _held(table, [5]) == [True]


def test_a_reused_slot_gets_a_new_stamp():
    table = _table(capacity=1)
    _admit(table, [1])
    _admit(table, [2])
    slots, stamps = table.find(tf.constant([2], tf.int64))
    assert slots.numpy().tolist() == [0] and stamps.numpy().tolist() == [1 * 1 + 0]
    assert table.keys_of(tf.constant([0], tf.int64)).numpy().tolist() == [2]


def test_concurrent_admissions_in_one_function_do_not_race():
    table = _table(capacity=64)

    @tf.function
    def both(a, b):
        table.admit(a)
        table.admit(b)

    both(tf.range(0, 40, dtype=tf.int64), tf.range(20, 60, dtype=tf.int64))
    slots, _ = table.find(tf.range(60, dtype=tf.int64))
    assert sorted(slots.numpy().tolist()) == list(range(60)), "no slot given twice"


def test_admissions_of_two_tables_in_one_function_do_not_wait_for_each_other():
    """The parts of a split table admit on their own ps members, neither after the other.

    (TF's automatic control dependencies chain every stateful op that takes no
    resource, as a lock's release is, in program order: a message between the
    members each step.)
    """
    first, second = _table(capacity=8), _table(capacity=8)
    made = []

    @tf.function(autograph=False)
    def both(keys):
        graph = tf.compat.v1.get_default_graph()
        before = set(graph.get_operations())
        first.admit(keys)
        middle = set(graph.get_operations())
        second.admit(keys)
        made.extend([middle - before, set(graph.get_operations()) - middle])

    both.get_concrete_function(tf.TensorSpec([None], tf.int64))
    first_ops, second_ops = made
    for op in second_ops:
        inputs = {tensor.op for tensor in op.inputs} | set(op.control_inputs)
        assert not inputs & first_ops, f"{op.name} waits for the first admission"


def test_lookups_and_those_that_read_the_default_row_are_counted_per_step():
    table = _table(capacity=2, min_count=2)
    _admit(table, [7, 7, 8])  # step 0: 7 admitted and read at once; 8 waits, the default
    assert [int(table.counter(name)) for name in ("lookups", "defaults")] == [3, 1]
    _admit(table, [7, 8, 8, 9])  # step 1: 7 reads its row; 8 admitted now reads its; 9 default
    assert [int(table.counter(name)) for name in ("lookups", "defaults")] == [7, 2]
    _admit(table, [8, 7, 9])  # step 2: 7 and 8 read rows; 9 is due, but the table is full
    figures = table.figures()
    assert (figures["lookups"], figures["defaults"]) == (10, 3)
    assert (figures["ids_held"], figures["admitted"], figures["refused"]) == (2, 2, 1)
    # Index entries: 7, 8 (id -> slot); 2 slots -> (stamp, step, id); the sketch's cells.
    sketch = tables.SKETCH_DEPTH * tables.SKETCH_WIDTH * 4
    assert figures["index_bytes"] == 2 * tables.ENTRY_BYTES + 2 * tables.INFO_ENTRY_BYTES + sketch


def test_lfu_evicts_the_lowest_count_not_the_oldest():
    table = _table(capacity=3, eviction="lfu")
    _admit(table, [1, 1, 1, 2, 3])  # step 0: 1 seen three times
    _admit(table, [2, 3])  # step 1: 1 is now the least recently seen, but the most seen
    _admit(table, [4, 4, 4])  # step 2: 2 and 3 were seen twice, 1 three times, 4 three times
    assert _held(table, [1, 2, 3, 4]) == [True, False, True, True]
    lru = _table(capacity=3, eviction="lru")
    for ids in ([1, 1, 1, 2, 3], [2, 3], [4]):
        _admit(lru, ids)
    assert _held(lru, [1, 2, 3, 4]) == [False, True, True, True]


def test_lfu_admits_a_newcomer_only_over_an_id_of_a_lower_count():
    table = _table(capacity=2, eviction="lfu")
    _admit(table, [1, 1, 2, 2])  # step 0: both seen twice
    _admit(table, [3, 4, 4, 4])  # step 1: 3 once (refused), 4 three times (takes 1's slot)
    assert _held(table, [1, 2, 3, 4]) == [False, True, False, True]
    figures = table.figures()
    assert (figures["admitted"], figures["evicted"], figures["refused"]) == (3, 1, 1)
    lru = _table(capacity=2, eviction="lru")
    for ids in ([1, 1, 2, 2], [3, 4, 4, 4]):
        _admit(lru, ids)
    assert _held(lru, [1, 2, 3, 4]) == [False, False, True, True], "lru admits every newcomer"


def test_lfu_counts_decay_with_age_so_a_drifted_head_gives_way():
    table = _table(capacity=2, eviction="lfu", half_life=1)
    _admit(table, [1] * 8)  # step 0: 1 seen 8 times
    for _ in range(5):  # steps 1-5: 2 seen once a step; 1's count halves each step
        _admit(table, [2])
    _admit(table, [3])  # step 6: 1's count 8 / 2**6 is below 2's
    assert _held(table, [1, 2, 3]) == [False, True, True]


def test_counts_survive_contents_and_load():
    table = _table(eviction="lfu")
    _admit(table, [1, 1, 2])
    content = table.contents()
    assert sorted(content["counts"].tolist()) == [tables.COUNT_ONE, 2 * tables.COUNT_ONE]
    other = _table(eviction="lfu")
    keys = content["keys"]
    names = ("admitted", "last_seen", "waiting", "waiting_values", "counters")
    other.load(keys, *(content[n] for n in names), counts=content["counts"])
    again = other.contents()
    order = np.argsort(again["keys"])
    assert again["counts"][order].tolist() == content["counts"][np.argsort(keys)].tolist()
    assert again["last_seen"].tolist() == [0, 0]


def _seen(table: tables.DynamicTable, ids) -> np.ndarray:
    return table.seen_ids(tf.constant(ids, tf.int64)).numpy()


def test_the_seen_filter_keeps_every_id_it_took_for_a_generation_and_then_forgets():
    table = _table(capacity=2, seen_bits=1024)
    first = list(range(1000, 1040))
    _admit(table, first)  # 40 ids: 120 of 1,024 bits, under the fill that starts a generation
    assert _seen(table, first).all() and table.figures()["index_bytes"] >= 2 * 1024 // 8
    unseen = np.arange(5000, 15000)
    assert _seen(table, unseen).mean() <= (120 / 1024) ** table_seen.SEEN_HASHES * 2
    # More ids start a new generation: the first ones are still seen, from the one before.
    rotations = 0
    for start in range(2000, 2400, 40):
        before = table.contents()["seen"]
        _admit(table, list(range(start, start + 40)))
        if not np.array_equal(table.contents()["seen"][1], before[1]):  # a new generation
            rotations += 1
            assert rotations > 1 or _seen(table, first).all()
    assert rotations >= 2 and table.contents()["seen"].shape == (2, 1024 // 64)
    # Two generations on, nothing of the first ids is left but the chance of other ids' bits.
    assert _seen(table, first).mean() <= 0.2


def test_an_unseen_id_is_taken_for_seen_within_the_filters_bound():
    table = _table(capacity=2, seen_bits=2**14)
    draw = np.random.RandomState(0)
    for _ in range(40):  # many generations: the bound holds at any time
        _admit(table, draw.randint(1, 2**62, 400).tolist())
        rate = _seen(table, draw.randint(-(2**62), 0, 4000)).mean()
        assert rate <= 2 * table_seen.SEEN_FILL**table_seen.SEEN_HASHES + 0.01


def test_the_seen_filter_survives_contents_and_load_and_another_size_starts_empty():
    table = _table(seen_bits=640)
    _admit(table, [3, 4, 5])
    content = table.contents()
    names = ("admitted", "last_seen", "waiting", "waiting_values", "counters")
    for bits, seen in ((640, True), (1280, False)):
        other = _table(seen_bits=bits)
        other.load(content["keys"], *(content[n] for n in names), seen=content["seen"])
        found = _seen(other, [3, 4, 5])
        assert found.all() if seen else not found.any()
    assert _table(seen_bits=0).contents()["seen"].size == 0
    assert _seen(_table(seen_bits=0), [1, 2]).all(), "without a filter every id counts as seen"


def test_hashes_of_ids_are_the_same_eagerly_and_in_a_traced_function():
    """Salts of ints over 2**63 mixed with smaller ones once differed between the two."""
    keys = tf.constant(EXTREMES, tf.int64)
    for seed in range(4):
        for hashes in range(1, 5):
            eager = tables.buckets_of(keys, 1000, hashes, seed)
            traced = tf.function(lambda h=hashes, s=seed: tables.buckets_of(keys, 1000, h, s))()
            np.testing.assert_array_equal(eager.numpy(), traced.numpy())
    table = _table(seen_bits=4096)
    _admit(table, EXTREMES[:3])
    eager = table.seen_ids(keys).numpy()
    assert eager[:3].all()
    np.testing.assert_array_equal(tf.function(lambda: table.seen_ids(keys))().numpy(), eager)


def _row_stamps(table: tables.DynamicTable, ids: list, written: list[bool]):
    """Row stamps (a callable of slots, as `mark_written` takes) written where `written`."""
    slots, stamps = (t.numpy() for t in table.find(tf.constant(ids, tf.int64)))
    row_stamps = np.full(table.capacity + 1, -1, np.int64)
    row_stamps[slots] = np.where(written, stamps, stamps - 1)
    return slots, lambda at: tf.gather(row_stamps, at)


def test_marking_rows_written_marks_those_of_their_ids_stamp_and_changes_no_slot_or_stamp():
    table = _table()
    _admit(table, [1, 2, 3])
    found = [t.numpy() for t in table.find(tf.constant([1, 2, 3], tf.int64))]
    slots, row_stamps = _row_stamps(table, [1, 2, 3], [True, False, True])
    assert int(table.mark_written(slots, row_stamps)) == 3
    codes = table.codes(tf.constant([1, 2, 3, 4], tf.int64))
    assert table.written(codes).numpy().tolist() == [True, False, True, False]
    for before, now in zip(found, table.find(tf.constant([1, 2, 3], tf.int64)), strict=True):
        np.testing.assert_array_equal(now.numpy(), before)
    np.testing.assert_array_equal(np.sort(table.contents()["slots"]), np.sort(found[0]))
    # A row stamp that is no longer its slot's (a row reset for the id before) unmarks.
    slots, row_stamps = _row_stamps(table, [1], [False])
    table.mark_written(slots, row_stamps)
    codes = table.codes(tf.constant([1, 3], tf.int64))
    assert table.written(codes).numpy().tolist() == [False, True]
    np.testing.assert_array_equal(table.slots_of(codes).numpy(), found[0][[0, 2]])


def test_marking_the_slots_of_evicted_ids_or_free_slots_adds_no_id_to_the_index():
    table = _table(capacity=3)
    _admit(table, [1, 2])  # slots 0 and 1; slot 2 free
    slots, row_stamps = _row_stamps(table, [1, 2], [True, True])
    table.mark_written(tf.constant([2], tf.int64), row_stamps)  # free: no id holds it
    assert int(table.index.size()) == 2 and _held(table, [0]) == [False]
    _admit(table, [3, 4])  # 3 takes the free slot; LRU: 4 takes the slot of 1
    table.mark_written(tf.concat([slots, [2]], 0), row_stamps)
    assert _held(table, [1, 2, 3, 4]) == [False, True, True, True]
    assert int(table.index.size()) == 3
    codes = table.codes(tf.constant([2, 3, 4], tf.int64))
    assert table.written(codes).numpy().tolist() == [True, False, False]


def test_the_eviction_policy_works_over_an_index_store_alone():
    """A part of the table with its own small interface: the store, and its settings."""
    store = table_store.IndexStore(capacity=2)
    evictions = table_policy.EvictionPolicy(store, "lru", half_life=500, ttl_steps=0)
    step, keys = tf.constant(0, tf.int64), tf.constant([10, 11], tf.int64)
    slots = evictions.allocate(tf.constant([1, 1], tf.int64), step)
    assert slots.numpy().tolist() == [0, 1], "never used slots first"
    store.touch(slots, slots, keys, step, tf.constant([16, 16], tf.int64))
    store.index.insert(keys, store.held_code(slots))
    # Full: the id seen longest ago gives its slot (a tie: the smaller id), and is forgotten.
    assert evictions.allocate(tf.constant([1], tf.int64), step + 1).numpy().tolist() == [0]
    assert store.index.lookup(keys).numpy().tolist() == [-1, store.capacity + 1]
    assert int(store.counter("evicted")) == 1
