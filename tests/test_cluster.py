"""`TF_CONFIG` parsing: valid clusters, and a clear one-line error for each malformed one."""

import json

import pytest

from strategies.cluster import tf_config as cluster
from towerflow.errors import UserError

FULL = {
    "cluster": {
        "chief": ["10.0.0.1:2222"],
        "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "ps": ["10.0.0.4:2222"],
        "evaluator": ["10.0.0.5:2222"],
    },
    "task": {"type": "worker", "index": 1},
}


def _with(task=None, **jobs):
    config = {"cluster": jobs}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def test_none_and_blank_mean_no_cluster():
    assert cluster.parse(None) is None
    assert cluster.parse("") is None
    assert cluster.parse("  \n") is None
    assert cluster.from_env({}) is None


def test_full_cluster_parses():
    spec = cluster.parse(json.dumps(FULL))
    assert spec.addresses["worker"] == ("10.0.0.2:2222", "10.0.0.3:2222")
    assert (spec.task_type, spec.task_index, spec.rpc_layer) == ("worker", 1, "grpc")
    assert (spec.num_workers, spec.num_ps) == (2, 1)
    assert spec.has_chief and spec.has_evaluator and not spec.is_chief
    assert spec.address == "10.0.0.3:2222"
    assert spec.as_dict() == {
        "chief": ["10.0.0.1:2222"],
        "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "ps": ["10.0.0.4:2222"],
    }, "the evaluator is not part of the training cluster"


def test_from_env_reads_tf_config():
    spec = cluster.from_env({"TF_CONFIG": json.dumps(FULL)})
    assert spec.task_type == "worker"


@pytest.mark.parametrize(
    "task, is_chief",
    [
        ({"type": "chief", "index": 0}, True),
        ({"type": "worker", "index": 0}, False),
        ({"type": "ps", "index": 0}, False),
        ({"type": "evaluator", "index": 0}, False),
    ],
)
def test_chief_is_the_chief_member(task, is_chief):
    assert cluster.parse(json.dumps({**FULL, "task": task})).is_chief == is_chief


def test_worker_0_is_chief_without_a_chief_member():
    jobs = {"worker": ["h:1", "h:2"]}
    assert cluster.parse(_with({"type": "worker", "index": 0}, **jobs)).is_chief
    assert not cluster.parse(_with({"type": "worker", "index": 1}, **jobs)).is_chief


def test_evaluator_may_be_absent_from_cluster():
    spec = cluster.parse(_with({"type": "evaluator", "index": 0}, worker=["h:1", "h:2"]))
    assert spec.task_type == "evaluator" and spec.has_evaluator
    assert spec.address is None and not spec.is_chief


def test_a_job_given_by_index_as_tensorflow_takes_it_is_a_list():
    text = _with({"type": "worker", "index": 1}, worker={"1": "h:2", "0": "h:1"}, ps=["h:3"])
    spec = cluster.parse(text)
    assert spec.addresses == {"worker": ("h:1", "h:2"), "ps": ("h:3",)}
    assert spec.address == "h:2"


def test_a_one_member_cluster_needs_no_task_key():
    spec = cluster.parse(_with(worker=["localhost:2222"]))
    assert (spec.task_type, spec.task_index, spec.is_chief) == ("worker", 0, True)


def test_index_defaults_to_0_for_a_one_member_job():
    spec = cluster.parse(_with({"type": "chief"}, chief=["h:1"], worker=["h:2"]))
    assert spec.task_index == 0


