"""`python -m trainer.elastic`: the agent of an elastic job beyond one machine, one per host.

    python -m trainer.elastic --workers=2:4 -- --strategy=multi_worker --model_dir=gs://b/run

Each agent runs one `multi_worker` member (`python -m trainer <the flags after
-->`) at a time, as `python -m trainer.launch --workers=MIN:MAX` runs them all
on one machine (docs/elastic.md). The agents find each other through the
shared `model_dir`, with no service to run: a *round* is a directory
`model_dir/elastic/rendezvous/ROUND/`. Each agent writes its address to
`ROUND/join/NAME`; the lowest-named agent there decides, once MIN agents have
joined and every member of the last round is back (or `--join_s` passed),
and writes the round's plan (`ROUND/plan.json`: the members in order, the
first is the chief). Every agent of the plan starts its trainer with the
`TF_CONFIG` of its place; an agent that joined too late waits for the next
round, and the running group, seeing it, saves at its next block boundary
and re-forms larger. When a member is lost (its trainer, or its whole host),
the others save the step they completed and exit 145; their agents join the
next round. An agent whose own trainer failed joins after a cool-down
(`cluster.elastic.cooldown_s`, doubled each time; out after `max_restarts`).
Fewer than MIN agents for `cluster.elastic.rendezvous_timeout` seconds: one
line naming who is missing, exit 144, the state saved in `model_dir`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from absl import app, flags

from strategies.cluster import tf_config as cluster
from strategies.cluster.roster import REFORM_VARIABLE, Roster
from towerflow import storage
from towerflow.errors import MEMBER_LOST_EXIT_CODE, REFORM_EXIT_CODE, UserError, one_line
from towerflow.processes import Console, Interrupt, pick_ports
from trainer import cli
from trainer.launch import (
    GRACE_S,
    ElasticGroup,
    Member,
    elastic_command,
    elastic_settings,
    parse_workers,
)

JOIN_S = 10.0  # how long the deciding agent waits for the last round's members beyond MIN
_POLL_S = 0.5  # between looks at the rendezvous directory (a request each on a bucket)
PROBE_S = 1.0  # how long a waiting agent may take to accept a connection
DONE = "done"  # in a round's directory: the job trained to its end

# `--workers=MIN:MAX` (agents, one member each) and `--grace_s` are `trainer.launch`'s flags;
# the agent reads only these of its flags and refuses the others (`refuse_unread_launch_flags`).
LAUNCH_FLAGS_READ = ("workers", "grace_s")
_NAME = flags.DEFINE_string(
    "name",
    None,
    "This agent's name, unique in the job (default: the host's name; in a Slurm step "
    "`NODE-SLURM_PROCID`).",
)
_ADDRESS = flags.DEFINE_string(
    "address",
    None,
    "The address the other hosts reach this one at (default: the host's name; in a Slurm "
    "step the node's, `SLURMD_NODENAME`).",
)
_MEMBER_PORT = flags.DEFINE_integer(
    "member_port", 0, "The port of this host's member; 0 picks a free one for every round."
)
_JOIN_S = flags.DEFINE_float(
    "join_s",
    JOIN_S,
    "Seconds the deciding agent waits, once MIN agents joined, for the rest of the last "
    "round's members (a lost one never comes).",
)


class Rendezvous:
    """The rounds of an elastic job in `model_dir/elastic/rendezvous/`, seen by one agent.

    Args:
      directory: `model_dir/elastic/rendezvous` (any file system `tf.io.gfile` has).
      name: this agent's name.
      low, high: the fewest and most members of a round.
      timeout_s: how long to wait below `low` (`rendezvous_timeout`).
      join_s: how long the deciding agent waits for the last round's members beyond `low`.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        directory: str,
        name: str,
        low: int,
        high: int,
        timeout_s: float,
        join_s: float = JOIN_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.directory, self.name = directory, name
        self.low, self.high = low, high
        self.timeout_s, self.join_s = timeout_s, join_s
        self._clock = clock
        self.first = 0  # the first round this agent joined: an end before it is another run's
        self._seen: tuple[float, list[str]] = (-1e9, [])  # when `waiting` last listed, what

    def latest(self) -> int:
        """The newest round with a plan; -1 when there is none."""
        rounds = [int(r.rstrip("/")) for r in _listdir(self.directory) if r.rstrip("/").isdigit()]
        return max((r for r in rounds if self.plan(r)), default=-1)

    def plan(self, round_: int) -> dict | None:
        """Round `round_`'s plan (`members`: [[name, address], ...], `change`), if decided."""
        return storage.read_json(self._path(round_, "plan.json"))

    def joined(self, round_: int) -> list[str]:
        """The agents that joined round `round_` and answer at their address, by name.

        An agent whose host is cut off may still write to a shared `model_dir`
        (as on the simulated hosts); it is not counted until it answers again.
        """
        names = (n for n in _listdir(self._path(round_, "join")) if not n.endswith(".tmp"))
        return sorted(n for n in names if n == self.name or self._answers(round_, n))

    def waiting(self, round_: int) -> list[str]:
        """Who joined round `round_` (looked up at most once a `_POLL_S`): the roster's `ready`."""
        if self._clock() - self._seen[0] >= _POLL_S:
            self._seen = (self._clock(), self.joined(round_))
        return self._seen[1]

    def _answers(self, round_: int, name: str) -> bool:
        """Whether agent `name`, waiting in round `round_`, accepts a connection in time."""
        joined = storage.read_json(self._path(round_, "join", name))
        host, _, port = (joined or {}).get("address", "").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=PROBE_S).close()
        except (OSError, ValueError):
            return False
        return True

    def finish(self, round_: int) -> None:
        """Marks round `round_` as the one the job ended in."""
        storage.write_text(self._path(round_, DONE), f"{time.time()}\n")

    def finished(self, round_: int) -> bool:
        """Whether the job ended in round `round_`."""
        return round_ >= 0 and storage.is_file(self._path(round_, DONE))

    def join(self, round_: int, address: str, stop: Callable[[], bool]) -> dict | None:
        """Joins round `round_` at `address`; its plan once decided (None: not in time).

        The lowest-named agent that joined decides the plan, once `low` agents
        joined and either `high` did, every member of the last round did, or
        `join_s` passed since `low` did. Every wait is bounded by `timeout_s`.
        """
        storage.makedirs(self._path(round_, "join"))
        storage.write_json(
            self._path(round_, "join", self.name), {"address": address, "at": time.time()}
        )
        last = self.plan(round_ - 1) if round_ > 0 else None
        # Round 0 waits for `high` agents (or `join_s`); a later one for the last one's members.
        expected = {name for name, _ in last["members"]} if last else None
        deadline, enough_at = self._clock() + self.timeout_s, None
        while not stop():
            if plan := self.plan(round_):
                return plan
            if round_ > self.first and self.finished(round_ - 1):
                return {"members": [], DONE: True}
            joined = self.joined(round_)
            if len(joined) >= self.low and joined[0] == self.name:
                enough_at = enough_at or self._clock()
                if (
                    len(joined) >= self.high
                    or (expected is not None and expected <= set(joined))
                    or self._clock() - enough_at >= self.join_s
                ):
                    return self._decide(round_, joined[: self.high], last)
            if self._clock() >= deadline:
                return None
            time.sleep(_POLL_S)
        return None

    def missing(self, round_: int) -> str:
        """Who round `round_` waits for: the last round's members not joined, else a count."""
        joined = set(self.joined(round_))
        last = self.plan(round_ - 1) if round_ > 0 else None
        names = [name for name, _ in (last or {"members": []})["members"] if name not in joined]
        return ", ".join(names) or f"{self.low - len(joined)} more agent(s)"

    def _decide(self, round_: int, names: list[str], last: dict | None) -> dict:
        """Writes round `round_`'s plan for `names` (the first is the chief); returns it."""
        joins = [storage.read_json(self._path(round_, "join", name)) for name in names]
        plan: dict = {"members": [[n, j["address"]] for n, j in zip(names, joins, strict=True)]}
        if last:
            before = [name for name, _ in last["members"]]
            lost = [name for name in before if name not in names]
            came = [name for name in names if name not in before]
            why = ", ".join([f"{n} lost" for n in lost] + [f"{n} joined" for n in came])
            # The change began about when the first agent came back from the last round.
            at = min(j["at"] for j in joins)
            plan["change"] = {"from": len(before), "to": len(names), "why": why, "at": at}
        storage.write_json(self._path(round_, "plan.json"), plan)
        return self.plan(round_)

    def _path(self, round_: int, *parts: str) -> str:
        return "/".join([self.directory.rstrip("/"), str(round_), *parts])


