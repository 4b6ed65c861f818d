"""Input on the tf.data service (`data.service`): the same training, its servers, its failures.

One dispatcher and one data worker, started once for this module with
`python -m trainer.data_service`, serve the in-process runs, which must train
to the weights of in-process input for every kind of source under `one_device`
and `mirrored`, and resume exactly. `local:N` (servers started by the trainer)
runs through the command line; so do the failures: a killed data worker or
dispatcher ends the run with one line and exit 144, never a hang (and, as
root, that run shows the trainer and its servers in a loopback-only network
namespace); bad addresses and counts are one line, bounded, with `model_dir`
untouched. Commands run forked from the tests' server (`run_cli`,
`tests.forked`), TensorFlow imported once; the data servers a trainer or a
launcher starts (`local:N`, `--data_workers`) are processes of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.forked import Forked
from tests.helpers import (
    REPO,
    TIMEOUT_S,
    checkpoint_values,
    cli_in_process,
    kill,
    launched,
    one_line_error,
    run_cli,
    spawn,
    start_cli,
    tiny_config,
)
from trainer import data_service as command
from trainer.data import service_client
from trainer.launch import pick_ports
from trainer.loop import train

STEPS, BLOCK = 15, 3  # 5 blocks: 5 readings of the time steps wait for input
USER_EXAMPLES = 96


def pipeline(input_context, split, global_batch_size):
    """A user's `dataset_fn`: seeded, sharded by the input context."""
    x = tf.random.stateless_normal([USER_EXAMPLES, 6], seed=[1, 2])
    y = tf.cast(x[:, 0] + x[:, 1] > 0, tf.int32)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    if split == "train":
        examples = examples.shuffle(USER_EXAMPLES, seed=3)
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    return examples.batch(batch, drop_remainder=split == "train")


def _write_csv(directory) -> dict:
    rng = np.random.RandomState(0)
    for name, rows in (("train", 80), ("eval", 24)):
        x = rng.normal(size=(rows, 4))
        table = np.column_stack([x, (x[:, 0] > 0).astype(int)])
        np.savetxt(
            directory / f"{name}.csv",
            table,
            delimiter=",",
            fmt="%.6g",
            header="a,b,c,d,label",
            comments="",
        )
    return {
        "data.name": "csv",
        "data.train_files": str(directory / "train.csv"),
        "data.eval_files": str(directory / "eval.csv"),
        "data.input_shape": (4,),
        "data.num_classes": 2,
    }


SOURCES = {
    "digits": lambda directory: {},
    "csv": _write_csv,
    "user": lambda directory: {"data.name": f"{__name__}:pipeline", "data.num_classes": 2},
    "task": lambda directory: {"task.name": "tests.user_tasks:DictTask"},
}


@pytest.fixture(scope="module")
def dispatcher():
    """A dispatcher and one data worker, as a user runs them: `python -m trainer.data_service`."""
    ports = pick_ports(2)
    _serve(ports[0], "--role=dispatcher")
    _serve(ports[1], "--role=worker", f"--dispatcher=127.0.0.1:{ports[0]}")
    address = f"grpc://127.0.0.1:{ports[0]}"
    assert service_client.wait_until_served(address, None, timeout_s=120) == 1
    return address


def _serve(port: int, *args: str) -> None:
    """`python -m trainer.data_service --port=PORT ARGS`, serving until the module ends.

    Forked from the tests' server (`tests.forked`); returns once it listens, so that the
    first fork, which starts the server, is done before the next.
    """
    command = (f"--port={port}", *args)
    Forked("trainer.data_service", *command, cwd=REPO, timeout=None).start()
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"{command} never listened"
            time.sleep(0.05)


def _run(model_dir, fields: dict, steps: int = STEPS) -> dict:
    fields = {"train.steps": steps, "train.steps_per_loop": BLOCK, **fields}
    config = tiny_config(**{"train.global_batch_size": 16, **fields})
    return train.train_and_evaluate(config, str(model_dir), mode="train")


