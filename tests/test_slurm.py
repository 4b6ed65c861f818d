"""Slurm: the `TF_CONFIG` each member derives from its step's environment, and jobs on a real Slurm.

The derivation tests are fast and need no Slurm: each layout below is
written out by hand (which node and which local index every rank gets, as
Slurm places them) and every rank's environment is built from it, so each
task's result is checked against the layout, not against the code's own sum.

The job tests submit the README's own `sbatch` commands to a single-node
Slurm of their own (`tests/slurm_cluster.py`), changing only `--model_dir`
and adding flags that make the run small; they skip, saying why, where Slurm
cannot start (`.ci/run` installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from strategies.cluster import slurm
from strategies.cluster import tf_config as cluster
from tests import slurm_cluster
from tests.helpers import REPO, TIMEOUT_S, environs, one_line_error
from towerflow.errors import UserError
from towerflow.processes import pick_ports

PORT = 2222
# hostlist -> the hosts `scontrol show hostnames` prints for it (checked below where it exists).
HOSTLISTS = {
    "localhost": ["localhost"],
    "node[01-03,7]": ["node01", "node02", "node03", "node7"],
    "n[9-11],m5,o[3-4,6,7-9]": ["n9", "n10", "n11", "m5", "o3", "o4", "o6", "o7", "o8", "o9"],
    "x[008-010]": ["x008", "x009", "x010"],
    "host-1,host-2": ["host-1", "host-2"],
    "rack[1-2]-n[1-2]": ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"],
    "n[01-2]": ["n01", "n02"],
    "n[1-02]": ["n1", "n2"],
    "n[1-2],,m": ["n1", "n2", "m"],
    "n[0-1],n0": ["n0", "n1", "n0"],
}
MALFORMED_HOSTLISTS = ["a[1-2]b", "a[]", "a[3-1]", "n[1-2", "n[a-b]", "n[1-2]]"]


def step_environ(nodelist: str, tasks_per_node: str, places, rank: int, **extra) -> dict:
    """The environment `srun` gives task `rank` of a step; `places[r]` is rank r's (node, local)."""
    node, local = places[rank]
    return {
        "SLURM_JOB_ID": "42",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURMD_NODENAME": node,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_NUM_TASKS": str(len(places)),
        **extra,
    }


# (nodelist, tasks per node, distribution, where each rank runs: (node, local index)).
LAYOUTS = {
    "one node, 2 tasks": ("localhost", "2", "block", [("localhost", 0), ("localhost", 1)]),
    "one node, 4 tasks": ("vm", "4", "block", [("vm", 0), ("vm", 1), ("vm", 2), ("vm", 3)]),
    "2 nodes, 1 task each": ("node[01-02]", "1(x2)", "block", [("node01", 0), ("node02", 0)]),
    "3 nodes, 2 tasks each": (
        "node[01-03]",
        "2(x3)",
        "block",
        [("node01", 0), ("node01", 1), ("node02", 0), ("node02", 1), ("node03", 0), ("node03", 1)],
    ),
    # Heterogeneous, and in Slurm's node order, not by name: n10 after n9.
    "uneven, block": (
        "n[9-10],m5",
        "2,1,3",
        "block",
        [("n9", 0), ("n9", 1), ("n10", 0), ("m5", 0), ("m5", 1), ("m5", 2)],
    ),
    "uneven, cyclic": (
        "a,b",
        "3,1",
        "cyclic",
        [("a", 0), ("b", 0), ("a", 1), ("a", 2)],
    ),
    "cyclic, 2 nodes": (
        "n[1-2]",
        "2(x2)",
        "cyclic:block",  # the second level (sockets within a node) does not matter
        [("n1", 0), ("n2", 0), ("n1", 1), ("n2", 1)],
    ),
}


