"""Cluster discovery: which source each environment picks, what it derives, the evaluator rule."""

import json
import os
import re

import pytest

import configs.default
from strategies.cluster import discovery
from strategies.cluster import tf_config as cluster
from tests.helpers import cli_in_process, one_line_error, tiny_config
from trainer.loop import train

# A Slurm step of 4 Slurm tasks on one node, as `srun -n4` sets it for its rank 3.
SLURM_STEP = {
    "SLURM_JOB_ID": "42",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "SLURMD_NODENAME": "node1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node1",
    "SLURM_STEP_TASKS_PER_NODE": "4",
}
# The second worker pod of a JobSet `run` with chief, worker and ps jobs (deploy/).
JOBSET_POD = {
    "JOBSET_NAME": "run",
    "REPLICATED_JOB_NAME": "worker",
    "JOB_INDEX": "0",
    "JOB_COMPLETION_INDEX": "1",
    "JOBSET_MEMBERS": "chief=1,worker=2,ps=1",
    "HOSTNAME": "run-worker-0-1",
}
SAGEMAKER = {"SM_HOSTS": '["algo-2", "algo-1"]', "SM_CURRENT_HOST": "algo-2"}
TF_CONFIG = cluster.make_tf_config({"worker": ["h0:1", "h1:1"]}, "worker", 1)


def _source(source: str) -> dict:
    return {"source": source}


