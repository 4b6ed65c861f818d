"""Public Python names renamed for one vocabulary answer to their old names for a release."""

import doctest
import importlib

import pytest

from strategies.cluster import tf_config as cluster
from strategies.cluster.membership import Membership
from towerflow import renamed

# (module, old name, new name): every public name renamed for one word per concept.
RENAMED = [
    ("trainer.launch", "Plan", "LaunchPlan"),
    ("trainer.launch.plan", "Plan", "LaunchPlan"),
    ("trainer.bench.hosts", "Member", "HostedMember"),
    ("trainer.bench.harness", "Run", "TimedRun"),
    ("trainer.check", "Run", "StrategyRun"),
    ("trainer.sweep.plan", "Slot", "TrialSlot"),
    ("trainer.loop.job", "Job", "BuiltJob"),
    ("trainer.loop.train", "Job", "BuiltJob"),
    ("trainer.data.features", "Feature", "FeatureSpec"),
]


def test_the_module_docstring_example_runs():
    assert doctest.testmod(renamed, raise_on_error=True).attempted >= 1


@pytest.mark.parametrize("module, old, new", RENAMED)
def test_an_old_name_is_the_new_object_and_warns_naming_the_new_name(module, old, new):
    loaded = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"`{module}.{old}` is renamed `{module}.{new}`"):
        found = getattr(loaded, old)
    assert found is getattr(loaded, new)


@pytest.mark.parametrize("module", sorted({module for module, _, _ in RENAMED}))
def test_a_name_neither_old_nor_new_is_an_attribute_error(module):
    with pytest.raises(AttributeError, match="no attribute 'Nonesuch'"):
        assert importlib.import_module(module).Nonesuch is None


def test_a_cluster_specs_old_jobs_are_its_addresses_with_a_warning():
    spec = cluster.parse(cluster.make_tf_config({"worker": ["h:1", "h:2"]}, "worker", 0))
    with pytest.warns(
        DeprecationWarning, match="`ClusterSpec.jobs` is renamed `ClusterSpec.addresses`"
    ):
        assert spec.jobs == spec.addresses == {"worker": ("h:1", "h:2")}


def test_membership_takes_its_old_serving_jobs_with_a_warning():
    spec = cluster.parse(cluster.make_tf_config({"worker": ["h:1"], "ps": ["h:2"]}, "ps", 0))
    with pytest.warns(DeprecationWarning, match=r"`Membership\(serving_jobs=\)` is renamed"):
        assert Membership(spec, serving_jobs=("ps",)).role == "serve"


def test_a_data_service_servers_old_role_is_its_kind_with_a_warning():
    from trainer import data_service

    server = data_service.Server("worker", 5051, "host0:5050")
    with pytest.warns(DeprecationWarning, match="`Server.role` is renamed `Server.kind`"):
        assert server.role == server.kind == "worker"