def derive_all(layout, strategy: str, ps_members: int = 1, port: int = PORT) -> list[dict]:
    """Every rank's TF_CONFIG (as a dict) for one of `LAYOUTS`."""
    nodelist, tasks_per_node, distribution, places = LAYOUTS[layout]
    configs = []
    for rank in range(len(places)):
        environ = step_environ(
            nodelist, tasks_per_node, places, rank, SLURM_DISTRIBUTION=distribution
        )
        configs.append(json.loads(slurm.tf_config(environ, strategy, ps_members, port)))
    return configs


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_expand_hostlist(hostlist):
    assert slurm.expand_hostlist(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no `scontrol` (slurm-wlm) here")
def test_expand_hostlist_as_scontrol_does(tmp_path):
    # scontrol reads a config before it does anything, even with nothing to ask the controller.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=expand\nSlurmctldHost=localhost\n")
    for hostlist, hosts in HOSTLISTS.items():
        shown = subprocess.run(
            ["scontrol", "show", "hostnames", hostlist],
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert shown.stdout.split() == hosts == slurm.expand_hostlist(hostlist), hostlist


@pytest.mark.parametrize("hostlist", MALFORMED_HOSTLISTS)
def test_malformed_hostlist_is_one_line(hostlist):
    # scontrol refuses each of these ("Invalid hostlist") or prints nonsense (`n[1-2` -> `n]`).
    with pytest.raises(ValueError):
        slurm.expand_hostlist(hostlist)
    environ = step_environ(hostlist, "2", [("a", 0), ("a", 1)], 0)
    message = one_line_error("SLURM_STEP_NODELIST", slurm.tf_config, environ, "multi_worker", 1, 1)
    assert hostlist in message


def test_expand_tasks_per_node():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("4") == [4]
    assert slurm.expand_tasks_per_node("1,3(x2)") == [1, 3, 3]
    with pytest.raises(ValueError):
        slurm.expand_tasks_per_node("2(3)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_worker_every_member_a_worker_at_its_own_node_and_port(layout):
    places = LAYOUTS[layout][3]
    configs = derive_all(layout, "multi_worker")
    expected = [f"{node}:{PORT + local}" for node, local in places]
    for rank, config in enumerate(configs):
        assert config == {
            "cluster": {"worker": expected},
            "task": {"type": "worker", "index": rank},
        }


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if len(LAYOUTS[name][3]) >= 4])
@pytest.mark.parametrize("ps_members", [1, 2])
def test_parameter_server_chief_then_ps_then_workers(layout, ps_members):
    places = LAYOUTS[layout][3]
    configs = derive_all(layout, "parameter_server", ps_members, port=3000)
    addresses = [f"{node}:{3000 + local}" for node, local in places]
    expected = {
        "chief": addresses[:1],
        "ps": addresses[1 : 1 + ps_members],
        "worker": addresses[1 + ps_members :],
    }
    tasks = []
    for rank, config in enumerate(configs):
        assert config["cluster"] == expected  # one cluster, the same in every member
        task = config["task"]
        # Each member finds itself at the address of the node it runs on.
        assert expected[task["type"]][task["index"]] == addresses[rank]
        tasks.append((task["type"], task["index"]))
    assert len(set(tasks)) == len(places)  # each task once
    assert cluster.parse(json.dumps(configs[0])).is_chief


@pytest.mark.parametrize(
    "layout", ["one node, 4 tasks", "3 nodes, 2 tasks each", "2 nodes, 1 task each"]
)
def test_same_cluster_as_tensorflows_resolver_where_it_fits(layout, monkeypatch):
    # TensorFlow's SlurmClusterResolver assumes block distribution and nodes whose names
    # sort in Slurm's order; with explicit GPU counts it runs on CPU nodes.
    nodelist, tasks_per_node, _, places = LAYOUTS[layout]
    per_node = max(slurm.expand_tasks_per_node(tasks_per_node))
    jobs = {"chief": 1, "ps": 1, "worker": len(places) - 2} if len(places) >= 4 else None
    strategy = "parameter_server" if jobs else "multi_worker"
    for rank in range(len(places)):
        environ = step_environ(nodelist, tasks_per_node, places, rank)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs=jobs, port_base=PORT, gpus_per_node=per_node, gpus_per_task=1, auto_set_gpu=False
        )
        theirs = resolver.cluster_spec().as_dict()
        ours = json.loads(slurm.tf_config(environ, strategy, 1, PORT))
        assert ours["cluster"] == theirs
        assert (ours["task"]["type"], ours["task"]["index"]) == resolver.get_task_info()