class _NextRound:
    """The roster an agent's `ElasticGroup` watches: the agents waiting for the next round."""

    def __init__(self, rendezvous: Rendezvous, round_: int):
        self.rendezvous, self.round = rendezvous, round_

    def ready(self) -> list[str]:
        return self.rendezvous.waiting(self.round)


def run_agent(
    command: Sequence[str],
    low: int,
    high: int,
    name: str,
    host: str,
    port: int = 0,
    join_s: float = JOIN_S,
    grace_s: float = GRACE_S,
    console: Console | None = None,
    interrupt: Interrupt | None = None,
) -> int:
    """Runs this host's member of an elastic job, round after round, until the job ends.

    Returns:
      0 when the job trained to its end; the trainer's 2 for a bad config;
      `MEMBER_LOST_EXIT_CODE` when fewer than `low` agents joined a round for
      `rendezvous_timeout`, or this agent's trainer failed more than
      `max_restarts` times; 128 + the signal number after an interrupt.
    """
    console = console or Console(own=f"agent {name}")
    interrupt = interrupt or Interrupt()
    settings = elastic_settings(command)
    where = os.path.join(_model_dir(command), "elastic", "rendezvous")
    rendezvous = Rendezvous(where, name, low, high, settings["rendezvous_timeout"], join_s)
    own = Roster(1, 1, **settings)  # this agent's own failures and cool-downs
    command = elastic_command(command, low, high)
    stop = lambda: interrupt.signal is not None  # noqa: E731
    round_ = rendezvous.first = rendezvous.latest() + 1
    while True:
        if own.form(stop) is None:
            if stop():
                return interrupt.code
            console.log(f"stopping: this agent's trainer is out: {own.missing()[0]}")
            return MEMBER_LOST_EXIT_CODE
        address = f"{host}:{port or pick_ports(1)[0]}"
        with answering(address):
            plan = rendezvous.join(round_, address, stop)
        if plan is None:
            return interrupt.code if stop() else _too_few(rendezvous, round_, console)
        if plan.get(DONE):
            console.log("the job ended while this agent waited to join")
            return 0
        names = [member for member, _ in plan["members"]]
        if name not in names:
            console.log(f"round {round_} formed without this agent; joining the next one")
            round_ += 1
            continue
        code, lost = _member(plan, name, command, rendezvous, round_, console, grace_s, interrupt)
        if code == 0:
            rendezvous.finish(round_)
            return 0
        if code != REFORM_EXIT_CODE:
            return code
        if lost:
            console.log(f"{name} lost: {own.lost('member:0')}")
        round_ += 1


