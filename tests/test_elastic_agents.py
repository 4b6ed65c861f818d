"""`python -m trainer.elastic`: an agent per host meets the others in `model_dir` and re-forms."""

import json
import os
import re
import shlex
import socket
import threading
import time

import pytest

from tests.helpers import REPO, assert_exit, kill, run_cli, start_cli
from tests.test_elastic import FAST  # short blocks, nothing but training, 1-s cool-down
from towerflow.processes import pick_ports
from trainer.elastic import Rendezvous, answering, default_identity

DOC = os.path.join(REPO, "docs", "elastic.md")
TIMEOUT_S = 240.0


def _documented(model_dir) -> list[str]:
    """The flags of docs/elastic.md's agent command, its `model_dir` replaced."""
    blocks = re.findall(r"```sh\n(.*?)```", open(DOC).read(), re.S)
    block = next(b for b in blocks if b.startswith("python -m trainer.elastic"))
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "trainer.elastic"], words
    return [w.replace("runs/agents", str(model_dir)) for w in words[3:]]


class _Agents:
    """Agents started as separate processes on 127.0.0.1, their output lines gathered."""

    def __init__(self, tmp_path):
        self.tmp_path, self.model_dir = tmp_path, tmp_path / "run"
        self.procs: dict[str, object] = {}
        self.lines: list[str] = []
        self._changed = threading.Condition()

    def start(self, name: str) -> None:
        """Starts docs/elastic.md's agent command as agent `name`, made short."""
        words = [w.replace("--name=a", f"--name={name}") for w in _documented(self.model_dir)]
        proc = start_cli(*words, *FAST, cwd=self.tmp_path, module="trainer.elastic")
        self.procs[name] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, text: str, deadline: float) -> None:
        with self._changed:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                assert left > 0, f"no {text!r} in time:\n" + "\n".join(self.lines[-60:])
                self._changed.wait(left)

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)


@pytest.mark.slow  # three agents, a lost host and two re-forms: over a minute in the suite
def test_three_agents_go_on_without_a_lost_host_and_take_it_back_when_it_returns(tmp_path):
    agents = _Agents(tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for name in ("a", "b", "c"):
            agents.start(name)
        agents.wait_for("[a] train | step: 60/", deadline)
        kill(agents.procs.pop("c"))  # the whole host: the agent and its trainer
        agents.wait_for("round 1: group of 2: a as worker:0, b as worker:1", deadline)
        agents.start("c")  # the host is back
        for name, proc in agents.procs.items():
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"agent {name} exited {code}:\n" + agents.output()[-4000:]
    finally:
        kill(*agents.procs.values())
    output = agents.output()
    saved = {int(s) for s in re.findall(r"elastic: .* saved step (\d+) to", output)}
    # Survivors save the last step they completed; one may have completed one more than
    # another (docs/elastic.md): the newest save is the one restored.
    assert saved and max(saved) - min(saved) <= 1, output[-4000:]
    step = max(saved)
    assert step >= 60
    restored = [int(s) for s in re.findall(r"\[a\] restored \S+ at step (\d+)", output)]
    assert restored[0] == step, output[-4000:]  # 0 steps lost
    assert "round 2: group of 3: a as worker:0, b as worker:1, c as worker:2" in output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["step"] == 200
    reforms = [(r["step"], r["from"], r["to"]) for r in results["elastic"]["reforms"]]
    assert reforms[0] == (step, 3, 2) and reforms[1][1:] == (2, 3), reforms
    assert reforms[1][0] == restored[1]  # the grown group went on from its save


def test_fewer_agents_than_min_for_the_timeout_stop_naming_who_is_missing(tmp_path):
    rendezvous = Rendezvous(str(tmp_path / "rdv"), "b", 2, 3, timeout_s=1.0, join_s=0)
    assert rendezvous.join(0, "x:1", lambda: False) is None  # b alone in round 0
    assert rendezvous.latest() == -1
    assert rendezvous.missing(0) == "1 more agent(s)"


def test_the_lowest_answering_agent_decides_and_the_change_names_who_left_and_came(tmp_path):
    directory = str(tmp_path / "rdv")
    ha, hb, hc = (f"127.0.0.1:{port}" for port in pick_ports(3))
    a, b = (Rendezvous(directory, n, 2, 3, timeout_s=5.0, join_s=0) for n in "ab")

    def join_b() -> None:
        with answering(hb):
            b.join(0, hb, lambda: False)

    threading.Thread(target=join_b, daemon=True).start()
    with answering(ha):
        first = a.join(0, ha, lambda: False)
    assert first["members"] == [["a", ha], ["b", hb]]
    assert a.latest() == 0
    c = Rendezvous(directory, "c", 2, 3, timeout_s=0.5)
    with answering(hc):
        assert c.join(1, hc, lambda: False) is None  # c is not the lowest: it only waits
    assert c.missing(1) == "a, b"
    a.timeout_s = 1.0
    with answering(ha):  # c no longer answers (its host is cut off): a waits for b, alone
        assert a.join(1, ha, lambda: False) is None
    assert a.joined(1) == ["a"]
    with answering(hc):
        second = a.join(1, ha, lambda: False)
    assert [name for name, _ in second["members"]] == ["a", "c"]
    assert second["change"]["why"] == "b lost, c joined"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--workers=2:3", "--", "--strategy=multi_worker"], "needs the trainer's `--model_dir`"),
        (["--workers=3:2", "--", "--strategy=multi_worker"], "`--workers` (3:2) must be MIN:MAX"),
        (
            ["--workers=2:3", "--ps=1", "--", "--strategy=multi_worker", "--model_dir=run"],
            "`--ps` is a `trainer.launch` flag that `trainer.elastic` does not read",
        ),
        (
            ["--workers=2:3", "--nochief", "--", "--strategy=multi_worker", "--model_dir=run"],
            "`--chief` is a `trainer.launch` flag that `trainer.elastic` does not read",
        ),
    ],
)
def test_a_bad_agent_command_is_one_line_and_exit_2(tmp_path, args, expected):
    result = run_cli(*args, cwd=tmp_path, module="trainer.elastic")
    assert_exit(result, 2)
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_in_a_slurm_step_each_task_is_an_agent_named_by_node_and_rank():
    step = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node01"}
    first = default_identity({**step, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    second = default_identity({**step, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert (first, second) == (("node01-0", "node01"), ("node01-1", "node01"))
    host = socket.gethostname()
    assert default_identity({}) == (host, host)  # outside Slurm: the host's name
