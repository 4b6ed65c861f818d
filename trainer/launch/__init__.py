"""`python -m trainer.launch`: a whole cluster of local processes, for development and tests.

    python -m trainer.launch --workers=2 -- --strategy=multi_worker
    python -m trainer.launch --workers=2 --ps=1 --evaluator -- \\
        --strategy=parameter_server --config=configs/ctr.py
    python -m trainer.launch --workers=2 --restarts=3 -- --strategy=multi_worker \\
        --model_dir=runs/mw
    python -m trainer.launch --workers=2:4 -- --strategy=multi_worker --model_dir=runs/el

Every member runs `python -m trainer <the flags after -->` with its own
`TF_CONFIG`, on free ports of 127.0.0.1, in a network namespace of its own that
has only loopback (`towerflow.netns`; `--allow_network` runs it on the host's
network instead, reachable from other hosts). Topologies:

* `--ps=0` (collective all-reduce): worker:0 .. worker:N-1; worker 0 is the chief
  unless `--chief` adds a `chief` member.
* `--ps=M` (parameter servers): a `chief` (the coordinator), N workers and M ps.
* `--evaluator` adds an evaluator, which runs outside the training cluster.

Each output line is prefixed with its member (`[worker:1] ...`); the launcher's own
lines with `[launch]`. When the chief ends, the others get `--grace_s` seconds to
end too and are then stopped; when any member fails first, the chief gets a few
seconds to report it, then every member is stopped and the launcher exits with
that member's code. A member preempted by SIGTERM (exit 143) makes the others save
at the same step: they get `--grace_s` to finish. The exception is a worker of a
parameter-server cluster: it is started again (up to 3 times) and rejoins,
while the coordinator re-schedules the work it lost. `--restarts` starts a failed
cluster again; the trainer resumes from the checkpoint in its `model_dir`.
SIGINT (Ctrl-C) or SIGTERM to the launcher sends SIGTERM to the trainers (the
chief; under `multi_worker` every worker), which save a checkpoint at the step
reached and exit, within `--grace_s`; the ps and worker servers of a
parameter-server cluster are stopped only after that, as the chief's save
needs them. A second signal kills them all at once.

`--workers=MIN:MAX` runs an elastic `multi_worker` job (docs/elastic.md): its
members (`member:0` ...) train as one group; when one is lost the others save
the step they completed and exit 145, and the launcher starts the next group
from the members that are left (at least MIN); a lost member comes back after
a cool-down, and the running group saves at a block boundary to take it in.

The command plans the cluster (`trainer.launch.plan`: members, ports,
`TF_CONFIG`s) and runs the plan (`trainer.launch.running`).

Beyond one machine, run `python -m trainer` on every host with the `TF_CONFIG`
that the scheduler gives each member; for an elastic job, the agent
`python -m trainer.elastic` on every host (`trainer/elastic.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence

from absl import flags

from strategies.cluster.roster import REFORM_VARIABLE, Roster
from towerflow import netns, processes, renamed
from towerflow.errors import MEMBER_LOST_EXIT_CODE, REFORM_EXIT_CODE, UserError, one_line
from towerflow.processes import Console, Interrupt, pick_ports
from trainer import cli
from trainer.launch import running
from trainer.launch.plan import (
    LaunchPlan,
    Member,
    elastic_command,
    elastic_settings,
    parse_workers,
    plan_cluster,
)
from trainer.launch.running import (
    GRACE_S,
    KILL_AFTER_S,
    MAX_MEMBER_RESTARTS,
    REPORT_S,
    Cluster,
    ElasticGroup,
    run_attempts,
)

__all__ = [
    "GRACE_S",
    "KILL_AFTER_S",
    "MAX_MEMBER_RESTARTS",
    "REPORT_S",
    "Cluster",
    "Console",
    "ElasticGroup",
    "Interrupt",
    "LaunchPlan",
    "Member",
    "elastic_command",
    "elastic_settings",
    "launch",
    "launch_elastic",
    "main",
    "parse_workers",
    "pick_ports",
    "plan_cluster",
]
__getattr__ = renamed.old_names(__name__, {"Plan": "LaunchPlan"}, globals())

_WORKERS = flags.DEFINE_string(
    "workers",
    "1",
    "Number of worker members (at least 1), or MIN:MAX: an elastic `multi_worker` job that "
    "trains with MIN to MAX members and re-forms as they come and go (docs/elastic.md).",
)
_PS = flags.DEFINE_integer(
    "ps", 0, "Number of parameter servers; more than 0 also adds a `chief` (the coordinator)."
)
_CHIEF = flags.DEFINE_bool("chief", False, "Add a `chief` member (always there when --ps > 0).")
_EVALUATOR = flags.DEFINE_bool("evaluator", False, "Add an `evaluator` member.")
_RESTARTS = flags.DEFINE_integer(
    "restarts", 0, "Start the whole cluster again this many times after it fails."
)
_PORT_BASE = flags.DEFINE_integer(
    "port_base", 0, "First of consecutive ports on 127.0.0.1; 0 picks free ports."
)
_GRACE_S = flags.DEFINE_float(
    "grace_s",
    GRACE_S,
    "Seconds the other members may run after the chief ends, before SIGTERM; also how long "
    "members may take to save and exit when the launcher is interrupted.",
)
_DATA_WORKERS = flags.DEFINE_integer(
    "data_workers",
    0,
    "Start a tf.data service dispatcher and this many data workers, and run every "
    "trainer's input on them (`--config.data.service=grpc://...`); 0 = input in the trainers.",
)
_ALLOW_NETWORK = flags.DEFINE_bool(
    "allow_network",
    False,
    "Run the cluster on this host's network, its servers reachable from other hosts; by "
    "default it runs in a network namespace of its own with only loopback (towerflow.netns).",
    # The launcher's and the sweep's flag mean the same; a process may import both.
    allow_override=True,
)
_MODULE = flags.DEFINE_string(
    "module", "trainer", "Module each member runs with `python -m` (for testing and advanced use)."
)
_FORK_MEMBERS = flags.DEFINE_bool(
    "fork_members",
    True,
    "Start the trainer's members as forks of one process that imported TensorFlow once "
    "(about 3 s of CPU less per member, towerflow.forkserver); --nofork_members starts each "
    "with an interpreter of its own.",
)


def launch(
    command: Sequence[str],
    workers: int,
    ps: int = 0,
    chief: bool = False,
    evaluator: bool = False,
    restarts: int = 0,
    port_base: int = 0,
    grace_s: float = GRACE_S,
    console: Console | None = None,
    report_s: float = REPORT_S,
    interrupt: Interrupt | None = None,
    data_workers: int = 0,
) -> int:
    """Runs a local cluster, starting it again after a failure up to `restarts` times.

    Args:
      command: what every member runs, e.g. `[sys.executable, "-m", "trainer", ...]`.
      workers, ps, chief, evaluator, port_base: the topology, as in `plan_cluster`.
      restarts: how many times to start a failed cluster again, on fresh ports. A
        user error (exit status 2) is not retried: it would fail the same way.
      grace_s: how long the other members may run on after the chief ends.
      console: where the prefixed output goes (default: stdout).
      report_s: how long the chief may take to report a failed member before the stop.
      interrupt: a signal recorded here stops the cluster, with no restart.
      data_workers: more than 0 starts a tf.data service (a dispatcher and this many
        workers, prefixed `[data:...]`) for the whole run, restarts included, and
        points every member's input at it.

    Returns:
      The exit status of the last attempt: the chief's, that of the member that failed,
      or 128 + the signal number after an interrupt.

    Raises:
      UserError: a flag is out of range or a port is in use.
    """
    plan = LaunchPlan(tuple(command), workers, ps, chief, evaluator, port_base, restarts)
    if grace_s < 0:
        raise UserError(f"`--grace_s` ({grace_s}) must be 0 or more seconds; pass e.g. 15.")
    if data_workers < 0:
        raise UserError(
            f"`--data_workers` ({data_workers}) must be 0 (input in the trainers) or more."
        )
    console = console or Console()
    interrupt = interrupt or Interrupt()
    with contextlib.ExitStack() as stack:
        if data_workers:
            address = _start_data_service(data_workers, console, stack)
            plan = plan.with_command(f"--config.data.service={address}")
        return run_attempts(plan, console, interrupt, grace_s, report_s)


def _start_data_service(workers: int, console: Console, stack: contextlib.ExitStack) -> str:
    """A dispatcher and `workers` data workers, stopped with `stack`; the dispatcher's address."""
    with processes.native_stderr_silenced():  # it imports TensorFlow: only when asked for
        from trainer.data import service_client

    # Forked as the members are: the servers import TensorFlow no second time either.
    servers = stack.enter_context(service_client.serving_locally(workers, console, running.MEMBERS))
    console.log(f"tf.data service at {servers.address}, data workers: {workers}")
    return servers.address


