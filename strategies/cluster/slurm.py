"""Slurm: the `TF_CONFIG` of a member that `srun` started, derived from Slurm's own variables.

A batch script runs one `srun` step, one Slurm task per member of the cluster,

    sbatch -n4 --wrap 'srun -K python -m trainer --strategy=parameter_server --cluster=slurm'

and each member derives the whole cluster and its own place in it from the
step's environment: the nodes (`SLURM_STEP_NODELIST`, a hostlist such as
`node[01-03,7]`, expanded as `scontrol show hostnames` does), the Slurm tasks
on each (`SLURM_STEP_TASKS_PER_NODE`, such as `2(x3),1`), how ranks are dealt to
nodes (`SLURM_DISTRIBUTION`: block, the default, or cyclic) and its own rank
(`SLURM_PROCID`). The address of rank r is its node's name and `port` plus
its index among the members on that node, so several members share a node.

Member types follow the ranks: under `parameter_server`, rank 0 is the chief
(the coordinator), the next `ps_members` ranks are ps members and the rest
workers; under any other strategy every member is a worker and worker 0 is the
chief. With block distribution, the chief and the ps members share the first
node(s).

TensorFlow's `tf.distribute.cluster_resolver.SlurmClusterResolver` does the
same sum but does not fit here: it reads `os.environ` rather than a given
mapping, counts GPUs with `nvidia-smi` unless told (and divides by zero when
told a CPU node has none), orders the nodes by name (`node10` before
`node9`, where Slurm gives rank 0 to `node9`) and assumes block distribution.
The result here equals its own wherever its assumptions hold (tested).

This module does not import TensorFlow.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from strategies.cluster import tf_config as cluster
from towerflow.errors import UserError

DISTRIBUTIONS = ("block", "cyclic")  # how Slurm deals ranks to nodes (`srun -m`), first level
_MAX_PORT = 65535


def tf_config(environ: Mapping[str, str], strategy: str, ps_members: int, port: int) -> str:
    """The `TF_CONFIG` JSON for the member whose environment (a Slurm task's) is `environ`.

    Args:
      environ: the member's environment (`SLURM_*` variables), e.g. `os.environ`.
      strategy: the strategy's name; "parameter_server" makes rank 0 the chief,
        the next `ps_members` ranks ps members and the rest workers; any other
        makes every member a worker.
      ps_members: how many ps members a `parameter_server` cluster has (ignored
        otherwise).
      port: the port of the first member on each node; the node's next members take
        the ports after it.

    Returns:
      The JSON text: the whole cluster and this member's type and index.

    Raises:
      UserError: the environment is not a Slurm task's, describes a layout this
        cannot place, or has too few members for `strategy`; one line with the fix.
    """
    addresses, rank = step_addresses(environ, port)
    by_type = _addresses_by_type(strategy, ps_members, addresses)
    task_type, task_index = _member_of(by_type, rank)
    return cluster.make_tf_config(by_type, task_type, task_index)


def step_addresses(environ: Mapping[str, str], port: int) -> tuple[list[str], int]:
    """Every member's "host:port" in rank order, and this member's rank (`tf_config`'s layout).

    Raises:
      UserError: as `tf_config`, for the environment and the port.
    """
    nodes, counts, rank = _step(environ)
    places = _places(nodes, counts, _distribution(environ))
    _check_own_place(environ, places, rank)
    _check_ports(port, max(counts))
    return [f"{node}:{port + local}" for node, local in places], rank


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a Slurm hostlist, in order, as `scontrol show hostnames` prints them.

    `node[01-03,7],login1` gives node01, node02, node03, node7, login1: a
    range keeps the width of its first bound, several bracket groups multiply
    out (`rack[1-2]-n[1-2]`: rack1-n1, rack1-n2, rack2-n1, rack2-n2).

    Raises:
      ValueError: `hostlist` is malformed; the message says where.
    """
    hosts = []
    for part in re.split(r"[,\s]+(?![^\[]*\])", hostlist):  # commas outside brackets
        if part:
            hosts.extend(_expand_host(part))
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node list, one count per node: `2(x3),1` gives [2, 2, 2, 1].

    Raises:
      ValueError: `spec` is malformed.
    """
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"`{part}` is not a count nor `count(xrepeats)`")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def _expand_host(part: str) -> list[str]:
    """One hostlist entry: literal text and bracketed ranges, the ranges multiplied out."""
    pieces = re.split(r"\[([^\[\]]*)\]", part)  # text, range, text, range, ..., text
    texts, ranges = pieces[0::2], pieces[1::2]
    if any(c in text for text in texts for c in "[]"):
        raise ValueError(f"unbalanced brackets in `{part}`")
    if ranges and texts[-1]:  # as scontrol: text may not follow the last range
        raise ValueError(f"text after the last range in `{part}`")
    choices = []
    for text, numbers in zip(texts, [*map(_expand_range, ranges), [""]]):
        choices.append([text + number for number in numbers])
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_range(numbers: str) -> list[str]:
    """`01-03,7` -> 01, 02, 03, 7: each range zero-padded to the width of its first bound."""
    expanded = []
    for item in numbers.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(f"`[{numbers}]` holds `{item}`, not a number nor `low-high`")
        low, high = int(match[1]), int(match[2] or match[1])
        expanded.extend(str(n).zfill(len(match[1])) for n in range(low, high + 1))
    return expanded


def _step(environ: Mapping[str, str]) -> tuple[list[str], list[int], int]:
    """(nodes, Slurm tasks on each node, this member's rank) of the step this process belongs to."""
    if "SLURM_PROCID" not in environ:
        raise UserError(
            "`--cluster=slurm` needs a Slurm task's environment, but `SLURM_PROCID` is not "
            "set; start each process with `srun` inside an `sbatch` or `salloc` job."
        )
    rank = _integer(environ, "SLURM_PROCID")
    if "SLURM_STEP_NUM_TASKS" in environ:
        nodes, counts = _step_layout(environ)
    else:  # the batch script itself, not a Slurm task of an `srun` step
        nodes, counts = _batch_layout(environ)
    if rank >= sum(counts):
        raise UserError(
            f"`SLURM_PROCID` ({rank}) must be below the step's {sum(counts)} Slurm task(s); "
            "run the trainer under the `srun` that set it, unchanged."
        )
    return nodes, counts, rank


def _step_layout(environ: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """The nodes of an `srun` step and how many of its Slurm tasks run on each."""
    nodes = _parsed(environ, "SLURM_STEP_NODELIST", expand_hostlist)
    counts = _parsed(environ, "SLURM_STEP_TASKS_PER_NODE", expand_tasks_per_node)
    total = _integer(environ, "SLURM_STEP_NUM_TASKS")
    if len(counts) != len(nodes) or sum(counts) != total or 0 in counts:
        raise UserError(
            f"`SLURM_STEP_TASKS_PER_NODE` ({environ['SLURM_STEP_TASKS_PER_NODE']}) must give "
            f"a positive count for each of the {len(nodes)} node(s) of `SLURM_STEP_NODELIST` "
            f"({environ['SLURM_STEP_NODELIST']}), {total} (`SLURM_STEP_NUM_TASKS`) in all; "
            "run the trainer under the `srun` that set them, unchanged."
        )
    return nodes, counts


def _batch_layout(environ: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """A batch script's own process: one member, unless the Slurm job asked for more."""
    processes = _integer(environ, "SLURM_NTASKS") if "SLURM_NTASKS" in environ else 1
    if processes != 1:
        raise UserError(
            f"the Slurm job has {processes} Slurm tasks (`SLURM_NTASKS`) but this process runs "
            "outside a Slurm job step (no `SLURM_STEP_NUM_TASKS`), as one process; start one per "
            "Slurm task with `srun -K python -m trainer ...` in the batch script."
        )
    if "SLURMD_NODENAME" in environ:
        return [environ["SLURMD_NODENAME"]], [1]
    return _parsed(environ, "SLURM_JOB_NODELIST", expand_hostlist)[:1], [1]


def _distribution(environ: Mapping[str, str]) -> str:
    """How the step dealt ranks to nodes: the first level of `SLURM_DISTRIBUTION`."""
    value = environ.get("SLURM_DISTRIBUTION", "block")
    first = re.split(r"[:,]", value)[0]
    if first in ("", "*"):  # "*" is Slurm's "the default", which is block
        return "block"
    if first not in DISTRIBUTIONS:
        raise UserError(
            f"`SLURM_DISTRIBUTION` is `{value}`; towerflow places members dealt to nodes by "
            f"{' or '.join(f'`{d}`' for d in DISTRIBUTIONS)}; "
            "run `srun -m block` or leave out `-m`/`--distribution`."
        )
    return first


def _places(nodes: list[str], counts: list[int], distribution: str) -> list[tuple[str, int]]:
    """For each rank, (its node, its index among the node's members), as Slurm deals them."""
    if distribution == "block":  # ranks fill the first node, then the next
        return [(node, local) for node, count in zip(nodes, counts) for local in range(count)]
    places = []  # cyclic: one rank per node in turn, skipping nodes that are full
    for local in range(max(counts)):
        places.extend((node, local) for node, count in zip(nodes, counts) if local < count)
    return places


def _check_own_place(environ: Mapping[str, str], places: list[tuple[str, int]], rank: int) -> None:
    """This member must sit where the derived layout puts it; else every address may be wrong."""
    node, local = places[rank]
    actual_node = environ.get("SLURMD_NODENAME", node)
    actual_local = environ.get("SLURM_LOCALID", str(local))
    if (actual_node, actual_local) != (node, str(local)):
        raise UserError(
            f"rank {rank} (`SLURM_PROCID`) runs on `{actual_node}` as local rank {actual_local} "
            f"(`SLURMD_NODENAME`, `SLURM_LOCALID`), but the step's layout puts it on `{node}` "
            f"as local rank {local}; run the step with `srun -m block`, one Slurm task per process."
        )


def _check_ports(port: int, members_per_node: int) -> None:
    if not 1 <= port <= _MAX_PORT - members_per_node + 1:
        raise UserError(
            f"`cluster.port` ({port}) is the first of {members_per_node} port(s) per node, "
            f"which must lie within 1-{_MAX_PORT}; pass `--config.cluster.port=2222`."
        )


def _addresses_by_type(
    strategy: str, ps_members: int, addresses: list[str]
) -> dict[str, list[str]]:
    """Member type -> addresses: chief, ps, workers in rank order for `parameter_server`."""
    if strategy != "parameter_server":
        return {"worker": addresses}
    if ps_members < 1:
        raise UserError(
            f"`cluster.ps_members` ({ps_members}) must be at least 1 under `parameter_server`; "
            "pass `--config.cluster.ps_members=1`."
        )
    if len(addresses) < ps_members + 2:
        raise UserError(
            f"`parameter_server` with `cluster.ps_members`={ps_members} needs {ps_members + 2} "
            f"or more Slurm tasks (1 chief, {ps_members} ps, at least 1 worker), but the step "
            f"has {len(addresses)}; ask for more (`sbatch -n{ps_members + 2}`) or fewer ps members."
        )
    return {
        "chief": addresses[:1],
        "ps": addresses[1 : 1 + ps_members],
        "worker": addresses[1 + ps_members :],
    }


def _member_of(by_type: dict[str, list[str]], rank: int) -> tuple[str, int]:
    """The (type, index) of the rank-th member, counting the types in their order."""
    for task_type, addresses in by_type.items():
        if rank < len(addresses):
            return task_type, rank
        rank -= len(addresses)
    raise AssertionError("the rank was checked against the step's size")


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    if not value.strip().isdigit():
        raise UserError(
            f"`{name}` must be a non-negative integer, not `{value}`; "
            "run the trainer under the `srun` that set it, unchanged."
        )
    return int(value)


def _parsed(environ: Mapping[str, str], name: str, parse) -> list:
    if name not in environ:
        raise UserError(
            f"`{name}` is not set in this Slurm task; run the trainer under `srun` (Slurm "
            "sets it for every Slurm task of a step)."
        )
    try:
        values = parse(environ[name])
    except ValueError as e:
        raise UserError(
            f"`{name}` ({environ[name]}) is malformed: {e}; "
            "run the trainer under the `srun` that set it, unchanged."
        ) from None
    if not values:
        raise UserError(f"`{name}` is empty; run the trainer under `srun`, which sets it.")
    return values
