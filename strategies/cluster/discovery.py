"""Where this process runs: its cluster, found once at start and made its `TF_CONFIG`.

Every member of a cluster (one of its processes) runs the same command; the
scheduler that started it says where it is. With `cluster.source = "auto"`
(the default) the cluster comes from the first of:

1. `TF_CONFIG`, when set and not empty (`python -m trainer.launch`, a TFJob,
   Vertex AI, a script of your own); one of only spaces (a template filled
   with nothing) is refused, an empty one is unset, as TensorFlow reads it;
2. a scheduler's environment: a Slurm job step of more than one Slurm task
   (`SLURM_*`, derived by `strategies.cluster.slurm`), a Kubernetes JobSet pod (the
   variables `deploy/jobset-*.yaml` set, see `jobset_tf_config`) or a
   SageMaker training job of several hosts (`SM_HOSTS`, `SM_CURRENT_HOST`);
   a Slurm job of one Slurm task or a SageMaker job of one host is one process;
3. else this process alone (`local`).

`cluster.source` (`--cluster`) names one instead: `tf_config`, `slurm`,
`jobset`, `sagemaker` or `local` (which ignores a `TF_CONFIG`). A source whose
environment is missing stops the trainer with one line naming what is
missing. `resolve` sets the cluster found as this process's `TF_CONFIG`
before any strategy is built, so every plugin and TensorFlow's own resolvers
read one description, checked by `strategies.cluster.tf_config.parse`.

The sidecar evaluator rule: an evaluator member evaluates, and the chief then
does not (two writers of `model_dir/eval` would interleave their events).
The chief knows that an evaluator runs when `cluster` lists one (as
`trainer.launch`, a TFJob and the JobSet manifests write it), or when
`cluster.sidecar_evaluator` is set (for a `TF_CONFIG` that leaves it out,
as Vertex AI's does). An evaluator the chief cannot know of is refused.

This module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from strategies.cluster import tf_config as cluster
from towerflow.errors import UserError

SOURCES = ("auto", "tf_config", "slurm", "jobset", "sagemaker", "local")
# The `cluster` section of configs/default.py, for a config file that has none.
DEFAULTS = {
    "source": "auto",
    "port": 2222,
    "ps_members": 1,
    "ps_tasks": None,
    "sidecar_evaluator": False,
}
# Old field names kept working for one release, with a warning: old -> new.
RENAMED = {"ps_tasks": "ps_members"}
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID")
# Set in every pod by deploy/jobset-*.yaml: the first three from the pod's JobSet labels
# through the downward API, `JOB_COMPLETION_INDEX` by the Indexed Job itself, and
# `JOBSET_MEMBERS` ("chief=1,worker=2,ps=1": each replicated job's pod count) by hand.
JOBSET_VARIABLES = (
    "JOBSET_NAME",
    "REPLICATED_JOB_NAME",
    "JOB_INDEX",
    "JOB_COMPLETION_INDEX",
    "JOBSET_MEMBERS",
)
# Old environment variable names kept working for one release, with a warning: old -> new.
RENAMED_VARIABLES = {"JOBSET_TASKS": "JOBSET_MEMBERS"}
SAGEMAKER_VARIABLES = ("SM_HOSTS", "SM_CURRENT_HOST")
_SHOWN_PER_TYPE = 3  # addresses the start-up line shows of one member type


@dataclasses.dataclass(frozen=True)
class Found:
    """A process's cluster and where it came from.

    Attributes:
      source: "tf_config", "slurm", "jobset", "sagemaker" or "local".
      tf_config: the cluster as `TF_CONFIG` JSON; None for one process (`local`).
      origin: what the start-up line names the source by, e.g. "job 42"; may be "".
    """

    source: str
    tf_config: str | None
    origin: str = ""

    def line(self) -> str | None:
        """The start-up line naming the source, the cluster and this member; None for `local`.

        E.g. `cluster: from slurm (job 42): chief n1:2222, ps n1:2223, worker n2:2222,
        n2:2223; this member worker:1`.
        """
        spec = cluster.parse(self.tf_config)
        if spec is None:
            return None
        origin = f" ({self.origin})" if self.origin else ""
        members = ", ".join(
            _shown(member_type, addresses) for member_type, addresses in spec.addresses.items()
        )
        source = "TF_CONFIG" if self.source == "tf_config" else self.source
        return f"cluster: from {source}{origin}: {members}; this member {spec.member_name}"


def settings(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """A config's `cluster` section with `DEFAULTS` for what it leaves out (or lacks).

    A field set under its old name (`RENAMED`) gives its value to the new one.

    Raises:
      UserError: a field is set under both names, to different values.
    """
    section = section or {}
    chosen = {name: section.get(name, default) for name, default in DEFAULTS.items()}
    for old, new in RENAMED.items():
        if chosen[old] is None:
            continue
        if chosen[new] not in (DEFAULTS[new], chosen[old]):
            raise UserError(
                f"`cluster.{old}` ({chosen[old]}) and `cluster.{new}` ({chosen[new]}) are one "
                f"setting under its old and new name; set only `cluster.{new}`."
            )
        chosen[new] = chosen[old]
    return chosen


def renamed_warnings(section: Mapping[str, Any] | None) -> list[str]:
    """One warning line for each field that `section` sets under its old name (`RENAMED`)."""
    section = section or {}
    return [
        f"warning: `cluster.{old}` is now `cluster.{new}` (the processes of a cluster are its "
        f"members); the old name goes in the next release: pass "
        f"`--config.cluster.{new}={section[old]}` instead."
        for old, new in RENAMED.items()
        if section.get(old) is not None
    ]


def renamed_variables(environ: Mapping[str, str]) -> Mapping[str, str]:
    """`environ` with each variable set under its old name (`RENAMED_VARIABLES`) under its new one.

    Raises:
      UserError: a variable is set under both names, to different values.
    """
    renamed = {}
    for old, new in RENAMED_VARIABLES.items():
        if old not in environ:
            continue
        if environ.get(new, environ[old]) != environ[old]:
            raise UserError(
                f"`{old}` ({environ[old]}) and `{new}` ({environ[new]}) are one variable under "
                f"its old and new name; set only `{new}`."
            )
        renamed[new] = environ[old]
    return {**environ, **renamed} if renamed else environ


def renamed_variable_warnings(environ: Mapping[str, str]) -> list[str]:
    """One warning line for each variable that `environ` sets under its old name."""
    return [
        f"warning: `{old}` is now `{new}` (the processes of a cluster are its members); the "
        f"old name goes in the next release: set `{new}={environ[old]}` instead."
        for old, new in RENAMED_VARIABLES.items()
        if old in environ
    ]


def find(
    section: Mapping[str, Any] | None, strategy: str, environ: Mapping[str, str] = os.environ
) -> Found:
    """The cluster of this process, from the source `section` names; changes nothing.

    Args:
      section: the config's `cluster` section (None: all defaults).
      strategy: the strategy's name (the types of a Slurm step's members depend on it).
      environ: the process's environment.

    Raises:
      UserError: an unknown source, a named source whose environment is missing,
        a blank `TF_CONFIG`, or an environment that does not describe a cluster; one
        line with the fix.
    """
    chosen = settings(section)
    source = chosen["source"]
    if source not in SOURCES:
        raise UserError(
            f"`cluster.source` ({source!r}) is not a cluster source; use one of "
            f"{', '.join(f'`{name}`' for name in SOURCES)} (`--cluster=auto` finds it)."
        )
    if source in ("auto", "tf_config"):
        _refuse_blank_tf_config(environ)
    if source == "auto":
        source = detect(environ)
    return _DERIVATIONS[source](environ, strategy, chosen)


def _refuse_blank_tf_config(environ: Mapping[str, str]) -> None:
    """A `TF_CONFIG` of only spaces is a mistake, not a single process; an empty one is unset.

    Raises:
      UserError: `TF_CONFIG` is set to spaces only.
    """
    text = environ.get("TF_CONFIG", "")
    if text and not text.strip():
        raise UserError(
            f"`TF_CONFIG` is blank ({text!r}): set it to the cluster's JSON, or "
            "`unset TF_CONFIG` to train in this process alone."
        )


def resolve(
    section: Mapping[str, Any] | None,
    strategy: str,
    environ: MutableMapping[str, str] = os.environ,
    report: Callable[[str], None] = print,
) -> Found:
    """Finds this process's cluster, checks it, and makes it the `TF_CONFIG` of `environ`.

    Call it before any strategy is built. `local` removes a `TF_CONFIG`. A field
    set under its old name, or an environment variable (`renamed_variable_warnings`),
    is reported, one line each (`renamed_warnings`).

    Raises:
      UserError: as `find`; a malformed cluster; or an evaluator member that the
        chief cannot know of (see the module docstring).
    """
    for warning in [*renamed_warnings(section), *renamed_variable_warnings(environ)]:
        report(warning)
    found = find(section, strategy, environ)
    spec = cluster.parse(found.tf_config)
    if spec and spec.task_type == "evaluator" and "evaluator" not in spec.addresses:
        if not sidecar_evaluator(section):
            raise UserError(
                "this member is an `evaluator` that its `TF_CONFIG` `cluster` does not list, so "
                "the chief cannot know it runs and would evaluate too (two writers of "
                "`model_dir/eval`); pass `--config.cluster.sidecar_evaluator=True` to every "
                'member, or list it in every member\'s `cluster` ("evaluator": ["host:port"]).'
            )
    if found.tf_config is None:
        environ.pop("TF_CONFIG", None)
    else:
        environ["TF_CONFIG"] = found.tf_config
    return found


def sidecar_evaluator(section: Mapping[str, Any] | None) -> bool:
    """Whether the config says an evaluator runs beside training: `cluster.sidecar_evaluator`."""
    return bool(settings(section)["sidecar_evaluator"])


def detect(environ: Mapping[str, str]) -> str:
    """The source `auto` picks for `environ` (the order of the module docstring)."""
    if environ.get("TF_CONFIG", "").strip():
        return "tf_config"
    if _has(environ, SLURM_VARIABLES) and _slurm_processes(environ) > 1:
        return "slurm"
    if "JOBSET_NAME" in environ:
        return "jobset"
    if _has(environ, SAGEMAKER_VARIABLES) and len(_sagemaker_hosts(environ)) > 1:
        return "sagemaker"
    return "local"


def jobset_tf_config(environ: Mapping[str, str], port: int) -> str:
    """The `TF_CONFIG` of a JobSet pod, from the variables deploy/jobset-*.yaml sets.

    Each replicated job is one member type (`chief`, `worker`, `ps`, `evaluator`),
    with `replicas: 1` and one pod per member (`completions`); member i of type t
    is the pod `<jobset>-<t>-0-<i>`, found at `<jobset>-<t>-0-<i>.<subdomain>`
    through the JobSet's headless service (`network.enableDNSHostnames`; the
    subdomain is the JobSet's name unless `JOBSET_SUBDOMAIN` says otherwise).

    Args:
      environ: the pod's environment (`JOBSET_VARIABLES`, optionally
        `JOBSET_SUBDOMAIN`, and `HOSTNAME`, checked against the pattern above).
      port: every member's port.

    Raises:
      UserError: a variable is missing or does not fit the others; one line with the fix.
    """
    hosts, own_type, index = jobset_pods(environ, cluster.TASK_TYPES)
    by_type = {
        member_type: [f"{host}:{port}" for host in names] for member_type, names in hosts.items()
    }
    return cluster.make_tf_config(by_type, own_type, index)


def jobset_pods(
    environ: Mapping[str, str], job_names: tuple[str, ...]
) -> tuple[dict[str, list[str]], str, int]:
    """A JobSet's pods as `jobset_tf_config` finds them, for replicated jobs named `job_names`.

    Returns:
      Each replicated job's pods' DNS names (`<jobset>-<job>-0-<i>.<subdomain>`),
      in `JOBSET_MEMBERS` order; this pod's replicated job and completion index.

    Raises:
      UserError: as `jobset_tf_config`, or a replicated job not named in `job_names`.
    """
    environ = renamed_variables(environ)
    _require(
        "jobset", environ, JOBSET_VARIABLES, "set them as deploy/jobset-multi-worker.yaml does"
    )
    jobset, own_type = environ["JOBSET_NAME"], environ["REPLICATED_JOB_NAME"]
    counts = _jobset_pod_counts(environ["JOBSET_MEMBERS"], job_names)
    if own_type not in counts:
        raise UserError(
            f"`REPLICATED_JOB_NAME` ({own_type}) is not in `JOBSET_MEMBERS` "
            f"({environ['JOBSET_MEMBERS']}); list every replicated job there with its pod count."
        )
    if _index(environ, "JOB_INDEX") != 0:
        raise UserError(
            f"`JOB_INDEX` is {environ['JOB_INDEX']}, but each member type is one Job: give the "
            f"replicated job `{own_type}` `replicas: 1` and one pod per member (`completions`)."
        )
    index = _index(environ, "JOB_COMPLETION_INDEX")
    if index >= counts[own_type]:
        raise UserError(
            f"`JOB_COMPLETION_INDEX` is {index}, but `JOBSET_MEMBERS` "
            f"({environ['JOBSET_MEMBERS']}) "
            f"gives `{own_type}` {counts[own_type]} pod(s); make it match the replicated job's "
            "`completions`."
        )
    pod = f"{jobset}-{own_type}-0-{index}"
    if environ.get("HOSTNAME", pod) != pod:
        raise UserError(
            f"this pod's hostname is `{environ['HOSTNAME']}`, not `{pod}` as a JobSet pod's "
            "is; set `network.enableDNSHostnames: true` in the JobSet, and `JOBSET_NAME` and "
            "`REPLICATED_JOB_NAME` from its labels."
        )
    subdomain = environ.get("JOBSET_SUBDOMAIN") or jobset
    hosts = {
        replicated: [f"{jobset}-{replicated}-0-{i}.{subdomain}" for i in range(count)]
        for replicated, count in counts.items()
    }
    return hosts, own_type, index


def _from_tf_config(environ: Mapping[str, str], strategy: str, chosen: dict) -> Found:
    if not environ.get("TF_CONFIG", "").strip():
        raise UserError(
            "`cluster.source` is `tf_config`, but `TF_CONFIG` is not set (or blank); set it to "
            "the cluster's JSON, or use `--cluster=auto`."
        )
    return Found("tf_config", environ["TF_CONFIG"])


def _from_slurm(environ: Mapping[str, str], strategy: str, chosen: dict) -> Found:
    _require("slurm", environ, SLURM_VARIABLES, "start each member with `srun` in a Slurm job")
    from strategies.cluster import slurm  # only a member of a Slurm step needs it

    text = slurm.tf_config(environ, strategy, chosen["ps_members"], chosen["port"])
    return Found("slurm", text, f"job {environ['SLURM_JOB_ID']}")


def _from_jobset(environ: Mapping[str, str], strategy: str, chosen: dict) -> Found:
    text = jobset_tf_config(environ, _port(chosen))
    return Found("jobset", text, f"JobSet {environ['JOBSET_NAME']}")


def _from_sagemaker(environ: Mapping[str, str], strategy: str, chosen: dict) -> Found:
    """Every host a worker (SageMaker's own convention), sorted by name, on `cluster.port`."""
    _require("sagemaker", environ, SAGEMAKER_VARIABLES, "run it in a SageMaker training job")
    hosts, current = _sagemaker_hosts(environ), environ["SM_CURRENT_HOST"]
    if current not in hosts:
        raise UserError(
            f"`SM_CURRENT_HOST` ({current}) is not among `SM_HOSTS` ({environ['SM_HOSTS']}); "
            "run it in a SageMaker training job, which sets both."
        )
    port = _port(chosen)
    by_type = {"worker": [f"{host}:{port}" for host in hosts]}
    return Found("sagemaker", cluster.make_tf_config(by_type, "worker", hosts.index(current)))


def _local(environ: Mapping[str, str], strategy: str, chosen: dict) -> Found:
    return Found("local", None)


_DERIVATIONS: dict[str, Callable[[Mapping[str, str], str, dict], Found]] = {
    "tf_config": _from_tf_config,
    "slurm": _from_slurm,
    "jobset": _from_jobset,
    "sagemaker": _from_sagemaker,
    "local": _local,
}


def _require(source: str, environ: Mapping[str, str], names: tuple[str, ...], fix: str) -> None:
    missing = [name for name in names if name not in environ]
    if missing:
        raise UserError(
            f"the `{source}` cluster source needs {', '.join(f'`{n}`' for n in missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not set; {fix}, or pick another "
            "source with `--cluster`."
        )


def _has(environ: Mapping[str, str], names: tuple[str, ...]) -> bool:
    return all(name in environ for name in names)


def _slurm_processes(environ: Mapping[str, str]) -> int:
    """Slurm tasks (processes) of this step (of the Slurm job in a batch script); else 1."""
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    return int(value) if value.strip().isdigit() else 1


def _sagemaker_hosts(environ: Mapping[str, str]) -> list[str]:
    try:
        hosts = json.loads(environ["SM_HOSTS"])
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, list) or not all(isinstance(host, str) for host in hosts):
        raise UserError(
            f"`SM_HOSTS` ({environ['SM_HOSTS']}) must be a JSON list of host names, as "
            'SageMaker sets it: ["algo-1", "algo-2"].'
        )
    return sorted(hosts)


