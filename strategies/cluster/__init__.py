"""Who a process is in its cluster; the plugins ask, they do not decide.

    tf_config.py   `TF_CONFIG` parsed and checked (`parse`, `ClusterSpec`), the bounded
                   start-up wait for the other members, which members stopped answering
    discovery.py   where a process's cluster comes from (`--cluster`: `TF_CONFIG`, a
                   Slurm step through `slurm.py`, a JobSet pod, SageMaker, one process)
    membership.py  `strategy.membership`: role, chief, agreement, lost members
    preemption.py  SIGTERM: save at one agreed step, exit 143
    tf_start.py    TensorFlow's own join of the cluster, bounded in time
    scratch.py     the scratch space of the members that are not the chief (`ram://`)

Lightning keeps its `ClusterEnvironment` apart from its `Strategy` for the
same reason: distributing a step and knowing the cluster are two concerns. The
plugins at the top of `strategies/` build a `Membership` from what this
package resolves; nothing here imports a plugin.
"""
