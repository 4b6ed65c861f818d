"""Who may train in an elastic job: members, their failures and cool-downs, the group to form.

An elastic job (`cluster.elastic`, `python -m trainer.launch --workers=MIN:MAX`)
has up to MAX *members*, named `member:0` ... `member:MAX-1` for the whole run
(their place in a group's `TF_CONFIG` changes as the group re-forms). A
member that fails is kept out for a cool-down that doubles with each failure
(`cooldown_s`, `2 * cooldown_s`, ...), as Horovod blacklists a failing host;
after `max_restarts` failures it stays out. A group forms from the members
that are ready, at least MIN of them; below MIN the job waits at most
`rendezvous_timeout` seconds, then stops naming who is missing.

No TensorFlow here: the launcher reads it.

>>> roster = Roster(2, 3, max_restarts=1, cooldown_s=5, rendezvous_timeout=30, clock=lambda: 0)
>>> roster.ready()
['member:0', 'member:1', 'member:2']
>>> roster.lost("member:2"); roster.ready()
['member:0', 'member:1']
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

_POLL_S = 0.2
# Set by the launcher for a re-formed group's members (JSON: from, to, why, at): its record.
REFORM_VARIABLE = "TOWERFLOW_ELASTIC_REFORM"


@dataclasses.dataclass
class _Standing:
    """A member's standing in the roster: its failures and when it may join again."""

    name: str
    failures: int = 0
    back_at: float = 0.0  # when its cool-down ends
    out: bool = False  # failed more than `max_restarts` times


class Roster:
    """The members of an elastic job and when each may (re)join.

    Args:
      low: the fewest members a group trains with (`min_workers`).
      high: the most (`max_workers`).
      max_restarts: failures after which a member stays out.
      cooldown_s: the first cool-down after a failure; each next one doubles.
      rendezvous_timeout: seconds to wait below `low` before giving up.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        low: int,
        high: int,
        max_restarts: int,
        cooldown_s: float,
        rendezvous_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.low, self.high = low, high
        self.max_restarts = max_restarts
        self.cooldown_s = cooldown_s
        self.rendezvous_timeout = rendezvous_timeout
        self._clock = clock
        self._members = [_Standing(f"member:{i}") for i in range(high)]

    def ready(self) -> list[str]:
        """The members that may join a group now, in order (the first is the chief)."""
        now = self._clock()
        return [m.name for m in self._members if not m.out and m.back_at <= now]

    def lost(self, name: str) -> str:
        """Records that `name` failed; returns what happens to it, for the launcher's line."""
        member = next(m for m in self._members if m.name == name)
        member.failures += 1
        if member.failures > self.max_restarts:
            member.out = True
            return f"out for good after {member.failures} failures (`max_restarts`)"
        wait_s = self.cooldown_s * 2 ** (member.failures - 1)
        member.back_at = self._clock() + wait_s
        return f"back in {wait_s:g} s (failure {member.failures} of {self.max_restarts + 1})"

    def missing(self) -> list[str]:
        """The members not ready now, each with why: "member:2 (cooling down, 12 s left)"."""
        now = self._clock()
        found = []
        for m in self._members:
            if m.out:
                found.append(f"{m.name} (failed {m.failures} times)")
            elif m.back_at > now:
                found.append(f"{m.name} (cooling down, {m.back_at - now:.0f} s left)")
        return found

    def form(self, stop: Callable[[], bool] = lambda: False) -> list[str] | None:
        """Waits (at most `rendezvous_timeout` s) until `low` members are ready; the group.

        Returns:
          Up to `high` ready members, or None when fewer than `low` were ready
          in time (or `stop()` became true).
        """
        deadline = self._clock() + self.rendezvous_timeout
        while len(ready := self.ready()) < self.low:
            if stop() or self._clock() >= deadline or self._all_out():
                return None
            time.sleep(_POLL_S)
        return ready[: self.high]

    def _all_out(self) -> bool:
        """Whether fewer than `low` members can ever come back."""
        return sum(not m.out for m in self._members) < self.low
