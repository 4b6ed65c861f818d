"""The strategy contract on a local cluster, each member run by `trainer.launch`.

    python -m trainer.launch --workers=1 --ps=1 --module=tests.cluster_contract -- \\
        --strategy=parameter_server --model_dir=DIR

The chief runs `tests/test_strategies.py`'s contract tests for the plugin
(`CONTRACT_ON_CLUSTER` names it, so the fixture builds it instead of skipping);
every other member serves, as `python -m trainer` does for it.
"""

import json
import os
import sys

import pytest

CONTRACT_ON_CLUSTER = "TOWERFLOW_CONTRACT_ON_CLUSTER"  # the plugin the chief's contract builds


def main() -> None:
    entry = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--strategy="))
    if entry["type"] != "chief":  # a ps or worker member: serve, as the trainer does
        os.execv(sys.executable, [sys.executable, "-m", "trainer", *sys.argv[1:]])
    os.environ[CONTRACT_ON_CLUSTER] = strategy
    tests = os.path.join(os.path.dirname(__file__), "test_strategies.py")
    sys.exit(
        pytest.main(
            [
                tests,
                "-q",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                "-k",
                f"{strategy} and not on_a_local_cluster",
            ]
        )
    )


if __name__ == "__main__":
    main()