def test_batch_script_of_one_task_is_a_cluster_of_one():
    environ = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURMD_NODENAME": "node03",
        "SLURM_JOB_NODELIST": "node[03-04]",
    }
    config = json.loads(slurm.tf_config(environ, "multi_worker", 1, PORT))
    assert config == {
        "cluster": {"worker": ["node03:2222"]},
        "task": {"type": "worker", "index": 0},
    }


def test_batch_script_of_several_tasks_says_run_srun():
    environ = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    message = one_line_error(
        "outside a Slurm job step", slurm.tf_config, environ, "multi_worker", 1, 1
    )
    assert "`SLURM_NTASKS`" in message and "srun -K" in message


def test_parameter_server_with_too_few_slurm_tasks_names_the_counts():
    places = LAYOUTS["one node, 2 tasks"][3]
    environ = step_environ("localhost", "2", places, 0)
    message = one_line_error("needs 3 or more", slurm.tf_config, environ, "parameter_server", 1, 1)
    assert "the step has 2" in message and "sbatch -n3" in message, message
    assert "`cluster.ps_members`" in message and "fewer ps members" in message, message
    message = one_line_error("needs 4 or more", slurm.tf_config, environ, "parameter_server", 2, 1)
    assert "2 ps" in message
    at_least_one = r"`cluster.ps_members` \(0\) must be at least 1"
    one_line_error(at_least_one, slurm.tf_config, environ, "parameter_server", 0, 1)


def test_without_slurm_says_start_with_srun():
    message = one_line_error("SLURM_PROCID", slurm.tf_config, {}, "multi_worker", 1, PORT)
    assert "srun" in message


@pytest.mark.parametrize("distribution", ["plane", "arbitrary", "plane=2"])
def test_other_distributions_say_use_block(distribution):
    places = LAYOUTS["2 nodes, 1 task each"][3]
    environ = step_environ("node[01-02]", "1(x2)", places, 1, SLURM_DISTRIBUTION=distribution)
    message = one_line_error("SLURM_DISTRIBUTION", slurm.tf_config, environ, "multi_worker", 1, 1)
    assert distribution in message and "srun -m block" in message


def test_a_member_elsewhere_than_the_layout_says_so():
    # E.g. an arbitrary placement (a hostfile) that does not report itself as such.
    places = [("node02", 0), ("node01", 0)]
    environ = step_environ("node[01-02]", "1(x2)", places, 0)
    message = one_line_error("runs on `node02`", slurm.tf_config, environ, "multi_worker", 1, 1)
    assert "puts it on `node01`" in message


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({"SLURM_STEP_NUM_TASKS": "3"}, "SLURM_STEP_NUM_TASKS"),
        ({"SLURM_STEP_TASKS_PER_NODE": "x"}, "is malformed"),
        ({"SLURM_PROCID": "-1"}, "non-negative integer"),
        ({"SLURM_PROCID": "2"}, r"`SLURM_PROCID` \(2\) must be below"),
    ],
)
def test_inconsistent_step_variables_are_one_line(change, match):
    environ = {**step_environ("localhost", "2", LAYOUTS["one node, 2 tasks"][3], 0), **change}
    one_line_error(match, slurm.tf_config, environ, "multi_worker", 1, PORT)


def test_ports_must_fit():
    environ = step_environ("vm", "4", LAYOUTS["one node, 4 tasks"][3], 0)
    message = one_line_error("cluster.port", slurm.tf_config, environ, "multi_worker", 1, 65533)
    assert "(65533)" in message and "4 port(s) per node" in message
    one_line_error("cluster.port", slurm.tf_config, environ, "multi_worker", 1, 0)
    assert json.loads(slurm.tf_config(environ, "multi_worker", 1, 65532))["cluster"]["worker"][
        3
    ] == ("vm:65535")


