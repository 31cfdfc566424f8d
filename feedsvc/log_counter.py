"""A log line per interval for events that come in floods, each one counted.

A refusal that a busy service gives by the thousand (a follower beyond
``--max-followers``, a write given up after too many WATCH conflicts) must
not write a line each: a thousand lines tell no more than one with a count,
and they drown everything else. :class:`LogCounter` counts every event
(``total``, for a metric), writes the first one after a quiet spell at once
with its detail, and then one line per interval with how many came in it
and the latest detail.

"Per interval" is judged by the service's :class:`~feedsvc.clock.Clock` when
an event comes, so a test moves time on instead of sleeping. A burst that
then stops is still told: a timer on the running loop writes what is
pending one interval after the burst began, and ``close()`` writes the rest.

This module imports nothing of feedsvc's but the clock: every layer may use it.
"""

from __future__ import annotations

import asyncio
import logging

from feedsvc.clock import Clock

#: Seconds between two lines of one counter.
INTERVAL = 10.0


class LogCounter:
    """One kind of event: ``count()`` each; lines read "<verb> <n> <noun> ..."."""

    __slots__ = (
        "_clock",
        "_interval_ms",
        "_last_line_ms",
        "_latest",
        "_log",
        "_noun",
        "_pending",
        "_timer",
        "_verb",
        "total",
    )

    def __init__(
        self,
        log: logging.Logger,
        verb: str,
        noun: str,
        clock: Clock,
        interval: float = INTERVAL,
    ) -> None:
        self._log = log
        self._verb, self._noun = verb, noun
        self._clock = clock
        self._interval_ms = round(interval * 1000)
        self.total = 0  # every event counted, logged or not yet
        self._pending = 0  # counted since the last line
        self._latest = ""
        self._last_line_ms: int | None = None
        self._timer: asyncio.TimerHandle | None = None

    def count(self, detail: str) -> None:
        """One event; detail says which (a request, what went wrong)."""
        self.total += 1
        self._pending += 1
        self._latest = detail
        now = self._clock.now_ms()
        last = self._last_line_ms
        if last is None or now - last >= self._interval_ms:
            self._write(now)
        elif self._timer is None:
            self._tell_later()

    def close(self) -> None:
        """Write what is still untold (the service stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            self._write(self._clock.now_ms())

    def _write(self, now: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        count, self._pending = self._pending, 0
        last, self._last_line_ms = self._last_line_ms, now
        if last is None:
            self._log.warning(
                "%s %d %s (%s); more are counted and logged every %g s",
                self._verb,
                count,
                self._noun,
                self._latest,
                self._interval_ms / 1000,
            )
        else:
            self._log.warning(
                "%s %d %s in the last %g s (latest: %s)",
                self._verb,
                count,
                self._noun,
                round((now - last) / 1000, 1),
                self._latest,
            )

    def _tell_later(self) -> None:
        """Make sure what is pending is told even if nothing more comes."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test): told with a later event or at close
            return
        self._timer = loop.call_later(self._interval_ms / 1000, self._told_late)

    def _told_late(self) -> None:
        self._timer = None
        if self._pending:
            self._write(self._clock.now_ms())
