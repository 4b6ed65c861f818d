"""`train.profile_steps`: a TensorBoard profile of chosen steps, where the Profile tab finds it."""

import gzip
import importlib.util
import json
import re
import subprocess
import time
import urllib.request

import pytest

from tests.helpers import TIMEOUT_S, kill, launched, one_line_error, start_cli, tiny_config
from trainer.loop import actions, train


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """8 steps in blocks of up to 5, steps 2 to 4 profiled; the steps each block ended at."""
    model_dir = tmp_path_factory.mktemp("profiled")
    ends = []
    config = tiny_config(**{"train.steps": 8, "train.profile_steps": (2, 4)})
    record = actions.Action(lambda output: ends.append(output.step))
    train.train_and_evaluate(config, str(model_dir), "train", extra_actions=[record])
    return model_dir, ends


def test_blocks_end_where_the_profile_starts_and_stops(profiled):
    assert profiled[1] == [2, 4, 8]


def test_the_trace_is_where_tensorboards_profile_plugin_reads(profiled):
    model_dir, _ = profiled
    runs = list((model_dir / "train" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and runs[0].is_dir()
    traces = list(runs[0].glob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 10_000


@pytest.mark.skipif(
    not importlib.util.find_spec("tensorboard_plugin_profile"),
    reason='the profile plugin is an optional extra: pip install ".[profile]"',
)
def test_tensorboard_lists_the_run_under_its_profile_plugin(profiled):
    model_dir, _ = profiled
    run = next((model_dir / "train" / "plugins" / "profile").iterdir()).name
    board = start_cli(
        f"--logdir={model_dir}",
        "--host=127.0.0.1",
        "--port=0",
        cwd=str(model_dir),
        module="tensorboard.main",
    )
    try:
        port = _port(board)
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        url = f"http://127.0.0.1:{port}/data/plugin/profile/runs"
        deadline = time.monotonic() + TIMEOUT_S
        listed = []
        while f"train/{run}" not in listed and time.monotonic() < deadline:
            time.sleep(0.5)  # TensorBoard reads the logdir in the background
            with no_proxy.open(url, timeout=30) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
            listed = json.loads(body)
        assert listed == [f"train/{run}"]
    finally:
        kill(board)


def _port(board: subprocess.Popen) -> int:
    """The port TensorBoard says it serves on ("TensorBoard 2.x at http://127.0.0.1:PORT/")."""
    for line in board.stdout:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if found:
            return int(found.group(1))
    raise AssertionError("TensorBoard ended without serving")


@pytest.mark.parametrize("steps", [(5, 2), (1, 2, 3), (-1, 2)])
def test_bad_profile_steps_are_one_line(steps, tmp_path):
    config = tiny_config(**{"train.profile_steps": steps})
    message = one_line_error("train.profile_steps", train.train_and_evaluate, config, str(tmp_path))
    assert "0 <= start < stop" in message
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # a cluster
def test_two_workers_end_blocks_together_and_only_the_chief_profiles(tmp_path):
    """A block that ended on the chief alone would leave the workers' collectives unmatched."""
    result = launched(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        "--model_dir=mw",
        "--config.train.steps=10",
        "--config.train.steps_per_loop=5",
        "--config.train.profile_steps=(3,6)",
        "--config.train.export=False",
        "--config.eval.every=0",
        cwd=str(tmp_path),
    )
    assert "profile of steps 3 to 6 written" in result.stdout
    traces = list((tmp_path / "mw" / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