def _assert_same_weights(a, b) -> None:
    first, second = checkpoint_values(a), checkpoint_values(b)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_allclose(second[name], first[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def served(tmp_path_factory, dispatcher) -> Callable[[str, str], tuple[pathlib.Path, dict]]:
    """`served(source, strategy)`: a run of `STEPS` on the module's service, once a module.

    Returns its `model_dir` (beside it, in `in_process`, the same run's input in the
    trainer) and its results.
    """
    runs: dict[tuple[str, str], tuple[pathlib.Path, dict]] = {}

    def run(source: str, strategy: str) -> tuple[pathlib.Path, dict]:
        if (source, strategy) not in runs:
            tmp_path = tmp_path_factory.mktemp(f"{source}_{strategy}")
            fields = {"strategy.name": strategy, **SOURCES[source](tmp_path)}
            _run(tmp_path / "in_process", fields)
            results = _run(tmp_path / "service", {**fields, "data.service": dispatcher})
            runs[source, strategy] = tmp_path / "service", results
        return runs[source, strategy]

    return run


@pytest.mark.parametrize(
    "source, strategy",
    [(s, "one_device") for s in SOURCES] + [("user", "mirrored")],
)
def test_each_source_trains_as_in_process_input(served, dispatcher, source, strategy):
    model_dir, results = served(source, strategy)
    _assert_same_weights(model_dir.parent / "in_process", model_dir)
    assert results["input"]["address"] == dispatcher
    assert results["input"]["processing_mode"] == "parallel_epochs"


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, dispatcher, served):
    straight, _ = served("digits", "one_device")
    fields = {"strategy.name": "one_device", "data.service": dispatcher}
    _run(tmp_path / "resumed", fields, steps=2 * BLOCK)
    _run(tmp_path / "resumed", fields, steps=STEPS)
    _assert_same_weights(straight, tmp_path / "resumed")


def test_dynamic_sharding_sends_every_batch_once(dispatcher):
    config = tiny_config(**{"data.service": dispatcher, "data.service_sharding": "dynamic"})
    with service_client.started(config.data, True, print) as running:
        dataset = service_client.wrap(_digits(config), running, "run")
        context = tf.distribute.InputContext(2, 1, 2)  # one of two trainers' pipelines
        whole = tf.distribute.InputContext(1, 0, 2)  # the one stream, for 2 replicas
        fresh = list(_digits(config).train_fn(16, seed=0)(whole).take(6))
        reader = dataset.train_fn(16, seed=0)(context)
        assert reader.options().autotune.enabled is False, "the client's reader has the settings"
        served = list(reader.take(6))
    for (x, y), (want_x, want_y) in zip(served, fresh, strict=True):
        np.testing.assert_array_equal(y, want_y)  # one worker: the one stream, in order
        np.testing.assert_allclose(x, want_x)


def _digits(config):
    from trainer import data

    return data.get(config.data)


# --- the command line: local servers, start-up line, results, failures ------------------


def _long_run(tmp_path, *flags: str) -> list[str]:
    return [
        "--strategy=one_device",
        f"--model_dir={tmp_path / 'run'}",
        "--config.train.steps=100000",
        "--config.train.steps_per_loop=20",
        "--config.train.checkpoint_every=100",
        *flags,
    ]


@dataclasses.dataclass
class Killed:
    """A run whose server was killed: how it ended, and where its processes ran meanwhile."""

    code: int
    output: str
    seconds: float  # from the kill to the trainer's end
    # The trainer's and each server's pid: its network namespace and interfaces, while it trained.
    networks: dict[int, tuple[str, list[str]]]


def _network(pid: int) -> tuple[str, list[str]]:
    """The network namespace of `pid`, and the interfaces it sees."""
    devices = pathlib.Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return os.readlink(f"/proc/{pid}/ns/net"), [d.split(":")[0].strip() for d in devices]


def _run_and_kill(tmp_path, server: str, *flags: str) -> Killed:
    """Runs a long `local:` run, kills `server` once it trains.

    The trainer is forked from the tests' server (`tests.forked`), its output read as
    it comes. Every server it started is gone once it has exited.
    """
    flags = _long_run(tmp_path, *flags)
    trainer = Forked("trainer", *flags, cwd=str(tmp_path), output=tmp_path / "output")
    trainer.start()
    lines, pids, killed_at, networks, left = [], {}, None, {}, None
    for line in trainer.lines():
        lines.append(line)
        if found := re.match(r"\[(data:\S+)\] .* serving at .*\(pid (\d+)\)", line):
            pids[found.group(1)] = int(found.group(2))
        if killed_at is None and line.startswith("train | step: 20/"):  # the first block
            networks = {pid: _network(pid) for pid in (trainer.pid, *pids.values())}
            os.kill(pids[server], signal.SIGKILL)
            killed_at = time.monotonic()
            left = _running_when_it_ends(trainer.pid, [p for s, p in pids.items() if s != server])
    assert killed_at is not None, "\n".join(lines[-30:])
    assert not left(), "servers the trainer left running"
    code = trainer.result.returncode
    return Killed(code, "\n".join(lines), time.monotonic() - killed_at, networks)


def _running_when_it_ends(pid: int, others: list[int]) -> Callable[[], list[int]]:
    """Of `others`, those still running the moment `pid` ends (called once it has ended).

    Watched in a thread (pidfds): once a forked command ended, the tests' helpers kill
    what it left running, which would be gone by the time the test looks.
    """
    own, theirs = os.pidfd_open(pid), {os.pidfd_open(other): other for other in others}
    running: list[int] = []

    def watch() -> None:
        select.select([own], [], [])
        ended, _, _ = select.select(list(theirs), [], [], 0)
        running.extend(other for fd, other in theirs.items() if fd not in ended)
        for fd in (own, *theirs):
            os.close(fd)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def result() -> list[int]:
        watcher.join()
        return running

    return result


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """`killed_run(server)`: a `local:1` run, `server` killed once it trains; one run a server."""
    runs: dict[str, Killed] = {}

    def run(server: str) -> Killed:
        if server not in runs:
            tmp_path = tmp_path_factory.mktemp("killed")
            runs[server] = _run_and_kill(tmp_path, server, "--config.data.service=local:1")
        return runs[server]

    return run


@pytest.mark.parametrize("server", ["data:worker:0", "data:dispatcher"])
def test_a_killed_server_ends_the_run_with_one_line_and_exit_144(killed_run, server):
    # The README's command: `python -m trainer --strategy=one_device --config.data.service=local:1`
    run = killed_run(server)
    assert re.search(
        r"^input: tf\.data service at grpc://127\.0\.0\.1:\d+, 1 worker beside the trainer, "
        r"sharding off \(parallel_epochs\); eval in the trainer$",
        run.output,
        re.M,
    )
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert run.code == 144, run.output[-3000:]
    assert len(errors) == 1 and f"{server} (127.0.0.1:" in errors[0], run.output[-3000:]
    assert "resumes from its newest checkpoint" in errors[0]
    assert run.seconds < 30  # noticed in about a second; never a hang


def test_a_trainers_local_data_service_listens_in_a_loopback_only_namespace(killed_run):
    # `towerflow.netns`; tests/test_local_network.py tries such a namespace from another host.
    if os.geteuid() != 0:  # under `.ci/run` (root) it must run
        (pytest.fail if os.environ.get("TOWERFLOW_CI") else pytest.skip)("needs root")
    networks = killed_run("data:worker:0").networks
    assert len(networks) == 3  # the trainer, its dispatcher and its data worker
    for namespace, devices in networks.values():
        assert namespace != _network(os.getpid())[0]
        assert devices == ["lo"]


@pytest.mark.slow  # a kill mid-run
def test_under_dynamic_sharding_the_other_worker_takes_over(tmp_path):
    flags = ("--config.data.service=local:2", "--config.data.service_sharding=dynamic")
    run = _run_and_kill(tmp_path, "data:worker:1", *flags, "--config.train.steps=400")
    output = run.output
    assert run.code == 0, output[-3000:]
    assert "data:worker:1 (127.0.0.1:" in output and "take over its work" in output
    assert "train | step: 400/400" in output
    assert "input: tf.data service at grpc://127.0.0.1:" in output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["input"]["processing_mode"] == "distributed_epoch"
    assert results["input"]["workers"] == 2 and results["input"]["local"]


# --- bad input: one line, bounded, model_dir untouched -----------------------------------


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"data.service": "local:0"}, r"'local:0' starts 0 data workers.*at least 1"),
        ({"data.service": "host:5050"}, r"'host:5050' is not a tf.data service address"),
        ({"data.service": "local:2"}, r"2 data workers.*'off'.*send every batch again"),
        ({"data.service": "local:1", "data.service_sharding": "some"}, r"Unknown.*'some'"),
    ],
)
def test_a_bad_address_or_count_is_one_line(fields, match):
    config = tiny_config(**fields)
    one_line_error(match, lambda: service_client.started(config.data, True, print).__enter__())