@pytest.mark.parametrize(
    "environ, source",
    [
        ({}, "local"),
        ({"TF_CONFIG": ""}, "local"),  # empty is unset; spaces only are refused
        ({"TF_CONFIG": TF_CONFIG, **SLURM_STEP, **JOBSET_POD}, "tf_config"),
        ({**SLURM_STEP, **JOBSET_POD}, "slurm"),
        ({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "1"}, "local"),  # `srun -n1`: one process
        ({"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "local"),
        (JOBSET_POD, "jobset"),
        (SAGEMAKER, "sagemaker"),
        ({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"}, "local"),
    ],
)
def test_auto_picks_tf_config_then_a_scheduler_of_several_tasks_then_one_process(environ, source):
    assert discovery.detect(environ) == source
    assert discovery.find(None, "multi_worker", environ).source == source


def test_a_batch_script_of_several_tasks_is_told_to_start_them_with_srun():
    environ = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert discovery.detect(environ) == "slurm"
    one_line_error("`srun -K python -m trainer", discovery.find, None, "multi_worker", environ)


def test_a_slurm_step_gets_the_port_and_ps_count_of_the_config():
    section = {"source": "auto", "port": 3000, "ps_members": 1}
    found = discovery.find(section, "parameter_server", SLURM_STEP)
    spec = cluster.parse(found.tf_config)
    assert spec.as_dict() == {
        "chief": ["node1:3000"],
        "ps": ["node1:3001"],
        "worker": ["node1:3002", "node1:3003"],
    }
    assert (spec.task_type, spec.task_index) == ("worker", 1)
    assert found.line() == (
        "cluster: from slurm (job 42): chief node1:3000, ps node1:3001, "
        "worker node1:3002, node1:3003; this member worker:1"
    )


def test_the_old_name_ps_tasks_still_sets_the_ps_count_and_says_its_new_name_once():
    said = []
    environ = dict(SLURM_STEP)
    discovery.resolve({"ps_tasks": 2, "port": 3000}, "parameter_server", environ, said.append)
    assert cluster.from_env(environ).addresses["ps"] == ("node1:3001", "node1:3002")
    assert said == [
        "warning: `cluster.ps_tasks` is now `cluster.ps_members` (the processes of a cluster "
        "are its members); the old name goes in the next release: pass "
        "`--config.cluster.ps_members=2` instead."
    ]
    said.clear()
    discovery.resolve({"ps_members": 2, "ps_tasks": None}, "parameter_server", environ, said.append)
    assert said == []  # the new name alone: no warning


def test_the_old_and_new_ps_names_set_apart_are_one_line_error():
    section = {"ps_tasks": 2, "ps_members": 3}
    message = one_line_error(
        re.escape("`cluster.ps_tasks` (2) and `cluster.ps_members` (3)"),
        discovery.find,
        section,
        "parameter_server",
        SLURM_STEP,
    )
    assert "set only `cluster.ps_members`" in message


def test_resolve_makes_the_cluster_the_processes_tf_config():
    environ = {"TF_CONFIG": TF_CONFIG, **JOBSET_POD}
    found = discovery.resolve(_source("jobset"), "multi_worker", environ)
    assert environ["TF_CONFIG"] == found.tf_config != TF_CONFIG  # named: it wins over TF_CONFIG
    spec = cluster.from_env(environ)
    assert spec.addresses["worker"] == ("run-worker-0-0.run:2222", "run-worker-0-1.run:2222")
    assert spec.member_name == "worker:1"
    assert discovery.resolve(_source("local"), "multi_worker", environ).line() is None
    assert "TF_CONFIG" not in environ


@pytest.mark.parametrize(
    "source, environ, names",
    [
        ("tf_config", {"TF_CONFIG": ""}, ["`TF_CONFIG` is not set"]),
        ("slurm", {"SLURM_JOB_ID": "42"}, ["`SLURM_PROCID`, which is not set", "`srun`"]),
        ("jobset", {"JOBSET_NAME": "run"}, ["`REPLICATED_JOB_NAME`, `JOB_INDEX`", "deploy/"]),
        ("sagemaker", {}, ["`SM_HOSTS`, `SM_CURRENT_HOST`, which are not set"]),
    ],
)
def test_a_named_source_without_its_environment_names_what_is_missing(source, environ, names):
    message = one_line_error(
        re.escape(names[0]), discovery.find, _source(source), "multi_worker", environ
    )
    assert all(name in message for name in names), message


def test_an_unknown_source_lists_the_known_ones():
    message = one_line_error(
        re.escape("`cluster.source` ('k8s')"), discovery.find, _source("k8s"), "multi_worker", {}
    )
    assert "`auto`, `tf_config`, `slurm`, `jobset`, `sagemaker`, `local`" in message


def test_a_jobset_pod_finds_every_member_at_its_dns_name():
    environ = {**JOBSET_POD, "JOBSET_SUBDOMAIN": "svc"}
    spec = cluster.parse(discovery.jobset_tf_config(environ, 2222))
    assert spec.as_dict() == {
        "chief": ["run-chief-0-0.svc:2222"],
        "worker": ["run-worker-0-0.svc:2222", "run-worker-0-1.svc:2222"],
        "ps": ["run-ps-0-0.svc:2222"],
    }
    assert spec.address == "run-worker-0-1.svc:2222"


def test_the_old_variable_jobset_tasks_still_counts_the_pods_and_says_its_new_name_once():
    said = []
    environ = {**JOBSET_POD, "JOBSET_TASKS": JOBSET_POD["JOBSET_MEMBERS"]}
    del environ["JOBSET_MEMBERS"]
    discovery.resolve({"port": 2222}, "parameter_server", environ, said.append)
    assert cluster.from_env(environ).addresses["worker"] == (
        "run-worker-0-0.run:2222",
        "run-worker-0-1.run:2222",
    )
    assert said == [
        "warning: `JOBSET_TASKS` is now `JOBSET_MEMBERS` (the processes of a cluster are its "
        "members); the old name goes in the next release: set "
        "`JOBSET_MEMBERS=chief=1,worker=2,ps=1` instead."
    ]
    message = one_line_error(
        re.escape("`JOBSET_TASKS` (worker=3) and `JOBSET_MEMBERS` (chief=1,worker=2,ps=1)"),
        discovery.jobset_tf_config,
        {**JOBSET_POD, "JOBSET_TASKS": "worker=3"},
        2222,
    )
    assert message.endswith("set only `JOBSET_MEMBERS`."), message


@pytest.mark.parametrize(
    "change, names",
    [
        ({"REPLICATED_JOB_NAME": "trainer"}, ["(trainer) is not in `JOBSET_MEMBERS`"]),
        ({"JOB_INDEX": "1", "HOSTNAME": "run-worker-1-1"}, ["`replicas: 1`"]),
        ({"JOB_COMPLETION_INDEX": "2"}, ["`JOB_COMPLETION_INDEX` is 2", "`completions`"]),
        ({"JOB_COMPLETION_INDEX": "x"}, ["`JOB_COMPLETION_INDEX` must be a non-negative"]),
        ({"JOBSET_MEMBERS": "workers=2"}, ["`type=pods`", "`evaluator`"]),
        ({"JOBSET_MEMBERS": "worker=0"}, ["`type=pods`"]),
        ({"HOSTNAME": "run-worker-0-1-x7k2p"}, ["`network.enableDNSHostnames: true`"]),
    ],
)
def test_a_jobset_pod_that_does_not_fit_is_one_line(change, names):
    message = one_line_error(
        re.escape(names[0]), discovery.jobset_tf_config, {**JOBSET_POD, **change}, 2222
    )
    assert all(name in message for name in names), message


def test_a_sagemaker_job_makes_every_host_a_worker_in_name_order():
    found = discovery.find({"source": "auto", "port": 5000}, "multi_worker", SAGEMAKER)
    spec = cluster.parse(found.tf_config)
    assert spec.addresses == {"worker": ("algo-1:5000", "algo-2:5000")}
    assert spec.member_name == "worker:1"


def test_the_start_up_line_shortens_a_long_job():
    jobs = {"chief": ["c:1"], "worker": [f"w{i}:1" for i in range(100)]}
    found = discovery.Found("tf_config", cluster.make_tf_config(jobs, "worker", 7))
    assert found.line() == (
        "cluster: from TF_CONFIG: chief c:1, worker w0:1, w1:1, w2:1 ... (100 in all); "
        "this member worker:7"
    )


def test_the_defaults_are_the_default_configs_cluster_section():
    cluster = configs.default.get_config().cluster.to_dict()
    del cluster["elastic"]  # `cluster.elastic` is the elastic job's (trainer.loop.elastic)
    assert cluster == discovery.DEFAULTS
    assert discovery.settings({"port": 1}) == {**discovery.DEFAULTS, "port": 1}


# The evaluator rule: one writer of `model_dir/eval`, in either form of `TF_CONFIG`.

_PS_JOBS = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
_UNLISTED_EVALUATOR = json.dumps({"cluster": _PS_JOBS, "task": {"type": "evaluator"}})


def test_an_evaluator_the_chief_cannot_know_of_is_refused():
    one_line_error(
        re.escape("`--config.cluster.sidecar_evaluator=True` to every member"),
        discovery.resolve,
        None,
        "parameter_server",
        {"TF_CONFIG": _UNLISTED_EVALUATOR},
    )
    with_setting = {"sidecar_evaluator": True}
    assert discovery.resolve(with_setting, "parameter_server", {"TF_CONFIG": _UNLISTED_EVALUATOR})
    listed = cluster.make_tf_config({**_PS_JOBS, "evaluator": ["127.0.0.1:4"]}, "evaluator", 0)
    assert discovery.resolve(None, "parameter_server", {"TF_CONFIG": listed})


def test_with_a_sidecar_evaluator_only_the_evaluator_writes_eval(tmp_path, monkeypatch):
    """The chief trains without evaluating; the evaluator outside `cluster` evaluates."""
    model_dir = str(tmp_path / "run")
    config = tiny_config(**{"cluster.sidecar_evaluator": True})
    monkeypatch.delenv("TF_CONFIG", raising=False)
    results = train.train_and_evaluate(config, model_dir)
    assert results["step"] == 20 and results["eval"] == {}
    assert not os.path.exists(os.path.join(model_dir, "eval"))

    monkeypatch.setenv("TF_CONFIG", _UNLISTED_EVALUATOR)
    config.strategy.name = "parameter_server"
    results = train.train_and_evaluate(config, model_dir)
    assert results["step"] == 20 and results["eval"]["examples"] == 360
    assert os.listdir(os.path.join(model_dir, "eval"))


def test_a_config_without_a_cluster_section_is_one_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = tiny_config(**{"strategy.name": "multi_worker"})
    del config["cluster"]  # a user's config file from before the section existed
    assert train.make_strategy(config).membership.cluster is None
    assert not discovery.sidecar_evaluator(config.get("cluster"))


# In-process (no TF_CONFIG here, as `run_cli` leaves none): tests/test_cli.py runs the
# command's one-line exits in a process.
def test_the_old_ps_tasks_flag_is_accepted_with_a_one_line_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    code, out, err = cli_in_process(
        "--cluster=jobset",
        "--config.cluster.ps_tasks=2",
        f"--model_dir={tmp_path / 'run'}",
        capsys=capsys,
    )
    assert code == 2, err
    (warning,) = [line for line in out.splitlines() if "ps_tasks" in line]
    assert warning.startswith("warning: `cluster.ps_tasks` is now `cluster.ps_members`"), warning
    assert warning.endswith("pass `--config.cluster.ps_members=2` instead."), warning


def test_the_cluster_flag_names_the_source_and_a_missing_one_is_one_line(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    code, _, err = cli_in_process(
        "--cluster=jobset", f"--model_dir={tmp_path / 'run'}", capsys=capsys
    )
    assert code == 2, err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("error: the `jobset` cluster source needs `JOBSET_NAME`"), line
    assert not (tmp_path / "run").exists()