# What the job tests add to the README's command: a short run, no export, no evaluation.
SMALL_RUN = (
    "--config.train.steps=20",
    "--config.train.steps_per_loop=5",
    "--config.train.checkpoint_every=10",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.model.hidden_units=(16,)",
)


def readme_sbatch_commands() -> dict[str, list[str]]:
    """The `sbatch` command lines of docs/beyond-one-machine.md (as argv), by strategy."""
    page = pathlib.Path(REPO, "docs", "beyond-one-machine.md").read_text()
    commands = {}
    for line in re.findall(r"^\s*(sbatch .+)$", page, re.M):
        argv = shlex.split(line)
        strategy = re.search(r"--strategy=(\w+)", wrapped(argv))[1]
        commands[strategy] = argv
    return commands


def wrapped(argv: list[str]) -> str:
    """The command an `sbatch --wrap` line runs."""
    return argv[_wrap_index(argv)].removeprefix("--wrap=")


def with_wrapped(argv: list[str], command: list[str]) -> list[str]:
    """`argv` with the command its `--wrap` runs replaced by `command`."""
    i = _wrap_index(argv)
    prefix = "--wrap=" if argv[i].startswith("--wrap=") else ""
    return [*argv[:i], prefix + shlex.join(command), *argv[i + 1 :]]


def _wrap_index(argv: list[str]) -> int:
    """Where in `argv` the wrapped command is (`--wrap CMD` or `--wrap=CMD`)."""
    for i, arg in enumerate(argv):
        if arg == "--wrap":
            return i + 1
        if arg.startswith("--wrap="):
            return i
    raise AssertionError(f"no --wrap in {shlex.join(argv)}")


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive ports of 127.0.0.1 that are free now."""
    for _ in range(100):
        base = pick_ports(1)[0]
        with contextlib.suppress(UserError):
            return pick_ports(count, base)[0]
    raise AssertionError(f"no {count} consecutive free ports")


def job_environ() -> dict[str, str]:
    """The environment a job is submitted with: no `TF_CONFIG`, this repository importable."""
    environ = {
        **os.environ,
        # The job runs the docs' `python`: this one, with this repository importable.
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        "PYTHONPATH": REPO,
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    environ.pop("TF_CONFIG", None)
    return environ


@pytest.fixture(scope="module")
def slurm_node():
    """A single-node Slurm for this module's job tests; skips where one cannot start.

    Under `.ci/run` (`TOWERFLOW_CI` set) it fails instead: CI installs Slurm, so
    these tests must run there, not skip unseen.
    """
    reason = slurm_cluster.unavailable()
    if reason:
        (pytest.fail if os.environ.get("TOWERFLOW_CI") else pytest.skip)(reason)
    with slurm_cluster.running() as running:
        yield running


def test_readme_has_one_sbatch_command_per_cluster_strategy():
    commands = readme_sbatch_commands()
    assert set(commands) == {"multi_worker", "parameter_server"}
    for argv in commands.values():
        srun = shlex.split(wrapped(argv))
        # -K: a task that fails ends the step, instead of the others training on without it.
        assert srun[:2] == ["srun", "-K"], srun
        assert "--cluster=slurm" in srun


@pytest.mark.parametrize(
    ("strategy", "tasks"),
    [("multi_worker", {"worker": 2}), ("parameter_server", {"chief": 1, "ps": 1, "worker": 2})],
)
def test_readme_sbatch_command_trains_on_a_real_slurm(slurm_node, strategy, tasks, tmp_path):
    argv = readme_sbatch_commands()[strategy]
    count = sum(tasks.values())
    port = consecutive_free_ports(count)
    model_dir = tmp_path / "run"
    command = [
        *(a for a in shlex.split(wrapped(argv)) if not a.startswith("--model_dir=")),
        f"--model_dir={model_dir}",
        f"--config.cluster.port={port}",
        *SMALL_RUN,
    ]
    job_id = slurm_node.submit(with_wrapped(argv, command), tmp_path, job_environ())
    job = slurm_node.wait(job_id, timeout_s=TIMEOUT_S)

    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output
    # Each member found its place: the start-up lines name Slurm and every member's own port.
    assert re.search(r"\bslurm\b", job.output), job.output
    for offset in range(count):
        assert f"{slurm_cluster.NODE}:{port + offset}" in job.output, job.output
    assert json.loads((model_dir / "results.json").read_text())["step"] == 20


# What the elastic job test adds: a run of blocks of 10 steps, nothing but training.
ELASTIC_RUN = (
    "--config.train.steps=200",
    "--config.train.steps_per_loop=10",
    "--config.eval.every=0",
    "--config.train.export=False",
    "--config.model.dropout=0",
)
KILL_AT = 40  # the step after which one task is killed


def elastic_job_script(model_dir: pathlib.Path) -> str:
    """docs/elastic.md's Slurm job script: 3 agents on one node, `model_dir` in `tmp`, short."""
    page = pathlib.Path(REPO, "docs", "elastic.md").read_text()
    script = re.search(r"```sh\n(#!/bin/bash\n.*?)```", page, re.S)[1]
    assert "srun python -m trainer.elastic --workers=2:4 -- " in script, script
    script = script.replace("--workers=2:4", "--workers=2:3 --join_s=3")
    script = script.replace("/shared/runs/el", str(model_dir))
    return script.rstrip("\n") + " " + shlex.join(ELASTIC_RUN) + "\n"


