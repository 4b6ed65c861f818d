"""What a local cluster starts: its members, their ports and `TF_CONFIG`s (`LaunchPlan`).

`trainer.launch` plans a cluster here and runs the plan with
`trainer.launch.running`; nothing here starts a process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from strategies.cluster import tf_config as cluster
from towerflow import renamed
from towerflow.errors import UserError
from towerflow.processes import LOOPBACK, pick_ports
from trainer.loop import options as loop_options


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a local cluster: a process (a TF_CONFIG "task").

    Attributes:
      type: its member type: "chief", "worker", "ps" or "evaluator".
      index: its index within its type (`TF_CONFIG`'s `task.index`).
      address: "127.0.0.1:port" of its server; None for the evaluator, which runs none.
      tf_config: the `TF_CONFIG` it runs with.
    """

    type: str
    index: int
    address: str | None
    tf_config: str
    label: str = ""  # an elastic job's name for it, the same in every group ("member:2")

    @property
    def name(self) -> str:
        """How its output lines are prefixed: "chief", "worker:1", "ps:0", "evaluator"."""
        if self.label:
            return self.label
        return self.type if self.type in ("chief", "evaluator") else f"{self.type}:{self.index}"

    @property
    def is_chief(self) -> bool:
        """Whether the cluster ends with this member."""
        return cluster.parse(self.tf_config).is_chief


def plan_cluster(
    workers: int, ps: int = 0, chief: bool = False, evaluator: bool = False, port_base: int = 0
) -> list[Member]:
    """The members of a local cluster, each with its address and `TF_CONFIG`.

    Args:
      workers: number of `worker` members (at least 1).
      ps: number of parameter servers; more than 0 also adds a `chief` (the coordinator).
      chief: add a `chief` member even without parameter servers.
      evaluator: add an `evaluator`. It runs no server, but it is listed in every
        member's `TF_CONFIG` so that the trainers know a sidecar evaluates for them.
      port_base: 0 picks free ports on 127.0.0.1; otherwise the first of consecutive ports.

    Raises:
      UserError: a count is out of range, or a port given by `port_base` is in use.
    """
    if workers < 1:
        raise UserError(f"`--workers` ({workers}) must be at least 1; pass e.g. `--workers=2`.")
    if ps < 0:
        raise UserError(f"`--ps` ({ps}) must be 0 or more; pass 0 for no parameter servers.")
    servers = [("chief", 0)] if chief or ps else []
    servers += [("worker", i) for i in range(workers)] + [("ps", i) for i in range(ps)]
    ports = pick_ports(len(servers) + evaluator, port_base)
    addresses = [f"{LOOPBACK}:{port}" for port in ports]
    by_type: dict[str, list[str]] = {}
    for (member_type, _), address in zip(servers, addresses, strict=False):
        by_type.setdefault(member_type, []).append(address)
    if evaluator:
        by_type["evaluator"] = [addresses[-1]]
    members = [
        Member(member_type, index, address, cluster.make_tf_config(by_type, member_type, index))
        for (member_type, index), address in zip(servers, addresses, strict=False)
    ]
    if evaluator:
        tf_config = cluster.make_tf_config(by_type, "evaluator", 0)
        members.append(Member("evaluator", 0, None, tf_config))
    return members


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """A local cluster to run: its topology, the command of its members, its restarts.

    Attributes:
      command: what every member runs, e.g. `(sys.executable, "-m", "trainer", ...)`.
      workers: `worker` members (at least 1).
      ps: parameter servers; more than 0 also adds a `chief` (the coordinator).
      chief: a `chief` member even without parameter servers.
      evaluator: an `evaluator` member beside training.
      port_base: 0 picks free ports on 127.0.0.1; otherwise the first of consecutive ports.
      restarts: how many times a failed cluster starts again, on fresh ports.
    """

    command: tuple[str, ...]
    workers: int
    ps: int = 0
    chief: bool = False
    evaluator: bool = False
    port_base: int = 0
    restarts: int = 0

    def __post_init__(self):
        if self.restarts < 0:
            raise UserError(
                f"`--restarts` ({self.restarts}) must be 0 or more; pass 0 for no restarts."
            )

    def members(self) -> list[Member]:
        """The members of one attempt, on ports picked now (`plan_cluster`)."""
        return plan_cluster(self.workers, self.ps, self.chief, self.evaluator, self.port_base)

    def with_command(self, *more: str) -> LaunchPlan:
        """This plan with `more` arguments after its command."""
        return dataclasses.replace(self, command=(*self.command, *more))


def elastic_command(command: Sequence[str], low: int, high: int) -> list[str]:
    """`command` with the elastic job's size (`cluster.elastic.min_workers`, `max_workers`)."""
    return [
        *command,
        f"--config.cluster.elastic.min_workers={low}",
        f"--config.cluster.elastic.max_workers={high}",
    ]


# `cluster.elastic`'s fields the launcher itself reads (the others are the trainers').
LAUNCHER_FIELDS = ("max_restarts", "cooldown_s", "rendezvous_timeout")
_ELASTIC_FLAG = "--config.cluster.elastic."


def elastic_settings(command: Sequence[str]) -> dict:
    """`cluster.elastic`'s launcher settings: from `--config.cluster.elastic.X=V`, else defaults.

    The defaults and rules are `trainer.loop.options.ElasticOptions`' own.

    Raises:
      UserError: a value that is not a number, or one the section's rules refuse.
    """
    defaults = loop_options.ElasticOptions()
    given = {}
    for arg in command:
        name, _, value = arg.removeprefix(_ELASTIC_FLAG).partition("=")
        if arg.startswith(_ELASTIC_FLAG) and name in LAUNCHER_FIELDS:
            default = getattr(defaults, name)
            try:
                given[name] = type(default)(value)
            except ValueError:
                raise UserError(
                    f"`cluster.elastic.{name}` ({value!r}) must be a number; e.g. "
                    f"`{_ELASTIC_FLAG}{name}={default}`."
                ) from None
    settings = dataclasses.replace(defaults, **given)  # the section's rules checked
    return {name: getattr(settings, name) for name in LAUNCHER_FIELDS}


def parse_workers(text: str) -> tuple[int, int, bool]:
    """`--workers`: "N", or "MIN:MAX" for an elastic job; (low, high, elastic).

    Raises:
      UserError: not a count or a range of counts, or MIN > MAX.
    """
    low, colon, high = text.partition(":")
    try:
        counts = (int(low), int(high) if colon else int(low))
    except ValueError:
        raise UserError(
            f"`--workers` ({text!r}) must be a count (`--workers=3`) or MIN:MAX for an elastic "
            "job (`--workers=2:4`)."
        ) from None
    if colon and not 1 <= counts[0] <= counts[1]:
        raise UserError(
            f"`--workers` ({text}) must be MIN:MAX with 1 <= MIN <= MAX (an elastic job trains "
            f"with at least MIN members, at most MAX); pass e.g. `--workers={counts[1]}:"
            f"{max(counts)}`."
        )
    return counts[0], counts[1], bool(colon)


__getattr__ = renamed.old_names(__name__, {"Plan": "LaunchPlan"}, globals())
