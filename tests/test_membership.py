"""Cluster membership (`strategies.cluster.membership`): roles, chief, lost members, agreement."""

import doctest
import socket

import pytest

import strategies
from strategies.cluster import membership, preemption
from strategies.cluster import tf_config as cluster
from strategies.cluster.membership import Membership
from towerflow.errors import UserError

PS_JOBS = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"], "evaluator": ["h:5"]}
WORKERS = {"worker": ["h:1", "h:2"]}


def _spec(jobs: dict, task_type: str, index: int = 0) -> cluster.ClusterSpec:
    return cluster.parse(cluster.make_tf_config(jobs, task_type, index))


def test_the_module_docstring_example_runs():
    assert doctest.testmod(membership, raise_on_error=True).attempted >= 1


def test_one_process_trains_is_chief_and_watches_its_own_signal():
    alone = Membership()
    assert (alone.role, alone.is_chief, alone.evaluates_inline) == ("train", True, True)
    assert alone.cluster is None and alone.lost_members() == [] and alone.agree(3) == 3
    assert isinstance(alone.watch_preemption(), preemption.SignalWatch)
    alone.check_restored(5, "/nowhere")  # nothing to compare with


@pytest.mark.parametrize(
    "task_type, index, role, chief",
    [
        ("chief", 0, "train", True),
        ("worker", 0, "serve", False),
        ("ps", 0, "serve", False),
        ("evaluator", 0, "evaluate", False),
    ],
)
def test_serving_types_serve_and_the_chief_trains(task_type, index, role, chief):
    member = Membership(_spec(PS_JOBS, task_type, index), serving_types=("ps", "worker"))
    assert (member.role, member.is_chief, member.evaluates_inline) == (role, chief, False)


@pytest.mark.parametrize("index, chief", [(0, True), (1, False)])
def test_without_a_chief_member_worker_0_is_the_chief(index, chief):
    member = Membership(_spec(WORKERS, "worker", index))
    assert (member.role, member.is_chief, member.evaluates_inline) == ("train", chief, True)


def test_a_training_member_has_no_server_to_run():
    with pytest.raises(NotImplementedError, match="'train' member has no server"):
        Membership(_spec(WORKERS, "worker", 0)).serve()


def test_lost_members_names_the_peers_that_do_not_answer():
    with socket.socket() as held:  # a port nothing listens on: refused at once
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
    jobs = {"worker": ["127.0.0.1:1", f"127.0.0.1:{port}"]}
    assert Membership(_spec(jobs, "worker", 0)).lost_members() == [f"worker:1 (127.0.0.1:{port})"]


def test_agree_takes_the_chiefs_value_from_the_gather():
    asked = []

    def gather(value):
        asked.append(value)
        return [11, 11, 4, 4]  # two replicas per worker, the chief's first

    member = Membership(_spec(WORKERS, "worker", 1), gather=gather)
    assert member.agree(4) == 11 and asked == [4]


def test_everyone_holds_only_where_every_workers_flag_does():
    gathered = {True: [1, 1, 1, 1], False: [1, 1, 0, 0]}  # worker:1 not ready in the second
    member = Membership(_spec(WORKERS, "worker", 0), gather=lambda flag: gathered[bool(flag)])
    assert member.everyone(True) and not member.everyone(False)
    assert Membership().everyone(True) and not Membership().everyone(False)


def test_check_restored_names_each_workers_step_when_they_differ():
    member = Membership(_spec(WORKERS, "worker", 0), gather=lambda step: [7, 7, 3, 3])
    with pytest.raises(UserError, match=r"\(worker:0 step 7, worker:1 step 3\): it is not shared"):
        member.check_restored(7, "/runs/a")
    Membership(_spec(WORKERS, "worker", 0), gather=lambda s: [s] * 4).check_restored(7, "/runs/a")


def test_an_evaluator_does_not_take_part_in_the_restore_check():
    def gather(step):
        raise AssertionError("an evaluator is not in the collective")

    Membership(_spec(PS_JOBS, "evaluator"), gather=gather).check_restored(1, "/runs/a")


def test_the_preemption_watch_comes_from_the_plugin():
    made = object()
    assert Membership(watch=lambda: made).watch_preemption() is made


def test_every_single_process_plugin_is_a_lone_member(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name in ("default", "one_device", "mirrored", "central_storage"):
        member = strategies.get(name).membership
        assert (member.cluster, member.role, member.is_chief) == (None, "train", True), name