def test_nothing_listening_is_one_line_within_the_timeout():
    (port,) = pick_ports(1)
    config = tiny_config(**{"data.service": f"grpc://127.0.0.1:{port}"})
    config.data.service_timeout_s = 1.0
    start = time.monotonic()
    one_line_error(
        r"nothing answers at grpc://127.0.0.1:\d+ within 1 s; start a dispatcher",
        lambda: service_client.started(config.data, True, print).__enter__(),
    )
    assert time.monotonic() - start < 10


def test_a_dispatcher_that_never_answers_is_one_line_and_exit_2(tmp_path, capsys):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, says nothing
    port = silent.getsockname()[1]
    with silent:
        code, _, err = cli_in_process(
            f"--model_dir={tmp_path / 'run'}",
            f"--config.data.service=grpc://127.0.0.1:{port}",
            "--config.data.service_timeout_s=3",
            capsys=capsys,
        )
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith("error: `data.service` 'grpc://")
    assert "sent no data within 3 s" in err
    assert not (tmp_path / "run").exists()  # model_dir untouched


# --- python -m trainer.data_service: its server from the flags or TF_CONFIG ---------------

DATA_CLUSTER = {"dispatcher": ["host0:5050"], "data_worker": ["host1:5051", "host2:5052"]}


def _tf_config(task_type: str, index: int) -> str:
    return json.dumps({"cluster": DATA_CLUSTER, "task": {"type": task_type, "index": index}})