def launch_elastic(
    command: Sequence[str],
    low: int,
    high: int,
    port_base: int = 0,
    grace_s: float = GRACE_S,
    console: Console | None = None,
    interrupt: Interrupt | None = None,
) -> int:
    """Runs an elastic `multi_worker` job of `low` to `high` members until it ends.

    Each group is a local cluster of the ready members (`strategies.cluster.roster`);
    when it re-forms, the next group starts from the step the last one saved.
    `cluster.elastic.rendezvous_timeout`, `max_restarts` and `cooldown_s` are
    read from the trainer flags in `command` (else configs/default.py's).

    Returns:
      0 when the job trained to its end; the members' 2 for a bad config;
      `MEMBER_LOST_EXIT_CODE` when fewer than `low` members were ready for
      `rendezvous_timeout`; 128 + the signal number after an interrupt.
    """
    console = console or Console()
    interrupt = interrupt or Interrupt()
    roster = Roster(low, high, **elastic_settings(command))
    command = elastic_command(command, low, high)
    change = None  # what made the last group re-form, for the next group's record
    while True:
        names = roster.form(stop=lambda: interrupt.signal is not None)
        if names is None:
            if interrupt.signal is not None:
                return interrupt.code
            console.log(
                f"stopping: fewer than `min_workers` ({low}) members ready for "
                f"{roster.rendezvous_timeout:g} s; missing: {', '.join(roster.missing())}; "
                "the state is saved in model_dir: start the job again to resume"
            )
            return MEMBER_LOST_EXIT_CODE
        members = [
            dataclasses.replace(member, label=name)
            for member, name in zip(
                plan_cluster(len(names), port_base=port_base), names, strict=True
            )
        ]
        console.log(
            f"group of {len(members)}: "
            + ", ".join(f"{member.name} as worker:{member.index}" for member in members)
        )
        env = {REFORM_VARIABLE: json.dumps({**change, "to": len(members)})} if change else {}
        group = ElasticGroup(members, command, roster, console, grace_s, interrupt, env)
        code = group.run()
        if code != REFORM_EXIT_CODE:
            return code
        for name in group.lost:
            console.log(f"{name} lost: {roster.lost(name)}")
        change = {"from": len(members), "why": group.why, "at": group.changed_at}


