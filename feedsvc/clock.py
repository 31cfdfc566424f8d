"""Time as feedsvc sees it: one injectable clock for every expiry decision.

Every ttl, delay, claim and idempotency-window check compares a stored
millisecond timestamp with "now", and "now" is always the service host's
clock, passed to the Lua scripts as an argument (see ``storage/base.py``).
Taking it from a :class:`Clock` object instead of ``time`` directly lets a
test move time forward instead of sleeping for it. Redis's own key expiry
(PEXPIREAT) still runs on real time; it is only a safety net, never what
decides whether a message is visible, so a clock that runs ahead of real
time is safe (one that runs behind would let Redis drop keys early).

This module imports nothing of feedsvc's: every layer may use it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The host's wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told to: for tests of expiry logic.

    It starts at the real time (so the deadlines it hands to Redis are never
    in the past) and only moves forward.
    """

    def __init__(self) -> None:
        self._now = SYSTEM_CLOCK.now_ms()

    def now_ms(self) -> int:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a ManualClock only moves forward")
        self._now += round(seconds * 1000)
