"""Expiry in the segment layout (issue 30, docs/design.md "Expiry"): when a
segment is looked at again, and which queues have a look due.

A segment whose messages all expire together goes by Redis's own expiry
(its PEXPIREAT is its latest message's). Every segment also has a *review*
(``Q:sx``: segment -> when, ms), the time the sweep (``sweep.lua``, one
segment per call, ≤ 100 records) looks at it: it keeps the live records
(slots kept, so every seq stays where it was), drops the expired and the
deleted ones, counts what it dropped (the queue hash's ``gone``) and sets
the next review. The rules, all in ``_lib.lua`` with these numbers:

* a segment opened, or given a message that expires before every one it
  holds: a review at that expiry + :data:`REVIEW_AFTER_MS` (the queue hash's
  :data:`REVIEW_FROM` keeps the open segment's earliest, so a post knows);
* a review that leaves survivors: if their expiries spread over at most
  :data:`SPREAD_MS`, the next one is at their latest (Redis drops the
  segment then; the review only counts it), else at their earliest +
  :data:`REVIEW_AFTER_MS`. It rewrites the segment only if the survivors
  outlive it by more than :data:`REVIEW_AFTER_MS`: otherwise Redis drops
  the whole string soon anyway;
* a message deleted (popped, dead-lettered): a review within
  :data:`DELETE_REVIEW_MS` (``segment_gone`` in ``_lib.lua``, and
  ``segment_claims.forget_commands`` for the watch drivers and the process).

So every expired record is gone within about a minute of its expiry (60 s
past the earliest of a review's records, less for the rest), whatever the
ttls around it, and every record not yet counted gone that has expired is
in a segment whose review is at most :data:`SPREAD_MS` ahead: the stats
count those exactly (``sweep.lua``, up to :data:`COUNT_SEGMENTS` of them).

``Q:sn`` (segment -> count) lets a review count what Redis dropped whole:
a segment's messages not yet counted gone are its entry plus the seqs of
its range given out so far (the open segment's entry starts at minus the
seqs of its range given out before it opened; deletes subtract one; a
review sets it to its survivors less those seqs).

Queues with a review due are found through :data:`~feedsvc.storage.keys.SWEEP_KEY`
(``fs:sweep``: "<kind> <project> <queue>" -> when its first review is due),
one key written only outside the queue scripts (``sweep_schedule.py``):
a script that schedules a review says when in its reply, and the process
notes it there; the sweep loop of every process (``sweeper.py``) runs the
due ones, so an idle queue's memory comes back without traffic.
"""

from __future__ import annotations

from typing import Final

from feedsvc.storage.keys import Kind

REVIEW_AFTER_MS: Final = 30_000
SPREAD_MS: Final = 60_000
DELETE_REVIEW_MS: Final = 60_000
#: the queue hash's field: the earliest expiry in its open segment (ms)
REVIEW_FROM: Final = "tmin"
#: stats: reviews a stats call runs first, then segments it counts the
#: expired records of without rewriting them (beyond those, an expired
#: record not yet swept counts as live until its review: docs/api.md)
STATS_REVIEWS: Final = 8
COUNT_SEGMENTS: Final = 32


def lua_names() -> dict[str, str]:
    """The Lua names of the review rules (segments.lua_names adds them)."""
    return {
        "SEG_REVIEW_AFTER_MS": str(REVIEW_AFTER_MS),
        "SEG_SPREAD_MS": str(SPREAD_MS),
        "SEG_DELETE_REVIEW_MS": str(DELETE_REVIEW_MS),
        "SEG_COUNT_SEGMENTS": str(COUNT_SEGMENTS),
        "F_REVIEW_FROM": repr(REVIEW_FROM),
    }


def sweep_member(kind: Kind, project: str, queue: str) -> str:
    """A queue's member of fs:sweep (queue names hold no space)."""
    return f"{kind} {project} {queue}"


def parse_member(member: bytes | str) -> tuple[Kind, str, str]:
    text = member.decode() if isinstance(member, bytes) else member
    kind, rest = text.split(" ", 1)
    project, queue = rest.rsplit(" ", 1)
    return ("topic" if kind == "topic" else "queue"), project, queue
