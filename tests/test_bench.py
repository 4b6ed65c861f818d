"""`python -m trainer.bench --quick` runs every case and reports every figure; no speed asserted.

The clock action the benchmark times the loop with is tested in-process.
"""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import strategies
from tests.helpers import assert_exit, run_cli, tiny_config
from trainer import bench
from trainer.bench import clock, data_service, harness, hosts, straggling
from trainer.loop import controller, train

# Keras 3 `fit` with `steps_per_execution` > 1 fails under MirroredStrategy
# (keras-team/keras#19246): the benchmark reports it in `failed` instead.
KERAS_MULTI_STEP = "keras_fit_spe10"
TRAINING = ("towerflow", "keras_fit_spe1", KERAS_MULTI_STEP, "bare_loop")
EXPECTED = {
    "small_mlp": (*TRAINING, "towerflow_loop1"),
    "dense_large": (
        "towerflow",
        "keras_fit_spe1",
        "keras_fit_spe4",
        "bare_loop",
        "towerflow_mixed_bfloat16",
        "bare_loop_mixed_bfloat16",
    ),
    "input": (
        "pipeline_synthetic",
        "towerflow_synthetic",
        "bare_loop_synthetic",
        "pipeline_tfrecord",
        "towerflow_tfrecord",
        "bare_loop_tfrecord",
        "bare_loop_in_memory",
    ),
    "strategies": tuple(f"{s}/{c}" for s in bench.SINGLE_PROCESS for c in TRAINING),
    "startup": ("import_tensorflow_s", "floor_s", "towerflow_first_step_s"),
    "checkpoint": (
        "sync_save_blocks_s",
        "async_save_blocks_s",
        "async_save_completes_s",
        "restore_s",
    ),
    "data_service": (  # and hosts/one_host, hosts/two_hosts where namespaces can be made
        "compute/trainer",
        "compute/service",
        "input/trainer",
        "input/service",
        "balanced/trainer",
        "balanced/service",
        "sweep/shared_input_cpu_s_per_trial",
        "sweep/own_input_cpu_s_per_trial",
    ),
    "elastic": (
        "loss_to_step_s",
        "detection_s",
        "save_s",
        "reform_s",
        "first_step_s",
        "shrunk_steps_per_s",
        "fresh_steps_per_s",
    ),
    "tables": (
        "mirrored_sparse_examples_s",
        "mirrored_dense_examples_s",
        "one_device_sparse_examples_s",
        "one_device_dense_examples_s",
        "ps_hashed_step_s",
        "ps_dynamic_step_s",
        "auc_hashed",
        "auc_dynamic_min_count2",
        "bytes_per_id_rss",
        "bytes_per_id_tables",
        "lookups_s_per_ps_member",
        *(  # full against incremental checkpoints, at each interval
            f"{kind}_{what}_every{interval}"
            for interval in bench.QUICK.checkpoint_intervals
            for kind in ("full", "incremental")
            for what in ("bytes", "save_s")
        ),
        *(
            f"incremental_rows_touched_share_every{interval}"
            for interval in bench.QUICK.checkpoint_intervals
        ),
    ),
    "tables_quality": tuple(
        f"auc_{kind}_{share}pct" for share in (5, 15, 50, 100) for kind in ("hashed", "dynamic")
    ),
    "table_lookups": (
        *(f"{path}_{kind}_ids_s" for path in ("eval", "export") for kind in ("int64", "string")),
        "eval_int64_ids_per_cpu_s",
        "export_int64_ids_per_cpu_s",
        "train_step_ms",
    ),
    "online": (
        *(f"{s}/{mode}" for s in bench.QUICK.online_strategies for mode in ("fixed", "follow")),
        "landing_to_export_median_s",
        "landing_to_export_p95_s",
    ),
}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# Every case, quick, takes about 7 minutes on a quiet 2-core machine and more than 10 beside
# the rest of the slow tier.
EVERY_CASE_TIMEOUT_S = 1800


