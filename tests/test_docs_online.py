"""docs/online.md's commands run as written: the server follows the exports as training runs.

The ```sh block of the page runs in a scratch directory made to look like a
clone's top directory (`examples/` there, this repository importable), line
by line as a user types it (the writer and the server in the background, the
trainer in front): each line's `python -m MODULE ARGS` forked from the tests'
server (`tests.forked`: TensorFlow imported once), its output to a file. While
the trainer runs, and until the server has the newest export, the test asks
the server for the probabilities of a few clicks: the versions never go back
and reach the newest, and each version it was answered by must give what the
checkpoint of that step gives.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import time
import urllib.request

import numpy as np
import tensorflow as tf

from examples import online
from tests.forked import Forked
from tests.helpers import REPO, TIMEOUT_S
from trainer.loop import models, objectives, train
from trainer.loop.checkpoints import Checkpointer

PAGE = pathlib.Path(REPO) / "docs" / "online.md"


def page_block() -> str:
    """The page's one ```sh block, continued lines joined."""
    (block,) = re.findall(r"^```sh\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    return block.replace("\\\n", " ")


def page_commands() -> list[tuple[list[str], bool]]:
    """Each line of the block: its `python -m` command's words, and whether it ends in `&`."""
    commands = []
    for line in page_block().splitlines():
        words = shlex.split(line)
        background = words[-1:] == ["&"]
        assert words[:2] == ["python", "-m"] and "&" not in words[:-1], line
        commands.append((words[2 : len(words) - background], background))
    return commands


def _ask(port: int, inputs: list) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/predict", data=json.dumps({"inputs": inputs}).encode()
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def test_the_served_version_advances_while_training_and_matches_its_checkpoint(tmp_path):
    (tmp_path / "examples").symlink_to(pathlib.Path(REPO, "examples"))  # as in a clone's top
    commands, runs = page_commands(), []
    for i, (command, background) in enumerate(commands):
        run = Forked(
            *command,
            cwd=str(tmp_path),
            output=tmp_path / f"command-{i}.txt",
            timeout=None if background else TIMEOUT_S,  # the test's end stops the background
        )
        run.start()
        runs.append(run)
        if not background and i < len(commands) - 1:  # the next line runs once it has ended
            run.join()
            assert run.result and run.result.returncode == 0, run.output()[-3000:]
    trainer = runs[-1]
    probe = online.clicks(online.EVAL_FIRST, 8)[0].tolist()
    answers = []
    port_file, deadline = tmp_path / "online" / "port", time.monotonic() + TIMEOUT_S

    def ask() -> None:  # the server's answer, once it serves a version
        if port_file.exists():
            answer = _ask(int(port_file.read_text()), probe)
            if answer["version"] is not None:
                answers.append(answer)
        time.sleep(0.3)

    while trainer.is_alive() and time.monotonic() < deadline:
        ask()
    trainer.join()
    assert trainer.result and trainer.result.returncode == 0, trainer.output()[-3000:]
    newest = max(int(name) for name in os.listdir(tmp_path / "online" / "run" / "export"))
    # The server moves on to the trainer's last export (under load it may serve none yet).
    while (not answers or answers[-1]["version"] != newest) and time.monotonic() < deadline:
        ask()
    served = {a["version"]: a["probabilities"] for a in answers}
    order = [a["version"] for a in answers]
    assert order == sorted(order), "a server following the newest never goes back"
    # One serving an earlier version moves on to the newest (quietly it serves 2-3 versions
    # while training; under heavy load it may load its first only once training has ended).
    never = f"the server never served the newest export, {newest}: {order}"
    assert order and order[-1] == newest, never

    config = online.get_config()
    for field in ("train_files", "eval_files"):  # the page's relative paths, from the scratch dir
        config.data[field] = str(tmp_path / config.data[field])
    job = train.build(config, str(tmp_path / "online" / "run"))
    checkpointer = Checkpointer(job.model_dir, False, 1, **train.checkpointed(job))
    for version, probabilities in served.items():
        checkpointer.restore(f"{job.model_dir}/checkpoints/ckpt-{version}")
        logits = job.model(tf.constant(probe), training=False)
        kind = models.output_kind(job.model)
        expected = objectives.Classification(2, kind).probabilities(logits)[:, 1].numpy()
        np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-6)
