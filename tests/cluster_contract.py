"""The strategy contract on a local cluster, each member run by `trainer.launch`, or in one process.

    python -m trainer.launch --workers=1 --ps=1 --module=tests.cluster_contract -- \\
        --strategy=parameter_server --model_dir=DIR
    python -m tests.cluster_contract --strategy=parameter_server

The chief runs `tests/test_strategies.py`'s contract tests for the plugin
(`CONTRACT_ON_CLUSTER` names it, so the fixture builds it instead of skipping);
every other member serves, as `python -m trainer` does for it. Without
`TF_CONFIG` (the second command) the process is the chief of a cluster whose
worker and ps are servers in the same process, on 127.0.0.1: the plugin meets
them over gRPC as it would other processes, for the CPU of one process.
"""

import json
import os
import socket
import sys

import pytest

CONTRACT_ON_CLUSTER = "TOWERFLOW_CONTRACT_ON_CLUSTER"  # the plugin the chief's contract builds


def _serve_the_other_members() -> list:
    """A worker and a ps served in this process; `TF_CONFIG` makes this process their chief."""
    import tensorflow as tf

    from strategies import devices
    from strategies.cluster import tf_config
    from tests.helpers import LOGICAL_CPUS

    devices.configure(logical_cpus=LOGICAL_CPUS)  # before a server starts the runtime
    addresses = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addresses.append(f"127.0.0.1:{s.getsockname()[1]}")
    cluster = {"chief": addresses[:1], "worker": addresses[1:2], "ps": addresses[2:]}
    # As many inter-op threads as a served member has (`Membership.serve`).
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    servers = [
        tf.distribute.Server(tf.train.ClusterSpec(cluster), job, 0, config=config)
        for job in ("worker", "ps")
    ]
    os.environ["TF_CONFIG"] = tf_config.make_tf_config(cluster, "chief", 0)
    return servers


def main() -> None:
    # Held while the contract runs: the servers serve as long as they are referenced.
    servers = [] if "TF_CONFIG" in os.environ else _serve_the_other_members()
    entry = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--strategy="))
    if entry["type"] != "chief":  # a ps or worker member: serve, as the trainer does
        os.execv(sys.executable, [sys.executable, "-m", "trainer", *sys.argv[1:]])
    os.environ[CONTRACT_ON_CLUSTER] = strategy
    tests = os.path.join(os.path.dirname(__file__), "test_strategies.py")
    chosen = f"{strategy} and not on_a_local_cluster"
    code = pytest.main([tests, "-q", "-n", "0", "-p", "no:cacheprovider", "-k", chosen])
    del servers  # after the contract ran
    sys.exit(code)


if __name__ == "__main__":
    main()