def _bench(path, *flags) -> dict:
    done = run_cli(
        "--quick",
        f"--json={path}",
        *flags,
        cwd=str(path.parent),
        module="trainer.bench",
        timeout=EVERY_CASE_TIMEOUT_S,
    )
    assert_exit(done)
    assert "### small_mlp" in done.stdout
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("bench") / "bench.json")


def _check_figures(results, case: str) -> None:
    result = results["cases"][case]
    for name in EXPECTED[case]:
        if name.endswith(KERAS_MULTI_STEP) and not name.startswith("one_device"):
            if name in result["failed"]:  # the Keras bug above, reported
                continue
        assert _positive(result["figures"].get(name)), f"{case}: {name}"
    assert all(_positive(v) for v in result["figures"].values()), case
    assert result["ratios"] and all(_positive(v) for v in result["ratios"].values()), case


def test_the_quick_one_process_case_reports_its_figures(tmp_path):
    """The default tier's smoke run: one case, in the command's process (`--in_process`).

    Every case runs in the slow tier, each group of cases in a process of its own.
    """
    results = _bench(tmp_path / "bench.json", "--cases=small_mlp", "--in_process")
    assert list(results["cases"]) == ["small_mlp"]
    _check_figures(results, "small_mlp")


@pytest.mark.slow  # every case, clusters included: about 3 minutes
def test_every_case_reports_every_figure(results):
    assert list(results["cases"]) == list(bench.CASES)
    for case in EXPECTED:
        _check_figures(results, case)


@pytest.mark.slow
def test_case_details(results):
    cases = results["cases"]
    assert _positive(cases["dense_large"]["matmul_peak_gflops"])
    waits = cases["input"]["input_wait_us"]
    assert all(_positive(waits[k]) for k in ("synthetic", "tfrecord", "in_memory"))
    assert all(math.isfinite(v) for v in waits.values())  # differences may be negative
    assert _positive(cases["checkpoint"]["checkpoint_mb"])
    quality = cases["tables_quality"]
    assert 0.5 < quality["oracle_auc"] <= 1 and len(quality["reasons"]) == 5
    assert 0 < quality["unseen_eval_share"] < 1, "new items keep entering the drifting stream"
    assert cases["elastic"]["per_failure"] == {"steps_lost": [0.0], "examples_repeated": [0.0]}
    lost = cases["online"]["per_worker_lost"]  # a unit: half a block's steps, within a file
    assert lost["unit_records"] == bench.QUICK.online_loop // 2 * 128
    assert 0 <= lost["records_repeated"] <= lost["unit_records"]
    assert results["machine"]["cpu_cores"] >= 1
    if hosts.available() is None:  # as root: 2 simulated hosts over a 1 Gbit/s link
        assert _positive(cases["multi_host"]["ratios"]["default/1gbit/one_host"])
        assert _positive(cases["data_service"]["ratios"]["hosts/two_hosts_over_one_host"])
    else:
        assert cases["data_service"]["notes"] == [f"hosts/ not run: {hosts.available()}"]
    assert _positive(cases["data_service"]["ratios"]["sweep/shared_over_own"])
    assert all(1 <= b <= 2 for b in cases["data_service"]["bounds"].values())
    for contender in ("input/trainer", "input/service", "compute/trainer", "compute/service"):
        split = cases["data_service"]["step_ms"][contender]
        # The wait is taken where batches are read (the prefetch beside the step): about
        # the whole step, no more, when the input is the bottleneck.
        assert _positive(split["step"]) and 0 <= split["input_wait"] < 1.5 * split["step"]
    scale = cases["tables"]["scale"]  # every id held, split over the 2 ps members
    assert scale["ids"] == bench.QUICK.table_ids == sum(p["ids_held"] for p in scale["parts"])
    assert [p["device"].split("/")[-2] for p in scale["parts"]] == ["task:0", "task:1"]
    assert "failed" not in cases["tables"], "incremental checkpoints are measured"
    for interval in bench.QUICK.checkpoint_intervals:
        assert _positive(
            cases["tables"]["ratios"][f"incremental/full bytes every {interval} steps"]
        )
    clusters = cases["strategies"]["figures"]
    assert bench.QUICK.clusters, "--quick times at least one local cluster"
    for name in bench.QUICK.clusters:
        if name in strategies.available():
            assert _positive(clusters[f"{name}/towerflow"])
            assert _positive(cases["strategies"]["ratios"][f"{name}/one_device"])


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--cases=small_mlp,nope", "Unknown `--cases` nope; known: small_mlp"),
        ("--reps=0", "`--reps` (0) must be at least 1"),
        ("--nosuchflag", "Unknown command line flag 'nosuchflag'"),
    ],
)
def test_bad_flags_are_one_line(flag, message, capsys):
    """The command's flag parsing and main in this process: a process adds only an import."""
    from absl import flags

    from trainer.bench import __main__ as command

    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit:
            command.main(command.parse_flags(["trainer.bench", flag]))
    finally:
        flags.FLAGS.unparse_flags()
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_each_round_starts_one_contender_later_every_other_one_backwards(monkeypatch):
    monkeypatch.setattr(harness, "note", lambda line: None)
    order = []
    runs = {name: (lambda name=name: order.append(name) or 1.0) for name in "ABC"}
    for run in runs.values():
        run.self_warming = True
    samples = harness.alternate(runs, 4)
    assert "".join(order) == "ABC" + "ACB" + "CAB" + "CBA"
    rounds = ["".join(order[i : i + 3]) for i in range(0, 12, 3)]
    # B runs after A and after C: not always after the same one, as a rotation alone has it.
    assert {r[r.index("B") - 1] for r in rounds if not r.startswith("B")} == {"A", "C"}
    assert samples == {name: [1.0] * 4 for name in "ABC"}


