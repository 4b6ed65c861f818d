"""Multi-replica strategies on 2 of the test process's 4 logical CPUs.

Where a test needs replicas that split the batch and meet in a reduction, but
not 4 of them, 2 replicas run the same code for about half the tracing.
"""

from __future__ import annotations

# The strategies whose replicas are one per device of `strategy.NAME.devices`.
_ON_DEVICES = ("mirrored", "central_storage")
TWO_CPUS = "/cpu:0,/cpu:1"


def on_two_cpus(strategy: str) -> dict[str, str]:
    """Config overrides ("a.b": value) running `strategy`, with 2 replicas where it has several."""
    devices = {f"strategy.{strategy}.devices": TWO_CPUS} if strategy in _ON_DEVICES else {}
    return {"strategy.name": strategy, **devices}
