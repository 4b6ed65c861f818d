"""The strategy contract, checked for every registered plugin."""

import importlib.metadata

import numpy as np
import pytest
import tensorflow as tf

import strategies
from strategies import cluster, registry
from strategies.base import variable_devices
from tests.conftest import LOGICAL_CPUS

NAMES = sorted(strategies.available())
SINGLE_PROCESS = [n for n in NAMES if n in ("default", "one_device", "mirrored", "central_storage")]
GLOBAL_BATCH = 8


def _expected_placement(name: str) -> list[str]:
    cpus = [f"CPU:{i}" for i in range(LOGICAL_CPUS)]
    return {
        "default": ["CPU:0"],
        "one_device": ["CPU:0"],
        "mirrored": cpus,  # a copy on every replica's device
        "central_storage": ["CPU:0"],  # one copy, on the host
    }[name]


@pytest.fixture(params=SINGLE_PROCESS)
def strategy(request):
    return strategies.get(request.param)


def test_builtins_are_registered():
    assert {"default", "one_device", "mirrored", "central_storage"} <= set(NAMES)
    assert all(strategies.available().values()), "every plugin has a description"


def test_replica_counts(strategy):
    expected = {
        "default": 1,
        "one_device": 1,
        "mirrored": LOGICAL_CPUS,
        "central_storage": LOGICAL_CPUS,
    }
    assert strategy.num_replicas_in_sync == expected[strategy.name]
    assert strategy.membership.is_chief


def test_variables_follow_placement(strategy):
    with strategy.scope():
        v = tf.Variable(tf.ones([3]))
    devices = variable_devices(v)
    assert [d.split("device:")[-1] for d in devices] == _expected_placement(strategy.name)
    described = strategy.describe([v])
    assert described["strategy"] == strategy.name
    assert list(described["variables"].values()) == [devices]
    assert described["replicas_in_sync"] == strategy.num_replicas_in_sync


def _range_dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    batch = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
    return tf.data.Dataset.range(1000).batch(batch, drop_remainder=True)


def test_distribute_dataset_splits_the_global_batch(strategy):
    batch = next(iter(strategy.distribute_dataset(_range_dataset_fn)))
    parts = strategy.local_results(batch)
    replicas = strategy.num_replicas_in_sync
    assert len(parts) == replicas
    assert all(p.shape[0] == GLOBAL_BATCH // replicas for p in parts)
    assert sorted(np.concatenate([p.numpy() for p in parts])) == list(range(GLOBAL_BATCH))


def test_call_for_each_replica_runs_once_per_replica(strategy):
    calls = []

    def fn():
        calls.append(1)
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    ids = strategy.local_results(strategy.call_for_each_replica(fn))
    assert len(calls) == strategy.num_replicas_in_sync
    assert sorted(int(i) for i in ids) == list(range(strategy.num_replicas_in_sync))


def test_reduce_sum_and_mean(strategy):
    def fn():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.cast(replica + 1, tf.float32)

    values = strategy.call_for_each_replica(fn)
    n = strategy.num_replicas_in_sync
    assert float(strategy.reduce("sum", values)) == n * (n + 1) / 2
    assert float(strategy.reduce("mean", values)) == pytest.approx((n + 1) / 2)
    assert float(strategy.reduce(tf.distribute.ReduceOp.SUM, values)) == n * (n + 1) / 2


def test_run_steps_sums_over_replicas_and_steps(strategy):
    def step(batch):
        return {
            "examples": tf.cast(tf.size(batch), tf.float32),
            "total": tf.cast(tf.reduce_sum(batch), tf.float32),
        }

    iterator = iter(strategy.distribute_dataset(_range_dataset_fn))
    out = strategy.run_steps(step, iterator, 5)
    assert out == {"examples": 5 * GLOBAL_BATCH, "total": sum(range(5 * GLOBAL_BATCH))}
    out = strategy.run_steps(step, iterator, 1)  # the iterator goes on where it stopped
    assert out["total"] == sum(range(5 * GLOBAL_BATCH, 6 * GLOBAL_BATCH))


def test_run_steps_reduces_the_sums_once_a_loop(strategy, monkeypatch):
    """Replicas add up their own sums over the steps; each sum crosses replicas once a loop.

    Between processes (`multi_worker`) every reduction is a collective, a network round trip.
    """
    reduced = []
    reduce = strategy.reduce
    monkeypatch.setattr(strategy, "reduce", lambda op, v, **kw: reduced.append(1) or reduce(op, v))

    def step(batch):
        return {"examples": tf.cast(tf.size(batch), tf.float32), "loss": tf.constant(0.5)}

    out = strategy.run_steps(step, iter(strategy.distribute_dataset(_range_dataset_fn)), 5)
    assert out == {"examples": 5 * GLOBAL_BATCH, "loss": 0.5 * 5 * strategy.num_replicas_in_sync}
    assert len(reduced) == 2  # traced once: one reduction of each sum, none per step


def test_evaluate_sees_every_example_once(strategy):
    def dataset_fn(ctx):
        return tf.data.Dataset.range(37).batch(ctx.get_per_replica_batch_size(GLOBAL_BATCH))

    def step(batch):
        return {
            "examples": tf.cast(tf.size(batch), tf.float32),
            "total": tf.cast(tf.reduce_sum(batch), tf.float32),
        }

    assert strategy.evaluate(step, dataset_fn) == {"examples": 37, "total": sum(range(37))}


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(strategies.UserError) as e:
        strategies.get("mirorred")
    assert "mirorred" in str(e.value)
    for name in ("central_storage", "default", "mirrored", "one_device"):
        assert name in str(e.value)


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        strategies.register("mirrored")(type("Again", (strategies.Strategy,), {}))


def test_bad_options_are_user_errors():
    from ml_collections import ConfigDict

    with pytest.raises(strategies.UserError, match="cross_device_ops"):
        strategies.get("mirrored", ConfigDict({"devices": "", "cross_device_ops": "ring"}))
    with pytest.raises(strategies.UserError, match="nccl"):
        strategies.get("mirrored", ConfigDict({"devices": "", "cross_device_ops": "nccl"}))
    with pytest.raises(strategies.UserError, match="GPU:7"):
        strategies.get("one_device", ConfigDict({"device": "/gpu:7"}))


def test_entry_point_plugins_are_discovered(monkeypatch):
    toy = importlib.metadata.EntryPoint(
        name="toy", value="tests.toy_plugin:Toy", group=registry.ENTRY_POINT_GROUP
    )
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
            return [toy]
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    assert registry.available()["toy"] == "A third-party plugin, for the registry test."
    tf_config = cluster.make_tf_config({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1)
    monkeypatch.setenv("TF_CONFIG", tf_config)
    plugin = registry.get("toy")
    assert plugin.name == "toy" and plugin.num_replicas_in_sync == 1
    assert (plugin.membership.role, plugin.membership.is_chief) == ("train", False)