def _jobset_pod_counts(text: str, job_names: tuple[str, ...]) -> dict[str, int]:
    """`JOBSET_MEMBERS`, "chief=1,worker=2,ps=1", as replicated job -> pod count."""
    counts: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.strip().partition("=")
        if name not in job_names or not count.isdigit() or int(count) < 1:
            example = ",".join(f"{t}={n}" for t, n in zip(job_names, (1, 2, 1)))
            raise UserError(
                f"`JOBSET_MEMBERS` ({text}) must list each replicated job as `type=pods`, the type "
                f"one of {', '.join(f'`{t}`' for t in job_names)}, e.g. "
                f"`{example}`; name the replicated jobs after their member types."
            )
        counts[name] = int(count)
    return counts


def _index(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    if not value.isdigit():
        raise UserError(
            f"`{name}` must be a non-negative integer, not `{value}`; set it from the pod's "
            "JobSet labels as deploy/jobset-multi-worker.yaml does."
        )
    return int(value)


def _port(chosen: dict) -> int:
    port = chosen["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UserError(f"`cluster.port` ({port}) must be a port from 1 to 65535, e.g. 2222.")
    return port


def _shown(member_type: str, addresses: tuple[str, ...]) -> str:
    """One member type for the start-up line: its first addresses, and how many there are."""
    if len(addresses) <= _SHOWN_PER_TYPE + 1:
        return f"{member_type} {', '.join(addresses)}"
    return f"{member_type} {', '.join(addresses[:_SHOWN_PER_TYPE])} ... ({len(addresses)} in all)"