def test_the_server_comes_from_tf_config_as_for_the_trainer():
    worker = command.plan(None, None, None, tf_config=_tf_config("data_worker", 1))
    assert (worker.kind, worker.port, worker.dispatcher) == ("worker", 5052, "host0:5050")
    dispatcher = command.plan(None, None, None, "/jobs/d", tf_config=_tf_config("dispatcher", 0))
    assert (dispatcher.kind, dispatcher.port, dispatcher.work_dir) == (
        "dispatcher",
        5050,
        "/jobs/d",
    )
    flags = command.plan("worker", 7000, "grpc://h:1", tf_config=None)
    assert (flags.port, flags.dispatcher) == (7000, "h:1")


def test_a_worker_is_reached_at_its_address_in_the_cluster():
    worker = command.plan(None, None, None, tf_config=_tf_config("data_worker", 1))
    assert worker.host == "host2"
    assert (
        command.plan(None, None, None, host="h9", tf_config=_tf_config("data_worker", 1)).host
        == "h9"
    )
    assert command.plan("worker", 1, "h:1").host == "localhost"


def test_a_kubernetes_name_data_worker_is_a_data_worker():
    cluster = {"dispatcher": ["d:5050"], "data-worker": ["w0:5050", "w1:5050"]}
    text = json.dumps({"cluster": cluster, "task": {"type": "data-worker", "index": 1}})
    worker = command.plan(None, None, None, tf_config=text)
    assert (worker.kind, worker.port, worker.dispatcher, worker.host) == (
        "worker",
        5050,
        "d:5050",
        "w1",
    )


