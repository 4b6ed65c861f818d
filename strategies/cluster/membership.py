"""Cluster membership: who this process is in its cluster, and whether everyone is still there.

A strategy plugin says how a step is distributed; *membership* says which
part of the job this process plays and how the processes of a cluster stay
together, as Lightning keeps its `ClusterEnvironment` apart from its
`Strategy`. It is built from the resolved cluster (`strategies.cluster.discovery`
sets it as `TF_CONFIG`, `strategies.cluster` parses it) and reached as
`strategy.membership`; the loop asks it, never the strategy.

Glossary:

- *role*: what this process does. "train" runs the loop; "serve" runs a
  server for others (the ps and worker members of a parameter-server cluster);
  "evaluate" evaluates checkpoints as they appear (a sidecar evaluator). A
  role follows from the member's *type* (`TF_CONFIG`'s task type: "chief",
  "worker", "ps", "evaluator") and the strategy.
- *chief*: the member that writes checkpoints, summaries and exports: the
  `chief` member, or worker 0 when there is none.
- *lost member*: another member of the cluster whose server no longer answers.
- *agree*: one member's value on every member, for choices that must not differ
  between workers that step together (a measured loop length); *everyone*:
  whether a condition holds on every one of them (their input is ready).
- *restored step*: every worker must resume from the same checkpoint step.

One process (no cluster) trains, is the chief, loses no one, and agrees with
itself (run by `tests/test_membership.py`):

>>> alone = Membership()
>>> alone.role, alone.is_chief, alone.lost_members(), alone.agree(7)
('train', True, [], 7)

A plugin whose workers run collectives gives its membership the one
capability that needs them, `gather` (every replica's value of an int, in
replica order, the chief's first), explicitly; nothing here reaches back into
the plugin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

from strategies.cluster import preemption
from strategies.cluster import tf_config as cluster_lib
from towerflow import renamed
from towerflow.errors import MemberLost, UserError

SERVER_STARTUP_S = 600.0  # how long a serving member waits for the chief to come up
Gather = Callable[[int], list[int]]  # value -> every replica's value, the chief's first
Watch = Callable[[], contextlib.AbstractContextManager]


class Membership:
    """This process's part in its cluster (or alone), and the health of the others.

    Args:
      cluster: the parsed `TF_CONFIG` (`cluster.ClusterSpec`); None for one process.
      serving_types: the member types (`TF_CONFIG`'s task types) that serve the others
        (role "serve") instead of running the loop, e.g. `("ps", "worker")` under
        `parameter_server`.
      gather: every replica's value of an int (one collective), for `agree` and
        `check_restored` where workers step together; None: each member alone.
      watch: makes the preemption watch (`watch_preemption`); None: this
        process's own SIGTERM (`preemption.SignalWatch`).
      serving_jobs: the old name of `serving_types`, accepted with a
        `DeprecationWarning` until towerflow 0.3.
    """

    def __init__(
        self,
        cluster: cluster_lib.ClusterSpec | None = None,
        serving_types: Collection[str] = (),
        gather: Gather | None = None,
        watch: Watch | None = None,
        *,
        serving_jobs: Collection[str] | None = None,
    ):
        if serving_jobs is not None:
            renamed.warn("Membership(serving_jobs=)", "Membership(serving_types=)")
            serving_types = serving_jobs
        self.cluster = cluster
        self._serving_types = tuple(serving_types)
        self._gather = gather
        self._watch = watch or preemption.SignalWatch

    @property
    def role(self) -> str:
        """What this member does: "train", "serve" (a server for others) or "evaluate".

        Every member of a cluster runs the same program; the role says which part.
        A "serve" member calls `serve()`, an "evaluate" member evaluates checkpoints
        as they appear (sidecar evaluation), and "train" members run the loop.
        """
        member_type = self.cluster.task_type if self.cluster else None
        if member_type == "evaluator":
            return "evaluate"
        return "serve" if member_type in self._serving_types else "train"

    @property
    def is_chief(self) -> bool:
        """Whether this member writes checkpoints, summaries and exports."""
        return self.cluster.is_chief if self.cluster else True

    @property
    def evaluates_inline(self) -> bool:
        """Whether the training members evaluate (False when a sidecar evaluator does)."""
        return not (self.cluster and self.cluster.has_evaluator)

    def serve(self) -> None:
        """Runs this member's server until the chief is gone (for role "serve").

        Raises:
          MemberLost: the chief did not come up within `SERVER_STARTUP_S`.
        """
        if self.role != "serve":
            raise NotImplementedError(f"a {self.role!r} member has no server to run.")
        import tensorflow as tf

        from strategies import tf_patches

        config = tf.compat.v1.ConfigProto(
            # Fewer inter-op threads than workers + 1 deadlock a worker or ps under load.
            inter_op_parallelism_threads=max(4, self.cluster.num_workers + 2)
        )
        # For as long as it serves: it opens its channels to the other members while it does.
        with tf_patches.grpc_reconnects_quickly():
            server = tf.distribute.Server(
                tf.train.ClusterSpec(self.cluster.as_dict()),
                job_name=self.cluster.task_type,
                task_index=self.cluster.task_index,
                protocol=self.cluster.rpc_layer,
                config=config,
                start=True,
            )
            chief = self.cluster.addresses["chief"][0]
            if not cluster_lib.wait_until_gone(chief, startup_s=SERVER_STARTUP_S):
                raise MemberLost(
                    f"the chief at {chief} did not come up within {SERVER_STARTUP_S:g} s; "
                    "start it with the same `TF_CONFIG` cluster."
                )
        del server  # the process ends, and the server with it

    def lost_members(self) -> list[str]:
        """The other members of this cluster that no longer answer, e.g. "ps:0 (host:port)".

        Empty for a single process. Asked after a step fails, to say which
        member to blame, and by the loop's watchdog while a step takes long.
        """
        return self.cluster.unreachable() if self.cluster else []

    def agree(self, value: int) -> int:
        """The chief's `value` on every member: for choices (loop lengths) that must not differ."""
        return self._gather(value)[0] if self._gather else value

    def everyone(self, flag: bool) -> bool:
        """Whether `flag` holds on every member that steps together (one collective).

        Every such member must ask at the same point, as for `agree`: e.g. whether
        each one's input is ready for the next block (`data.follow`).
        """
        return all(self._gather(int(flag))) if self._gather else flag

    def watch_preemption(self) -> contextlib.AbstractContextManager:
        """A watch for SIGTERM, as a context manager around the training loop.

        The loop calls its `check(save)` after every loop (on every member); it
        saves and raises `preemption.Preempted` once the job is to stop. One
        process watches its own signal; workers that step together agree on
        the step (`preemption.CoordinatedWatch`).
        """
        return self._watch()

    def check_restored(self, step: int, model_dir: str) -> None:
        """Checks that every training worker restored the same `step` from `model_dir`.

        A no-op where each member restores alone. Where workers step together,
        each puts its step in one collective and all compare.

        Raises:
          UserError: the workers restored different steps (`model_dir` is not shared).
        """
        if self._gather is None or self.role != "train":
            return
        steps = self._gather(step)
        if len(set(steps)) == 1:
            return
        # Replicas are numbered worker by worker, in TensorFlow's order: the chief first.
        jobs = self.cluster.as_dict()
        names = ["chief"] * len(jobs.get("chief", ())) + [
            f"worker:{index}" for index in range(len(jobs.get("worker", ())))
        ]
        per_worker = len(steps) // len(names)
        found = ", ".join(f"{name} step {steps[i * per_worker]}" for i, name in enumerate(names))
        raise UserError(
            f"the workers restored different steps from `model_dir` {model_dir} ({found}): "
            "it is not shared between them; give every worker the same `--model_dir` on a "
            "file system they all see (NFS, GCS), or start from an empty one."
        )
