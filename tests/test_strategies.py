"""The strategy contract, checked for every registered plugin."""

import contextlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import strategies
from strategies import registry, unrolled
from strategies.base import variable_devices
from strategies.cluster import tf_config as cluster
from tests import cluster_contract, helpers
from tests.helpers import LOGICAL_CPUS

GLOBAL_BATCH = 8
# A third-party plugin, installed as another package would install it (an entry point).
TOY = importlib.metadata.EntryPoint(
    name="toy", value="tests.toy_plugin:Toy", group=registry.ENTRY_POINT_GROUP
)


@contextlib.contextmanager
def _toy_installed() -> Iterator[None]:
    """The registry as it reads with `TOY` installed too; the real one afterwards."""
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        found = list(real(**kwargs))
        return [*found, TOY] if kwargs.get("group") == registry.ENTRY_POINT_GROUP else found

    registry.available()  # the built-in plugins registered in the real registry
    copy = registry.Registry("Strategy", origin=registry._origin)
    copy.update(registry._REGISTRY)
    with (
        mock.patch.object(importlib.metadata, "entry_points", entry_points),
        mock.patch.object(registry, "_entry_points_loaded", False),
        mock.patch.object(registry, "_REGISTRY", copy),
        mock.patch.object(registry, "_from_packages", set()),
    ):
        yield


with _toy_installed():
    PLUGINS = sorted(registry.available())  # every registered plugin, the toy among them


def _expected_placement(name: str) -> list[str]:
    cpus = [f"CPU:{i}" for i in range(LOGICAL_CPUS)]
    return {
        "mirrored": cpus,  # a copy on every replica's device
        "central_storage": ["CPU:0"],  # one copy, on the host
    }.get(name, ["CPU:0"])  # the others: one copy, on the first device (or the host)


_ON_CLUSTER: dict = {}  # the plugin a cluster's chief built (`tests.cluster_contract`)


@pytest.fixture(params=PLUGINS)
def strategy(request):
    """Each registered plugin, built in this process; one that needs a cluster says so."""
    with _toy_installed():
        on_cluster = os.environ.get(cluster_contract.CONTRACT_ON_CLUSTER)
        if on_cluster and request.param != on_cluster:
            pytest.skip(f"the chief of a {on_cluster} cluster checks {on_cluster} only")
        if on_cluster:  # one plugin for the process: it joined its cluster once
            if on_cluster not in _ON_CLUSTER:
                _ON_CLUSTER[on_cluster] = registry.get(on_cluster)
            return _ON_CLUSTER[on_cluster]
        try:
            return registry.get(request.param)
        except strategies.UserError as e:
            assert "\n" not in str(e) and "TF_CONFIG" in str(e) and "trainer.launch" in str(e)
            pytest.skip(f"{request.param} needs a cluster: see the test on a local cluster below")


def test_builtins_and_third_party_plugins_are_registered():
    assert {"default", "one_device", "mirrored", "central_storage", "toy"} <= set(PLUGINS)
    assert "toy" not in strategies.available(), "the registry is the real one again"
    assert all(strategies.available().values()), "every plugin has a description"


def test_replica_counts(strategy):
    # One per logical CPU for the replicating built-ins; a plugin with other rules has as
    # many as it runs the function of a step on.
    ran = len(strategy.local_results(strategy.call_for_each_replica(lambda: tf.constant(0))))
    expected = {"mirrored": LOGICAL_CPUS, "central_storage": LOGICAL_CPUS}.get(strategy.name, ran)
    assert strategy.num_replicas_in_sync == expected == ran
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
    if not strategy.traits.ordered_input:  # parameter_server: each worker reads its own
        pytest.skip("the workers read the batches, not this process: run_steps' sums check them")
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
    out, _, _ = strategy.report(strategy.run_steps(step, iterator, 5))  # the task's sums
    assert out == {"examples": 5 * GLOBAL_BATCH, "total": sum(range(5 * GLOBAL_BATCH))}
    out, _, _ = strategy.report(strategy.run_steps(step, iterator, 1))  # goes on from there
    if strategy.traits.ordered_input:  # else the workers take the batches as they come
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
    out, _, _ = strategy.report(out)  # the task's sums
    assert out == {"examples": 5 * GLOBAL_BATCH, "loss": 0.5 * 5 * strategy.num_replicas_in_sync}
    # Traced once: one reduction of the scalar sums (packed in one vector), none per step;
    # under parameter_server the chief adds up what the workers return, with no
    # cross-replica reduction at all.
    assert len(reduced) == (1 if strategy.traits.ordered_input else 0)