def test_make_tf_config_round_trips():
    jobs = {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001"], "ps": ["127.0.0.1:5002"]}
    text = cluster.make_tf_config(jobs, "ps", 0)
    spec = cluster.parse(text)
    assert spec.as_dict() == jobs
    assert (spec.task_type, spec.task_index, spec.address) == ("ps", 0, "127.0.0.1:5002")


def test_make_tf_config_refuses_a_bad_cluster():
    with pytest.raises(UserError, match="out|from 0 to 0"):
        cluster.make_tf_config({"worker": ["127.0.0.1:5000"]}, "worker", 3)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"cluster": ', ["not valid JSON", "line 1, column 13", "JSON object such as"]),
        ("[1, 2]", ["must be a JSON object", "[1, 2]"]),
        ('{"task": {"type": "worker"}}', ["has no `cluster`", "add one"]),
        (json.dumps({"cluster": ["h:1"]}), ["`cluster` must be a JSON object", '["h:1"]']),
        (json.dumps({"cluster": {}}), ["`cluster` is empty", "map task types"]),
        (
            _with(trainer=["h:1"]),
            ['unknown task type "trainer"', "`chief`, `worker`, `ps`, `evaluator`"],
        ),
        (_with(worker="h:1"), ["`cluster.worker` must be a non-empty list", '"h:1"']),
        (_with(worker=[]), ["`cluster.worker` must be a non-empty list", "[]"]),
        (_with(worker=["h:1", 2]), ["`cluster.worker` must be a non-empty list", '["h:1", 2]']),
        (_with(worker=["h"]), ['address "h" is not host:port', "from 1 to 65535"]),
        (_with(worker=[":2222"]), ['address ":2222" is not host:port']),
        (_with(worker=["h:0"]), ['address "h:0"', "from 1 to 65535"]),
        (_with(worker=["h:65536"]), ['address "h:65536"', "from 1 to 65535"]),
        (_with(worker=["h:http"]), ['address "h:http"']),
        (
            _with({"type": "chief"}, chief=["h:1"], worker=["h:2", "h:1"]),
            ['gives "h:1" to both chief:0 and worker:1', "its own host:port"],
        ),
        (
            _with(worker=["h:1", "h:2"]),
            ["has no `task`", "more than one member", '"type": "worker"'],
        ),
        (_with("worker", worker=["h:1"]), ["`task` must be a JSON object", '"worker"']),
        (
            _with({"type": "master", "index": 0}, worker=["h:1"]),
            ['`task.type` is "master"', "`chief`, `worker`, `ps`, `evaluator`"],
        ),
        (_with({"index": 0}, worker=["h:1"]), ["`task.type` is missing", "use one of"]),
        (
            _with({"type": "ps", "index": 0}, worker=["h:1", "h:2"]),
            ['`task.type` is "ps" but `cluster` has no such members', "`worker`", "add `ps`"],
        ),
        (
            _with({"type": "worker", "index": "1"}, worker=["h:1", "h:2"]),
            ['`task.index` is "1"', "integer from 0 to 1"],
        ),
        (
            _with({"type": "worker", "index": True}, worker=["h:1", "h:2"]),
            ["`task.index` is true", "integer from 0 to 1"],
        ),
        (
            _with({"type": "worker", "index": 2}, worker=["h:1", "h:2"]),
            ["`task.index` is 2", "`worker` has 2 members", "from 0 to 1"],
        ),
        (
            _with({"type": "worker", "index": -1}, worker=["h:1", "h:2"]),
            ["`task.index` is -1", "from 0 to 1"],
        ),
        (
            _with({"type": "worker"}, worker=["h:1", "h:2"]),
            ["`task.index` is missing", "from 0 to 1"],
        ),
        (
            _with({"type": "evaluator", "index": 1}, worker=["h:1"]),
            ["`task.index` is 1", "`evaluator` has 1 member;", "from 0 to 0"],
        ),
        (
            _with({"type": "worker", "index": 0}, chief=["h:1", "h:2"], worker=["h:3"]),
            ["`cluster.chief` has 2 addresses", "at most one chief"],
        ),
        (
            _with({"type": "worker", "index": 0}, worker=["h:1"], evaluator=["h:2", "h:3"]),
            ["`cluster.evaluator` has 2 addresses", "at most one evaluator"],
        ),
        (
            _with({"type": "chief", "index": 0}, chief=["h:1"], ps=["h:2"]),
            ["has `ps` members but no `worker`", "add `worker` addresses"],
        ),
        (
            json.dumps({"cluster": {"worker": ["h:1"]}, "rpc_layer": 7}),
            ["`rpc_layer` must be a string", "7"],
        ),
        # TFJob's `enableDynamicWorker` gives a worker only itself (and the ps members).
        (
            _with({"type": "worker", "index": 1}, worker={"1": "h:1"}, ps=["h:2"]),
            ["`cluster.worker` lists only index(es) [1]", "`enableDynamicWorker: false`"],
        ),
        (
            json.dumps({"sparseCluster": {"worker": {"1": "h:1"}}, "task": {"type": "worker"}}),
            ["has a `sparseCluster`", "`enableDynamicWorker: false`"],
        ),
        (_with(worker={"first": "h:1"}), ['keys ["first"]', 'as in {"0": "host:2222"}']),
    ],
)
def test_malformed_tf_config_is_a_one_line_user_error(text, expected):
    with pytest.raises(UserError) as info:
        cluster.parse(text)
    message = str(info.value)
    assert message.startswith("`TF_CONFIG` ")
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