def _too_few(rendezvous: Rendezvous, round_: int, console: Console) -> int:
    """Says who is missing from a round that never formed; the job's exit code."""
    console.log(
        f"stopping: fewer than `min_workers` ({rendezvous.low}) agents joined round {round_} "
        f"in {rendezvous.timeout_s:g} s; missing: {rendezvous.missing(round_)}; the state "
        "is saved in model_dir: start the agents again to resume"
    )
    return MEMBER_LOST_EXIT_CODE


def _member(
    plan: dict,
    name: str,
    command: list[str],
    rendezvous: Rendezvous,
    round_: int,
    console: Console,
    grace_s: float,
    interrupt: Interrupt,
) -> tuple[int, bool]:
    """Runs this agent's place in `plan` until the job ends or the group re-forms.

    Returns:
      The group's code (0, `REFORM_EXIT_CODE`, or another), and whether this
      agent's own trainer was lost (rather than saved for the re-form).
    """
    addresses = [address for _, address in plan["members"]]
    index = [member for member, _ in plan["members"]].index(name)
    tf_config = cluster.make_tf_config({"worker": addresses}, "worker", index)
    console.log(
        f"round {round_}: group of {len(addresses)}: "
        + ", ".join(f"{n} as worker:{i}" for i, (n, _) in enumerate(plan["members"]))
    )
    member = Member("worker", index, addresses[index], tf_config, label=name)
    env = {REFORM_VARIABLE: json.dumps(plan["change"])} if plan.get("change") else {}
    group = ElasticGroup(
        [member], command, _NextRound(rendezvous, round_ + 1), console, grace_s, interrupt, env
    )
    code = group.run()
    return code, bool(group.lost)


