"""`TF_CONFIG`: the one description of a cluster, parsed and checked.

Every task of a cluster runs the same program with its own `TF_CONFIG`, a
JSON object that lists the whole cluster and names the task itself:

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 1}}

Kubernetes TFJob sets it, `python -m trainer.launch` writes it for local
clusters, and `parse` turns it into a `ClusterSpec` or a one-line `UserError`
that says what is wrong and how to fix it. `wait_until_gone` lets a server
task (a ps, or a worker of a parameter-server cluster) see the chief end.

Glossary (TensorFlow's):

* chief: the task that writes checkpoints, summaries and exports; worker 0
  when the cluster has no `chief` job. In a parameter-server cluster it is
  the coordinator that schedules work on the workers.
* worker: a task that computes steps.
* ps: a parameter server, which holds variables.
* evaluator: an optional task that evaluates checkpoints on the side. It is
  independent of training: it may be absent from `cluster` while its own
  `task.type` is "evaluator", and `ClusterSpec.as_dict` leaves it out.

This module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from strategies.errors import UserError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
DEFAULT_RPC_LAYER = "grpc"
_EXAMPLE = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
_EXAMPLE_TASK = '"task": {"type": "worker", "index": 0}'
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A parsed, validated `TF_CONFIG`.

    Attributes:
      jobs: task type -> the addresses ("host:port") of its tasks, in index order.
      task_type: this process's task type; None when `TF_CONFIG` names no task.
      task_index: this process's index within `task_type`.
      rpc_layer: the protocol the tasks talk ("grpc").
    """

    jobs: dict[str, tuple[str, ...]]
    task_type: str | None = None
    task_index: int | None = None
    rpc_layer: str = DEFAULT_RPC_LAYER

    @property
    def num_workers(self) -> int:
        """How many `worker` tasks the cluster has (the chief not counted)."""
        return len(self.jobs.get("worker", ()))

    @property
    def num_ps(self) -> int:
        """How many parameter servers the cluster has."""
        return len(self.jobs.get("ps", ()))

    @property
    def has_chief(self) -> bool:
        """Whether the cluster has a `chief` task."""
        return "chief" in self.jobs

    @property
    def has_evaluator(self) -> bool:
        """Whether the cluster lists an evaluator, or this task is one."""
        return "evaluator" in self.jobs or self.task_type == "evaluator"

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief: the `chief` task, or worker 0 when there is none."""
        if self.task_type == "chief":
            return True
        return not self.has_chief and self.task_type == "worker" and self.task_index == 0

    @property
    def address(self) -> str | None:
        """This task's "host:port"; None for an evaluator absent from `cluster`."""
        addresses = self.jobs.get(self.task_type or "", ())
        return addresses[self.task_index] if addresses else None

    def as_dict(self) -> dict[str, list[str]]:
        """The training cluster, as `tf.train.ClusterSpec` takes it.

        The evaluator is left out: TensorFlow keeps it independent of training,
        and a coordinator that saw it would wait to connect to a server the
        evaluator never starts.
        """
        return {job: list(addresses) for job, addresses in self.jobs.items() if job != "evaluator"}

    def unreachable(self, timeout_s: float = 1.0) -> list[str]:
        """The other tasks of the training cluster that accept no connection now.

        Each as "worker:1 (host:port)". A task whose process is gone refuses at
        once; one on a lost host takes `timeout_s` to give up on.
        """
        lost = []
        for job, addresses in self.as_dict().items():
            for index, address in enumerate(addresses):
                if (job, index) == (self.task_type, self.task_index):
                    continue
                host, _, port = address.rpartition(":")
                if not _answers(host, int(port), timeout_s):
                    name = job if job == "chief" else f"{job}:{index}"
                    lost.append(f"{name} ({address})")
        return lost


def parse(text: str | None) -> ClusterSpec | None:
    """Parses and validates a `TF_CONFIG` value.

    Args:
      text: the JSON text of `TF_CONFIG`; None or blank means no cluster.

    Returns:
      The cluster, or None when `text` is None or blank (a single process).

    Raises:
      UserError: `text` is malformed; the message says what is wrong and how to fix it.
    """
    if text is None or not text.strip():
        return None
    config = _load(text)
    jobs = _parse_jobs(config.get("cluster"), "cluster" in config)
    task_type, task_index = _parse_task(config.get("task"), "task" in config, jobs)
    rpc_layer = config.get("rpc_layer") or DEFAULT_RPC_LAYER
    if not isinstance(rpc_layer, str):
        raise UserError(
            f'`TF_CONFIG` `rpc_layer` must be a string such as "grpc", not {_show(rpc_layer)}; '
            "fix it or leave it out."
        )
    return ClusterSpec(jobs, task_type, task_index, rpc_layer)


def from_env(environ: Mapping[str, str] = os.environ) -> ClusterSpec | None:
    """The cluster described by the `TF_CONFIG` environment variable; None when it is unset."""
    return parse(environ.get("TF_CONFIG"))


def make_tf_config(jobs: Mapping[str, list[str]], task_type: str, task_index: int) -> str:
    """The `TF_CONFIG` JSON for one task of a cluster, checked with `parse`.

    Args:
      jobs: task type -> addresses ("host:port"), in index order.
      task_type: the task's type (one of `TASK_TYPES`).
      task_index: the task's index within `task_type`.

    Raises:
      UserError: the result would not be a valid `TF_CONFIG`.
    """
    text = json.dumps(
        {
            "cluster": {job: list(addresses) for job, addresses in jobs.items()},
            "task": {"type": task_type, "index": task_index},
        }
    )
    parse(text)
    return text