SLURM_STEP = {  # `srun -n3 python -m trainer.data_service --cluster=slurm` on 2 nodes
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
}


@pytest.mark.parametrize(
    "rank, role, port, dispatcher, host",
    [(0, "dispatcher", 5050, "", "localhost"), (1, "worker", 5051, "n1:5050", "n1"),
     (2, "worker", 5050, "n1:5050", "n2")],
)  # fmt: skip
def test_a_slurm_step_is_a_dispatcher_and_data_workers(rank, role, port, dispatcher, host):
    environ = {**SLURM_STEP, "SLURM_PROCID": str(rank)}
    for source, first_port in (("slurm", None), ("auto", 5050)):  # `--port`: the node's first
        server = command.server(source, None, first_port, None, environ=environ)
        assert (server.kind, server.port, server.dispatcher, server.host) == (
            role,
            port,
            dispatcher,
            host,
        )
    on_7000 = command.server("slurm", None, 7000, None, environ=environ)
    assert on_7000.port == port + 7000 - 5050


def test_the_cluster_source_is_chosen_as_the_trainers():
    text = _tf_config("dispatcher", 0)
    assert command.discover("auto", None, {"TF_CONFIG": text}).tf_config == text
    local = command.discover("local", None, {"TF_CONFIG": text})
    assert local.tf_config is None  # the flags alone
    sagemaker = {"SM_HOSTS": '["a", "b"]', "SM_CURRENT_HOST": "a"}
    assert command.discover("auto", None, sagemaker).tf_config is None
    assert command.server("tf_config", None, 6000, None, environ={"TF_CONFIG": text}).port == 6000
    # `local:N`'s servers, started with `--role` in a trainer's Slurm step or JobSet pod.
    pod = {"JOBSET_NAME": "j", "REPLICATED_JOB_NAME": "worker", "JOBSET_MEMBERS": "worker=2"}
    for environ in ({**SLURM_STEP, "SLURM_PROCID": "1"}, pod):
        beside = command.server("auto", "worker", 4242, "127.0.0.1:4241", "", "127.0.0.1", environ)
        assert (beside.port, beside.dispatcher) == (4242, "127.0.0.1:4241")
    one_line_error(r"`--cluster=tf_config`, but `TF_CONFIG` is not set", command.discover,
                   "tf_config", None, {})  # fmt: skip
    one_line_error(r"`SLURM_PROCID` is not set", command.discover, "slurm", None, {})
    one_task = {**SLURM_STEP, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    one_line_error(r"a Slurm step of 1 task runs no data service", command.discover, "slurm",
                   None, one_task)  # fmt: skip
    one_line_error(r"the `jobset` cluster source needs", command.discover, "jobset", None, {})


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, 1, None), r"`--role` is not given"),
        (("worker", 1, None), r"`--dispatcher` \(None\) must be"),
        (("dispatcher", None, None), r"`--port` \(None\) must be a port number"),
    ],
)
def test_a_server_without_role_port_or_dispatcher_is_one_line(args, match):
    one_line_error(match, command.plan, *args)


# --- local clusters: python -m trainer.launch --data_workers=N ----------------------------

# Digits trained to an accuracy in 100 steps: at 3 times the default rate, in-process input
# reaches 0.98 there (at the default rate, 0.95 in 100 steps and 0.975 in 200).
SHORT_TRAINING = ("--config.train.steps=100", "--config.optimizer.learning_rate=3e-3")