def test_the_clock_marks_each_block_once_it_is_done(tmp_path, monkeypatch):
    """In-process and through `train.actions` (as a cluster's chief has it): one mark per block."""
    marks_file = tmp_path / "clock.txt"
    monkeypatch.setenv(clock.FILE_VARIABLE, str(marks_file))
    config = tiny_config(
        **{"strategy.name": "one_device", "train.actions": "trainer.bench.clock:to_file"}
    )
    in_process = clock.Clock()
    blocks = []  # each block's own wall time, as the controller measured it
    seconds = controller.Action(lambda output: blocks.append(output.seconds))
    started = time.time()
    train.train_and_evaluate(config, str(tmp_path / "run"), "train", [in_process.action(), seconds])
    ended = time.time()

    assert [step for step, _ in in_process.marks] == [5, 10, 15, 20]
    times = [t for _, t in in_process.marks]
    # From one mark to the next: at least that block's steps (a whole loop, per block).
    for i in range(1, len(times)):
        assert times[i] - times[i - 1] >= blocks[i]
    assert clock.rate(in_process.marks, per_step=32, until=15) > 0
    from_file = clock.read(str(marks_file))
    assert [step for step, _ in from_file] == [5, 10, 15, 20]
    wall = [t for _, t in from_file]
    assert started < wall[0] and wall == sorted(set(wall)) and wall[-1] < ended


def test_only_the_chief_of_a_cluster_writes_marks(tmp_path, monkeypatch):
    marks_file = str(tmp_path / "clock.txt")
    monkeypatch.setenv(clock.FILE_VARIABLE, marks_file)
    output = controller.Output(step=5, total_steps=10, steps=5, seconds=1.0, metrics={})

    def worker(index: int) -> str:  # worker 0 is the chief of a cluster without a `chief`
        cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
        return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})

    monkeypatch.setenv("TF_CONFIG", worker(1))
    clock.to_file(tiny_config()).fn(output)
    assert clock.read(marks_file) == []
    monkeypatch.setenv("TF_CONFIG", worker(0))
    clock.to_file(tiny_config()).fn(output)
    assert [step for step, _ in clock.read(marks_file)] == [5]
    with pytest.raises(RuntimeError, match="need two blocks"):
        clock.rate(clock.read(marks_file), per_step=1)