def main(argv: list[str]) -> None:
    console = Console()
    try:
        args = argv[1:]
        command = [sys.executable, "-m", _MODULE.value, *args]
        low, high, elastic = parse_workers(_WORKERS.value)
        if elastic and (_PS.value or _CHIEF.value or _EVALUATOR.value or _DATA_WORKERS.value):
            raise UserError(
                f"`--workers={_WORKERS.value}` (elastic) runs `multi_worker` members only; "
                "drop `--ps`, `--chief`, `--evaluator` and `--data_workers`, or pass a count."
            )
        netns.loopback_only(
            "the local cluster", "--allow_network", args, _ALLOW_NETWORK.value, console.log
        )
        # Forked members skip importing TensorFlow: only the trainer's (a module of one's
        # own, `--module`, may not import it at all).
        running.MEMBERS.enabled = _FORK_MEMBERS.value and _MODULE.value == "trainer"
        with Interrupt().catching() as interrupt:
            if elastic:
                code = launch_elastic(
                    command, low, high, _PORT_BASE.value, _GRACE_S.value, console, interrupt
                )
            else:
                code = launch(
                    command,
                    workers=low,
                    ps=_PS.value,
                    chief=_CHIEF.value,
                    evaluator=_EVALUATOR.value,
                    restarts=_RESTARTS.value,
                    port_base=_PORT_BASE.value,
                    grace_s=_GRACE_S.value,
                    console=console,
                    interrupt=interrupt,
                    data_workers=_DATA_WORKERS.value,
                )
    except UserError as e:
        cli.fail(one_line(e))
    finally:
        running.MEMBERS.close()
    sys.exit(code)