@pytest.mark.parametrize(
    "topology, strategy, mode",
    [
        (["--workers=2", "--data_workers=1"], "multi_worker", "parallel_epochs"),
        (["--workers=2", "--ps=1", "--data_workers=2"], "parameter_server", "distributed_epoch"),
    ],
)
def test_a_local_cluster_trains_on_the_launchers_data_workers(tmp_path, topology, strategy, mode):
    result = launched(
        *topology,
        "--",
        f"--strategy={strategy}",
        f"--model_dir={tmp_path / 'run'}",
        *SHORT_TRAINING,
        "--config.eval.every=0",
        "--config.train.export=False",
        cwd=tmp_path,
    )
    assert "[data:dispatcher] dispatcher serving at" in result.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["input"]["processing_mode"] == mode
    assert results["eval"]["accuracy"] > 0.93  # asynchronous workers: 0.958-0.98 here


# --- how long steps wait for input ---------------------------------------------------------


def slow_pipeline(input_context, split, global_batch_size):
    """`pipeline`, each batch after 4 GFLOP of busy work (about 60 ms): input-bound training.

    A data worker reads ahead: the work must outlast the step by far, even on a loaded
    machine, for the steps to wait on it.
    """

    def slowly(x, y):
        m = tf.random.stateless_normal([256, 256], seed=[0, 0])
        m = tf.foldl(lambda a, _: tf.linalg.normalize(a @ m)[0], tf.range(120), initializer=m)
        return x + 0 * tf.reduce_sum(m), y  # made to depend on the busy work

    return pipeline(input_context, split, global_batch_size).map(slowly)


def test_the_time_steps_wait_for_input_is_reported(tmp_path, dispatcher, served):
    # The loop times its reads alike wherever the input runs: tests/test_input_wait.py
    # shows a slow pipeline in the trainer's own process.
    ready, _ = served("user", "one_device")  # `pipeline`, on the service
    slow = {"data.name": f"{__name__}:slow_pipeline", "data.num_classes": 2}
    _run(tmp_path / "slow", {"strategy.name": "one_device", "data.service": dispatcher, **slow})
    waits = {  # 5 blocks each: the median outlasts 2 odd ones
        name: np.median(_tensorboard(model_dir, "input_wait_ms"))
        for name, model_dir in (("pipeline", ready), ("slow_pipeline", tmp_path / "slow"))
    }
    # Most of each step: 32 ms here alone, 19-34 beside 3 busy processes (a ready one 0.4-1.1).
    assert waits["slow_pipeline"] > 1
    assert waits["pipeline"] < waits["slow_pipeline"] / 2