def wait_until_gone(
    address: str, startup_s: float = 600.0, interval_s: float = 1.0, misses: int = 3
) -> bool:
    """Blocks while the task at `address` ("host:port") runs; how a server learns the job ended.

    Tries a TCP connection every `interval_s` seconds: first until the task
    answers (for at most `startup_s`), then until `misses` tries in a row fail.

    Returns:
      True when the task came up and is gone; False when it never came up.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + startup_s
    while not _answers(host, int(port), interval_s):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    failed = 0
    while failed < misses:
        time.sleep(interval_s)
        failed = 0 if _answers(host, int(port), interval_s) else failed + 1
    return True


def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _load(text: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"`TF_CONFIG` is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            f"set it to a JSON object such as {_EXAMPLE}."
        ) from None
    if not isinstance(config, dict):
        raise UserError(
            f"`TF_CONFIG` must be a JSON object, not {_show(config)}; "
            f"set it to one such as {_EXAMPLE}."
        )
    return config


def _parse_jobs(cluster: Any, present: bool) -> dict[str, tuple[str, ...]]:
    if not present:
        raise UserError(f"`TF_CONFIG` has no `cluster`; add one, as in {_EXAMPLE}.")
    if not isinstance(cluster, dict) or not cluster:
        problem = "is empty" if cluster == {} else f"must be a JSON object, not {_show(cluster)}"
        raise UserError(
            f"`TF_CONFIG` `cluster` {problem}; map task types to address lists, "
            'as in {"worker": ["host:port", ...]}.'
        )
    jobs = {job: _parse_addresses(job, addresses) for job, addresses in cluster.items()}
    _check_unique(jobs)
    for job in ("chief", "evaluator"):
        if len(jobs.get(job, ())) > 1:
            raise UserError(
                f"`TF_CONFIG` `cluster.{job}` has {len(jobs[job])} addresses, but a cluster has "
                f"at most one {job}; keep one and move or remove the others."
            )
    if "ps" in jobs and "worker" not in jobs:
        raise UserError(
            "`TF_CONFIG` `cluster` has `ps` tasks but no `worker`; add `worker` addresses "
            "(parameter servers only hold variables, workers compute)."
        )
    return jobs


def _parse_addresses(job: str, addresses: Any) -> tuple[str, ...]:
    if job not in TASK_TYPES:
        raise UserError(
            f"`TF_CONFIG` `cluster` has unknown task type {_show(job)}; "
            f"use only {_names(TASK_TYPES)}."
        )
    if (
        not isinstance(addresses, list)
        or not addresses
        or not all(isinstance(a, str) for a in addresses)
    ):
        raise UserError(
            f'`TF_CONFIG` `cluster.{job}` must be a non-empty list of "host:port" strings, '
            f"not {_show(addresses)}."
        )
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UserError(
                f"`TF_CONFIG` `cluster.{job}` address {_show(address)} is not host:port "
                'with a port from 1 to 65535; write it as "10.0.0.1:2222".'
            )
    return tuple(addresses)


def _check_unique(jobs: dict[str, tuple[str, ...]]) -> None:
    seen: dict[str, str] = {}
    for job, addresses in jobs.items():
        for index, address in enumerate(addresses):
            task = f"{job}:{index}"
            if address in seen:
                raise UserError(
                    f"`TF_CONFIG` `cluster` gives {_show(address)} to both {seen[address]} "
                    f"and {task}; give every task its own host:port."
                )
            seen[address] = task


def _parse_task(task: Any, present: bool, jobs: dict[str, tuple[str, ...]]) -> tuple[str, int]:
    if not present:
        if sum(len(addresses) for addresses in jobs.values()) > 1:
            raise UserError(
                f"`TF_CONFIG` has no `task`, but its cluster has more than one task; "
                f"name this process's task, as in {_EXAMPLE_TASK}."
            )
        (only,) = jobs  # a one-task cluster: that task is this process
        return only, 0
    if not isinstance(task, dict):
        raise UserError(
            f"`TF_CONFIG` `task` must be a JSON object, not {_show(task)}; "
            f"write it as {_EXAMPLE_TASK}."
        )
    task_type = task.get("type", _MISSING)
    if task_type not in TASK_TYPES:
        raise UserError(
            f"`TF_CONFIG` `task.type` is {_show(task_type)}, not a known task type; "
            f"use one of {_names(TASK_TYPES)}."
        )
    if task_type not in jobs and task_type != "evaluator":
        raise UserError(
            f"`TF_CONFIG` `task.type` is {_show(task_type)} but `cluster` has no such tasks; "
            f"use one of {_names(jobs)}, or add `{task_type}` addresses to `cluster`."
        )
    count = len(jobs.get(task_type, ())) or 1  # an evaluator outside `cluster` is one task
    index = task.get("index", 0 if count == 1 else _MISSING)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise UserError(
            f"`TF_CONFIG` `task.index` is {_show(index)}, but `{task_type}` has {count} "
            f"task{'s' if count > 1 else ''}; use an integer from 0 to {count - 1}."
        )
    return task_type, index


def _names(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON, shortened to keep error messages on one line."""
    text = "missing" if value is _MISSING else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
