"""`parameter_server`: real clusters of processes on 127.0.0.1, and the pieces they rest on."""

import json
import pathlib
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
import configs.default
import strategies
from strategies.cluster import tf_config as cluster
from tests.helpers import cli_in_process, launch_and_signal, launched, start_cli
from tests.test_ps_sync import _histograms, _scalars
from towerflow.errors import UserError
from trainer import data
from trainer.layers import ShardedEmbedding

CLUSTER_TIMEOUT_S = 300
PS_CLUSTER = {
    "chief": ["127.0.0.1:1"],
    "worker": ["127.0.0.1:2", "127.0.0.1:3"],
    "ps": ["127.0.0.1:4", "127.0.0.1:5"],
}


def _left_over(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a test's own directory)."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if marker in command and state != "Z":
            found.append(command)
    return found


def _run_cluster(tmp_path, *trainer_flags: str) -> tuple[dict, str]:
    """Trains on 2 workers + 2 ps; returns results.json and the launcher's output."""
    model_dir = tmp_path / "run"
    result = launched(
        "--workers=2",
        "--ps=2",
        "--",
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        *trainer_flags,
        cwd=str(tmp_path),
        timeout=CLUSTER_TIMEOUT_S,
    )
    deadline = time.monotonic() + 10
    while _left_over(str(model_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_over(str(model_dir)), "processes left behind"
    return json.loads((model_dir / "results.json").read_text()), result.stdout


def _members(devices: list[str]) -> set[str]:
    return {re.sub(r"/device:.*", "", d) for d in devices}


# Real clusters.


@pytest.mark.slow  # the README's launcher command runs this job in the default tier
def test_digits_on_two_workers_and_two_ps(tmp_path):
    results, out = _run_cluster(
        tmp_path, "--config.train.steps=150", "--config.train.steps_per_loop=50"
    )
    assert results["eval"]["accuracy"] >= 0.9
    placement = results["placement"]
    assert placement["tf_strategy"] == "ParameterServerStrategyV2"
    assert placement["replicas_in_sync"] == 1
    # Asynchronous by default, and every update's staleness recorded.
    assert (placement["sync_replicas"], placement["staleness"]) == (0, "none")
    histograms = _histograms(tmp_path / "run", "staleness")
    means = _scalars(tmp_path / "run", "staleness_mean")
    assert sorted(histograms) == sorted(means) == [50, 100, 150]
    for step, counts in histograms.items():
        assert counts.sum() == 50, "each update of the block recorded once"
        assert means[step] == pytest.approx(np.arange(len(counts)) @ counts / 50)
    assert results["train"]["staleness_mean"] == pytest.approx(means[150])
    assert _members(placement["compute_devices"]) == {
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    }
    where = [d for devices in placement["variables"].values() for d in devices]
    assert _members(where) == {"/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}
    for member in ("ps:0", "ps:1", "worker:0", "worker:1"):  # their role: serve
        assert f"[{member}] serving as a parameter_server member" in out
    assert "stopping" not in out, "ps and worker members end by themselves after the chief"

    # The SavedModel the chief exported from the ps variables serves on its own.
    serve = tf.saved_model.load(str(tmp_path / "run" / "export")).signatures["serving_default"]
    digits = data.get(configs.default.get_config().data)
    x, y = next(iter(digits.eval_fn(1000)(tf.distribute.InputContext())))
    accuracy = np.mean(serve(inputs=x)["classes"].numpy() == y.numpy())
    assert accuracy == pytest.approx(results["eval"]["accuracy"], abs=1e-6)


@pytest.mark.slow  # the README's ctr command runs this job in the default tier
def test_ctr_shards_the_table_over_both_ps_and_learns(tmp_path):
    results, _ = _run_cluster(
        tmp_path,
        "--config=configs/ctr.py",
        "--config.train.steps=150",
        "--config.train.steps_per_loop=75",
        "--config.train.checkpoint_every=0",
        "--config.train.export=False",
    )
    variables = results["placement"]["variables"]
    shards = {name: devices for name, devices in variables.items() if "embeddings_" in name}
    assert len(shards) == 2
    assert _members([d for devices in shards.values() for d in devices]) == {
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    }
    assert "fixed partitioner" in results["placement"]["communication"]
    metrics = results["eval"]
    assert metrics["auc"] >= 0.7, metrics  # a 2-class task reports AUC
    assert metrics["accuracy"] >= 0.69, metrics  # above the ~0.67 of always "no click"


def test_without_tf_config_it_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    code, _, err = cli_in_process(
        "--strategy=parameter_server", f"--model_dir={tmp_path / 'run'}", capsys=capsys
    )
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: A `parameter_server` run needs a `TF_CONFIG` cluster")
    assert "python -m trainer.launch --workers=2 --ps=2 -- --strategy=parameter_server" in lines[0]
    assert not (tmp_path / "run").exists()


# Roles, options and pieces, in this process.


def _plugin(monkeypatch, task_type: str, index: int = 0):
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, task_type, index))
    return strategies.get("parameter_server", configs.ctr.get_config().strategy.parameter_server)


def test_the_evaluator_builds_sharded_layers_as_the_training_members_do(monkeypatch):
    """In this process: ps and worker members wait for their cluster at start-up.

    The real clusters above show those roles (`serving as a parameter_server member`).
    """
    strategy = _plugin(monkeypatch, "evaluator")
    member = strategy.membership
    assert (member.role, member.is_chief, member.evaluates_inline) == (
        "evaluate",
        False,
        False,
    )
    # Every member builds the model the same way, so checkpoints match across members.
    with strategy.scope():
        layer = ShardedEmbedding(100, 4)
        layer.build()
    assert len(layer.weights) == 2


def test_a_cluster_without_ps_is_refused(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", cluster.make_tf_config({"worker": ["127.0.0.1:2"]}, "worker", 0)
    )
    with pytest.raises(UserError, match=r"needs a `TF_CONFIG` cluster with a chief, workers"):
        strategies.get("parameter_server")


def test_an_unknown_partitioner_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", cluster.make_tf_config(PS_CLUSTER, "ps", 0))
    options = configs.ctr.get_config().strategy.parameter_server
    options.partitioner = "variable"
    with pytest.raises(UserError, match="known: none, fixed, min_size, max_size"):
        strategies.get("parameter_server", options)


def test_wait_until_gone_sees_a_member_come_and_go():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    threading.Timer(0.5, server.close).start()
    start = time.monotonic()
    assert cluster.wait_until_gone(address, startup_s=5, interval_s=0.1, misses=3)
    assert 0.5 <= time.monotonic() - start < 3
    assert not cluster.wait_until_gone(address, startup_s=0.3, interval_s=0.1), "never came up"


def _replying_listener(port: int) -> socket.socket:
    """A listener on `port` that answers each connection as a gRPC server does (an HTTP/2
    SETTINGS frame) until it is closed."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()

    def reply():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            with connection:
                connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

    threading.Thread(target=reply, daemon=True).start()
    return listener


def test_a_chief_whose_server_replied_is_seen_gone_at_once_and_its_start_up_gap_is_not_an_end():
    held = socket.socket()  # the chief's port, held open while its cluster starts
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    ended = []

    def chief():
        time.sleep(0.8)
        held.close()
        time.sleep(0.7)  # free a moment, then TensorFlow's server takes it over
        server = _replying_listener(port)
        time.sleep(2.5)
        ended.append(time.monotonic())
        server.close()

    threading.Thread(target=chief, daemon=True).start()
    assert cluster.wait_until_gone(f"127.0.0.1:{port}", startup_s=5)
    assert ended, "the refusals while the port was free were taken for the chief's end"
    # A try a second, and one more 0.25 s after a refusal (three failed tries: over 2 s).
    assert time.monotonic() - ended[0] < 1.6, "a refusal after its server replied is its end"


def test_ctr_data_is_deterministic_learnable_and_in_range():
    config = configs.ctr.get_config().data
    dataset = data.get(config)
    spec = dataset.spec
    assert (spec.input_shape, spec.num_classes) == ((8,), 2)
    assert spec.train_size + spec.eval_size == config.ctr.num_examples
    eval_fn = dataset.eval_fn(4096)
    x, y = next(iter(eval_fn(tf.distribute.InputContext())))
    again, _ = next(iter(eval_fn(tf.distribute.InputContext())))
    np.testing.assert_array_equal(x.numpy(), again.numpy())
    ids = x.numpy()
    assert x.dtype == tf.float32 and np.all(ids == np.round(ids))
    assert 0 <= ids.min() and ids.max() < config.ctr.vocab_size
    assert 0.2 < y.numpy().mean() < 0.5, "clicks are a minority, not a rarity"
    values, counts = np.unique(ids, return_counts=True)
    assert counts.max() > 50 * np.median(counts), "a few ids are common, most are rare"


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("vocab_size", 1000, "`data.ctr.vocab_size` (1000) must hold"),
        ("num_fields", 0, "`data.ctr.num_fields` (0) must be >= 1"),
    ],
)
def test_bad_ctr_options_are_user_errors(field, value, expected):
    config = configs.ctr.get_config().data
    config.ctr[field] = value
    with pytest.raises(UserError) as info:
        data.get(config)
    assert str(info.value).startswith(expected)


def test_the_ctr_table_follows_the_vocabulary():
    config = configs.ctr.get_config()
    config.data.ctr.vocab_size = 5000
    assert config.model.vocab_size == 5000, "the table follows the vocabulary"


def _signalled_cluster(tmp_path, topology, member, trigger, *trainer_flags) -> str:
    """Runs a parameter-server job, SIGKILLs `member` at `trigger`; checks it completes."""
    model_dir = tmp_path / "run"
    code, lines, _ = launch_and_signal(
        *topology,
        "--",
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        "--config.train.steps_per_loop=20",
        "--config.eval.every=0",
        *trainer_flags,
        cwd=tmp_path,
        trigger=trigger,
        member=member,
        sig=signal.SIGKILL,
        timeout=CLUSTER_TIMEOUT_S,
    )
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert not _left_over(str(model_dir))
    return output


@pytest.mark.slow  # a kill and a restart
def test_a_killed_worker_is_restarted_and_the_job_completes(tmp_path):
    """SIGKILL one worker mid-run: the launcher starts it again and every step is done."""
    output = _signalled_cluster(
        tmp_path,
        ["--workers=2", "--ps=1"],
        ("worker", 1),
        "[chief] train | step:",
        "--config.train.steps=400",
        "--config.train.checkpoint_every=0",
    )
    assert "worker:1 was killed by SIGKILL; restarting it" in output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] >= 400
    assert "[chief] train | step: " in output and "/400" in output


@pytest.mark.slow  # a kill and a restart
def test_a_lost_ps_is_named_by_the_chief_and_the_cluster_restarts_from_its_checkpoint(tmp_path):
    """SIGKILL a ps 20 steps after an asynchronous checkpoint started: it is not lost.

    The chief says which member it lost, and `--restarts` resumes the whole job
    from a checkpoint at most `checkpoint_every` steps back.
    """
    output = _signalled_cluster(
        tmp_path,
        ["--workers=1", "--ps=2", "--restarts=1"],
        ("ps", 1),
        "[chief] train | step: 140/",
        "--config.train.steps=200",
        "--config.train.checkpoint_every=40",
        "--config.train.async_checkpoint=True",
        "--config.train.export=False",
    )
    lost = re.search(
        r"\[chief\] error: ps:1 \(127\.0\.0\.1:\d+\) stopped answering.*"
        r"resumes from \S*ckpt-(\d+)",
        output,
    )
    assert lost, output[-3000:]
    assert "[launch] restarting cluster (attempt 2 of 2)" in output
    step = int(lost.group(1))
    assert step >= 140 - 40 and f"ckpt-{step} at step {step}" in output, output[-3000:]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["step"] == 200


@pytest.mark.slow  # a cluster stopped, then rerun; test_faults shows SIGTERM in one process
def test_sigterm_to_the_launcher_saves_the_step_reached_and_a_rerun_resumes_there(tmp_path):
    """The chief's final save needs the ps and workers: the launcher stops them after it."""
    model_dir = tmp_path / "run"
    trainer_flags = [
        "--strategy=parameter_server",
        f"--model_dir={model_dir}",
        "--config.train.steps_per_loop=20",
        "--config.train.checkpoint_every=0",  # the save on SIGTERM is the only one after step 0
        "--config.eval.every=0",
        "--config.train.export=False",
    ]
    proc = start_cli(
        "--workers=2",
        "--ps=1",
        "--",
        *trainer_flags,
        "--config.train.steps=3000",  # ends on its own, whatever happens
        cwd=tmp_path,
        module="trainer.launch",
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[chief] train | step: 100/"):
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=CLUSTER_TIMEOUT_S)
    finally:
        proc.kill()  # and its members, in sessions of their own, with it (`start_cli`)
        proc.wait()
    output = "".join(lines)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    saved = re.search(r"\[chief\] preempted \(SIGTERM\) at step (\d+)", output)
    assert saved, output[-3000:]
    step = int(saved.group(1))
    assert step >= 100
    assert tf.train.latest_checkpoint(str(model_dir / "checkpoints")).endswith(f"ckpt-{step}")
    resumed = launched(
        "--workers=2",
        "--ps=1",
        "--",
        *trainer_flags,
        f"--config.train.steps={step + 20}",
        cwd=str(tmp_path),
        timeout=CLUSTER_TIMEOUT_S,
    )
    assert f"ckpt-{step} at step {step}" in resumed.stdout, "no step lost"
    assert json.loads((model_dir / "results.json").read_text())["step"] == step + 20