def _tensorboard(model_dir, tag: str) -> list[float]:
    """The values of `tag` in TensorBoard's "train" run of `model_dir`, one per block."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(
        str(model_dir / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    return [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]


# --- sweeps: python -m trainer.sweep --share_input -----------------------------------------


@pytest.mark.slow  # about 40 s; the launcher's data workers stay in the default tier
def test_sweep_trials_with_one_pipeline_share_one_stream(tmp_path):
    result = run_cli(
        "--sweep.optimizer.learning_rate=1e-3,3e-3",
        "--parallel=2",
        "--share_input",
        f"--sweep_dir={tmp_path / 'sweep'}",
        "--",
        "--strategy=one_device",
        "--config.train.steps=100",
        "--config.train.export=False",
        cwd=tmp_path,
        module="trainer.sweep",
    )
    helpers.assert_exit(result)
    assert re.search(r"^\[sweep\] trials 00, 01: one shared input stream", result.stdout, re.M)
    inputs = [
        json.loads(path.read_text())["input"]
        for path in sorted((tmp_path / "sweep").glob("*/results.json"))
    ]
    assert len(inputs) == 2 and inputs[0]["job"] == inputs[1]["job"] != ""
    assert inputs[0]["address"] == inputs[1]["address"]
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert "data.service" not in json.dumps(rows)  # a setting, not a swept value


@pytest.mark.slow  # waits out the timeout
@pytest.mark.parametrize("restart", [True, False])
def test_a_remote_dispatcher_may_restart_within_the_timeout_else_exit_144(tmp_path, restart):
    ports = pick_ports(2)
    module = [sys.executable, "-m", "trainer.data_service"]
    env = {**os.environ, "PYTHONPATH": REPO}
    journal = f"--work_dir={tmp_path / 'journal'}"

    def dispatcher():
        return spawn(
            [*module, "--role=dispatcher", f"--port={ports[0]}", journal], env=env, cwd=REPO
        )

    first = dispatcher()
    spawn(
        [*module, "--role=worker", f"--port={ports[1]}", f"--dispatcher=127.0.0.1:{ports[0]}"],
        env=env,
        cwd=REPO,
    )
    # Both serve before the trainer starts: it may start within the 5 s it waits for them.
    service_client.wait_until_served(f"grpc://127.0.0.1:{ports[0]}", None, TIMEOUT_S)
    flags = _long_run(
        tmp_path,
        f"--config.data.service=grpc://127.0.0.1:{ports[0]}",
        f"--config.data.service_timeout_s={120 if restart else 5}",
        f"--config.train.steps={400 if restart else 100000}",
    )
    proc = start_cli(*flags, cwd=tmp_path)
    lines, killed = [], False
    timer = threading.Timer(TIMEOUT_S, kill, args=(proc,))
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not killed and line.startswith("train | step: 100/"):
                kill(first)
                killed = True
                if restart:
                    dispatcher()  # the same port, the same journal
        code = proc.wait()
    finally:
        timer.cancel()
    output = "\n".join(lines)
    assert killed, output[-3000:]
    if restart:  # meanwhile the trainer reads on from its data worker
        assert code == 0 and "train | step: 400/400" in output, output[-3000:]
    else:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert code == 144, output[-3000:]
        assert len(errors) == 1 and "stopped answering for 5 s" in errors[0], output[-3000:]


# --- across hosts: the trainer on one simulated host, the data service on another ----------


def test_a_trainer_reads_from_a_data_worker_on_another_host(tmp_path):
    from trainer.bench import hosts as hosts_lib

    reason = hosts_lib.available()
    if reason:  # as tests/test_multihost.py: needs root and iproute2
        (pytest.fail if os.environ.get("TOWERFLOW_CI") else pytest.skip)(
            f"simulated hosts cannot be made here: {reason}"
        )
    # Each command forked from the tests' server into its host (`tests.forked`).
    with hosts_lib.Hosts(2) as hosts:
        data_host = hosts.address(1)
        servers = [
            Forked(
                "trainer.data_service", role, f"--port={port}", f"--dispatcher={data_host}:5050",
                f"--host={data_host}", cwd=REPO, namespace=hosts.namespaces[1],
            )
            for role, port in (("--role=dispatcher", 5050), ("--role=worker", 5051))
        ]  # fmt: skip
        for server in servers:
            server.start()
        trainer = Forked(
            "trainer",
            "--strategy=one_device",
            f"--model_dir={tmp_path / 'run'}",
            f"--config.data.service=grpc://{data_host}:5050",
            *SHORT_TRAINING,
            "--config.train.export=False",
            cwd=str(tmp_path),
            namespace=hosts.namespaces[0],
        )
        trainer.start()
        trainer.join()
    for server in servers:  # ended with their host
        server.join()
    logs = trainer.output()[-3000:] + "".join(server.output() for server in servers)
    assert trainer.result and trainer.result.returncode == 0, logs
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["input"]["address"] == f"grpc://{data_host}:5050"
    assert results["eval"]["accuracy"] > 0.95, logs