def test_run_steps_returns_every_kind_of_sum(strategy):
    """Float scalars travel the loop packed; vectors and other dtypes as they are."""

    def step(batch):
        return {
            "examples": tf.cast(tf.size(batch), tf.float32),
            "total": tf.cast(tf.reduce_sum(batch), tf.float32),
            "ones": tf.ones([3]),  # a histogram's shape
            "steps": tf.constant(1.0, tf.float64),
        }

    out = strategy.run_steps(step, iter(strategy.distribute_dataset(_range_dataset_fn)), 4)
    out, _, _ = strategy.report(out)  # the task's sums
    calls = 4 * strategy.num_replicas_in_sync  # each replica's step, 4 times
    assert sorted(out) == ["examples", "ones", "steps", "total"]
    assert out["examples"] == 4 * GLOBAL_BATCH
    assert out["total"] == sum(range(4 * GLOBAL_BATCH))
    np.testing.assert_array_equal(out["ones"], [calls] * 3)
    assert out["steps"] == calls


class _UnrolledStep:
    """A step that asks for 4 steps an iteration (as a long run's train step does)."""

    unroll = unrolled.Unroll(4)

    def __call__(self, batch):
        first = tf.cast(batch[0], tf.float32)  # where the replica's batch starts
        return {"examples": tf.cast(tf.size(batch), tf.float32), "first": first}


def test_an_unrolled_loop_takes_each_batch_once_in_order(strategy):
    """n steps take the next n batches whatever n is modulo the steps an iteration."""
    step = _UnrolledStep()
    iterator = iter(strategy.distribute_dataset(_range_dataset_fn))
    start = 0
    # One loop for all n (n is the loop's argument): none, 2 remainder steps, 2 iterations.
    for n in (1, 3, 9, 3):
        out, _, _ = strategy.report(strategy.run_steps(step, iterator, n))
        assert out["examples"] == n * GLOBAL_BATCH
        # Each replica's batch starts at a multiple of its size; batches go out in order,
        # each loop from where the one before stopped.
        per_replica = GLOBAL_BATCH // strategy.num_replicas_in_sync
        assert out["first"] == sum(range(start, start + n * GLOBAL_BATCH, per_replica)), n
        start += n * GLOBAL_BATCH


def test_evaluate_sees_every_example_once(strategy):
    def dataset_fn(ctx):
        return tf.data.Dataset.range(37).batch(ctx.get_per_replica_batch_size(GLOBAL_BATCH))

    def step(batch):
        return {
            "examples": tf.cast(tf.size(batch), tf.float32),
            "total": tf.cast(tf.reduce_sum(batch), tf.float32),
        }

    assert strategy.evaluate(step, dataset_fn) == {"examples": 37, "total": sum(range(37))}


def test_every_plugin_gives_the_public_hooks(strategy):
    assert strategy.communication and "\n" not in strategy.communication
    assert strategy.compute_devices and all(isinstance(d, str) for d in strategy.compute_devices)
    assert type(strategy).local_replicas(None, LOGICAL_CPUS) >= 1
    assert isinstance(strategy.tf_strategy, tf.distribute.Strategy)


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


def test_parameter_server_meets_the_contract_on_a_local_cluster():
    # One process, the chief, with its worker and ps served in it over gRPC on 127.0.0.1
    # (`tests.cluster_contract`); launched clusters of served members: test_parameter_server.
    result = helpers.run_command(
        [sys.executable, "-m", "tests.cluster_contract", "--strategy=parameter_server"],
        cwd=helpers.REPO,
    )
    helpers.assert_exit(result)
    # The chief ran this module's contract tests for parameter_server.
    summary = re.search(r"(\d+) passed, 1 skipped, \d+ deselected", result.stdout)
    assert summary and int(summary.group(1)) == 10, result.stdout[-3000:]