class _Server(socketserver.TCPServer):
    allow_reuse_address = True


class _Probed(socketserver.BaseRequestHandler):
    """Waits for the prober to close first: TIME_WAIT stays on its side, and the member
    binds this port next (its check of the port would see it held)."""

    def handle(self) -> None:
        self.request.settimeout(PROBE_S)
        with contextlib.suppress(OSError):
            self.request.recv(1)


@contextlib.contextmanager
def answering(address: str) -> Iterator[None]:
    """Accepts (and closes) connections at `address` meanwhile: the others' check of this host.

    Closed before the member starts, which serves on the same port.
    """
    host, _, port = address.rpartition(":")
    server = _Server((host, int(port)), _Probed)
    threading.Thread(target=server.serve_forever, args=(_POLL_S,), daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _model_dir(command: Sequence[str]) -> str:
    """The trainer's `--model_dir`, where the agents meet.

    Raises:
      UserError: the trainer flags have none.
    """
    for i, arg in enumerate(command):
        if arg.startswith("--model_dir="):
            return arg.split("=", 1)[1]
        if arg == "--model_dir" and i + 1 < len(command):
            return command[i + 1]
    raise UserError(
        "`python -m trainer.elastic` needs the trainer's `--model_dir` after `--`: the agents "
        "meet there; pass e.g. `-- --strategy=multi_worker --model_dir=gs://bucket/run`."
    )


def default_identity(environ: Mapping[str, str]) -> tuple[str, str]:
    """This agent's default name and host: the host's name, or in a Slurm step its Slurm task's.

    Several Slurm tasks of a step may share a node, hence a host name: each is named
    `NODE-SLURM_PROCID` instead, at the node's Slurm name (the address
    `--cluster=slurm` gives its members too). Their ports differ already: each
    round picks a free one unless `--member_port` fixes it.
    """
    host = socket.gethostname()
    if "SLURM_PROCID" not in environ:
        return host, host
    node = environ.get("SLURMD_NODENAME") or host
    return f"{node}-{environ['SLURM_PROCID']}", node


def _listdir(path: str) -> list[str]:
    """The names in directory `path`; none when it does not exist (yet)."""
    import tensorflow as tf  # as `towerflow.storage` does: on first use

    try:
        return tf.io.gfile.listdir(path)
    except tf.errors.NotFoundError:
        return []


def refuse_unread_launch_flags(defined: flags.FlagValues) -> None:
    """Refuses a `trainer.launch` flag given to the agent that it does not read (`--ps`, ...).

    Raises:
      UserError: one such flag was given; it names the first.
    """
    for flag in defined.get_flags_for_module("trainer.launch"):
        if flag.present and flag.name not in LAUNCH_FLAGS_READ:
            read = " and ".join(f"`--{name}`" for name in LAUNCH_FLAGS_READ)
            raise UserError(
                f"`--{flag.name}` is a `trainer.launch` flag that `trainer.elastic` does not "
                f"read (of those it reads {read}: each agent runs one `multi_worker` "
                f"member); remove it, or put a trainer flag after `--`."
            )


def main(argv: list[str]) -> None:
    try:
        refuse_unread_launch_flags(flags.FLAGS)
        low, high, _ = parse_workers(flags.FLAGS.workers)
        default_name, default_host = default_identity(os.environ)
        name = _NAME.value or default_name
        command = [sys.executable, "-m", "trainer", *argv[1:]]
        with Interrupt().catching() as interrupt:
            code = run_agent(
                command,
                low,
                high,
                name,
                _ADDRESS.value or default_host,
                _MEMBER_PORT.value,
                _JOIN_S.value,
                flags.FLAGS.grace_s,
                Console(own=f"agent {name}"),
                interrupt,
            )
    except UserError as e:
        cli.fail(one_line(e))
    sys.exit(code)


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=cli.parse_own_flags)