def test_the_straggling_pipeline_alone_sleeps_before_each_training_batch(monkeypatch):
    monkeypatch.setenv(straggling.VARIABLE, "1:0.2")
    context = tf.distribute.InputContext(2, 1, num_replicas_in_sync=2)
    batches = iter(straggling.digits(context, "train", 32))
    next(batches)
    started = time.monotonic()
    features, labels = next(batches)
    for _ in range(2):
        next(batches)
    # Three batches, each after a sleep of 0.2 s; the first sleep may have begun in the
    # input's own thread before `started`.
    assert time.monotonic() - started >= 0.4
    assert features.shape[0] == labels.shape[0] == 16  # its share of the global batch
    eval_batches = straggling.digits(context, "eval", 32)
    assert eval_batches.element_spec[0].shape[1:] == features.shape[1:]
    monkeypatch.setenv(straggling.VARIABLE, "two:1")
    with pytest.raises(ValueError, match=r"TOWERFLOW_STRAGGLER \('two:1'\) must be"):
        straggling.straggler()


def test_the_data_workers_cpu_time_is_read_from_proc():
    """The `data_service` case's sweep figure: CPU seconds of a process tree's data workers.

    The worker forks a child that keeps its argv (as one does between fork and
    exec, running `uname -p` at start-up): not another data worker.
    """
    spin = (  # 0.3 s of CPU, then idle long enough to be read at that
        "import os, time\nif os.fork() == 0:\n    time.sleep(0.6)\n    os._exit(0)\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\ntime.sleep(0.5)\nos.wait()"
    )
    worker = [sys.executable, "-c", spin, "trainer.data_service", "--role=worker"]
    other = [sys.executable, "-c", spin, "trainer.data_service", "--role=dispatcher"]
    # Forked from a server, a data worker shows the server's command line and its own name.
    named = [sys.executable, "-c", "open('/proc/self/comm', 'w').write('data:worker:1')\n" + spin]
    procs = [subprocess.Popen(worker), subprocess.Popen(other), subprocess.Popen(named)]
    try:
        deadline = time.monotonic() + 30
        seconds = {}
        while procs[0].poll() is None and time.monotonic() < deadline:
            seconds.update(data_service.data_workers_cpu_s(os.getpid()))
            time.sleep(0.05)
        workers = {procs[0].pid, procs[2].pid}
        assert set(seconds) == workers, "the workers: not the dispatcher, nor a worker's child"
        tick = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts user and system time in whole ticks
        assert 0.3 - 2 * tick <= seconds[procs[0].pid] < 5
        assert data_service.data_workers_cpu_s(procs[1].pid) == {}, "not its descendant"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_pinning_moves_every_thread_of_a_running_process():
    """The `data_service` case's cores: a process's threads started before pinning move too."""
    threads = (  # three threads beside the main one, all started before the pinning
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True)\ntime.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", threads], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) == 4
        core = sorted(os.sched_getaffinity(0))[-1]
        data_service.pin(proc.pid, [core])
        assert [os.sched_getaffinity(int(t)) for t in threads] == [{core}] * 4
    finally:
        proc.kill()
        proc.wait()


def test_the_quality_case_runs_the_layers_default_policy():
    """`tables_quality` keeps its own copies of the layer's defaults (it imports no TF at first)."""
    from trainer.bench import tables_quality
    from trainer.layers import tables

    default = tables_quality.Table(1, "lfu")
    assert default.seen_bits == tables.SEEN_BITS and default.hashes == tables.FALLBACK_HASHES
    assert tables_quality.MIN_COUNT == 1 and tables.DEFAULT_EVICTION == "lfu"