@pytest.mark.slow  # about 65 s; the launcher and agent re-forms stay in the default tier
def test_docs_elastic_job_loses_a_slurm_task_and_ends_with_the_others(slurm_node, tmp_path):
    model_dir = tmp_path / "run"
    (tmp_path / "job.sh").write_text(elastic_job_script(model_dir))
    # The command line overrides the script's `#SBATCH` line: the one node runs 3 tasks.
    sbatch = ["sbatch", "--nodes=1", "--ntasks-per-node=3", "job.sh"]
    job_id = slurm_node.submit(sbatch, tmp_path, job_environ())
    output = tmp_path / f"slurm-{job_id}.out"
    deadline = time.monotonic() + TIMEOUT_S
    while f"train | step: {KILL_AT}/" not in (text := _text(output)):
        assert time.monotonic() < deadline, f"no step {KILL_AT} in time:\n{text[-4000:]}"
        time.sleep(0.5)
    task = {"SLURM_JOB_ID": str(job_id), "SLURM_PROCID": "2"}
    pids = [pid for pid, env in environs() if task.items() <= env.items()]
    assert len(pids) >= 2, pids  # its agent and the agent's trainer
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job = slurm_node.wait(job_id, timeout_s=max(1.0, deadline - time.monotonic()))

    # `srun` reports the lost task: the job is FAILED though the other two trained on.
    assert "srun: error: localhost: task 2: Killed" in job.output, job.output
    assert job.state == "FAILED", (job.state, job.output)
    assert "round 1: group of 2: localhost-0 as worker:0, localhost-1 as worker:1" in job.output
    saved = {int(s) for s in re.findall(r"elastic: .* saved step (\d+) to", job.output)}
    # The step each survivor completed; one may be a step ahead: the newest save is restored.
    assert saved and max(saved) - min(saved) <= 1, job.output
    step = max(saved)
    assert step >= KILL_AT
    restored = {int(s) for s in re.findall(r"\] restored \S+ at step (\d+)", job.output)}
    assert restored == {step}, job.output  # 0 steps lost
    results = json.loads((model_dir / "results.json").read_text())
    assert results["step"] == 200, job.output
    reforms = [(r["step"], r["from"], r["to"]) for r in results["elastic"]["reforms"]]
    assert reforms == [(step, 3, 2)], reforms


def _text(path: pathlib.Path) -> str:
    """The text of `path` so far; empty while it does not exist."""
    return path.read_text(errors="replace") if path.exists() else ""
