"""The no-miss checker: what one reader saw of one queue, judged message by message.

Pure logic, no Locust and no I/O, so that it can be unit-tested on synthetic
input. The locustfile's producers stamp every message body with a
:class:`Stamp`, and each observer feeds the stamps it reads, in the order it
reads them, to one :class:`FeedChecker` per queue.

What a stamp promises
---------------------
A *stream* is one producer's messages to one queue: ``producer`` names it,
``seq`` counts 1, 2, 3, ... and ``started`` is the wall-clock second at which
the stream began (before seq 1 was sent). A producer sends one request at a
time and starts a new stream (a new ``producer`` name, seq back to 1) after
any request that did not get a 201, so within a stream seq n was stored (its
201 had arrived, or it was earlier in the same atomically indexed batch)
before seq n+1 was sent. A stamp may also carry a ``group`` and the
message's ``group_seq`` in it, which only the consumption checker
(consumption.py) reads.

What feedsvc promises (docs/design.md, rule 1): a reader following ``next``
links sees every live message posted after its marker exactly once, in post
order. Observers start at the head of the queue (no marker), so for every
stream a reader must see 1, 2, 3, ... with nothing skipped, repeated or out
of order. Hence:

* **gap**: seq m follows seq k (or is the first seen, k = 0) with m > k+1.
  Seqs k+1..m-1 were all acknowledged before m was sent, and the reader has
  read past their place for good (the index is in post order, and a reader
  never goes back), so they were skipped. Excused only when they may
  legitimately be gone: they may have *expired* (the stream began more than
  one ttl ago, so the oldest of them could be past its ttl; a reader that lags
  by less than the ttl never needs this), or a consumer *deleted* them (the
  ``consumed`` callback says so for every one of them).
* **duplicate**: a seq seen before is seen again.
* **reorder**: a seq lower than one already seen shows up late (it was
  skipped when the reader passed its place, which the gap already reported).

Deleted and expired messages can only make messages disappear, never repeat
or reorder them, so duplicates and reorders are never excused.

Only this run's streams are judged: a stamp carries ``run``, the id of the
Locust run that posted it, and a checker given a run ignores the others'
stamps (counting them in ``other_runs``). A queue may still hold an earlier
run's messages (the same ``--queue-prefix``, a Redis volume kept across
``down`` / ``up``), with heads its consumers deleted: this run cannot know
what happened to them, so it says nothing about them.

A reader that has read a whole queue after the producers stopped (the
comparison runner's audit) can also be asked for what it never saw:

* **lost**: a stream's acknowledged messages after the last one seen (a gap
  can only be seen below a later message; this is the tail).

A live follower stopped at any moment can be asked the same about what it
must have seen by then, across streams: a stamp may carry ``posted``, the
wall-clock time its POST was sent. A message acknowledged (201 received)
before another message was even sent lies before it in the queue, so a
reader that saw the later one has passed the earlier one's place: if it
never saw it, that is **lost** too (``missed``). This needs each stream's
acknowledgement times, which only the producers' own process knows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

GAP: Final = "gap"
DUPLICATE: Final = "duplicate"
REORDER: Final = "reorder"
LOST: Final = "lost"

#: Seconds of clock slack when deciding whether a message may have expired.
EXPIRY_SLACK: Final = 1.0


@dataclass(frozen=True, slots=True)
class Stamp:
    """The part of a message body the checker reads."""

    producer: str
    seq: int
    started: float
    posted: float | None = None  # wall-clock time its POST was sent
    run: str = ""  # the Locust run that posted it ("" before runs were told apart)
    group: str = ""  # the message's group ("" for none)
    group_seq: int = 0  # its place in the group, 1, 2, 3, ... (consumption.py)

    def body(self, pad: str = "") -> dict[str, Any]:
        """The message body that carries this stamp (``pad`` sets its size)."""
        body: dict[str, Any] = {"p": self.producer, "s": self.seq, "t": self.started}
        if self.posted is not None:
            body["w"] = self.posted
        if self.run:
            body["r"] = self.run
        if self.group:
            body["g"], body["k"] = self.group, self.group_seq
        body["x"] = pad
        return body


def read_stamp(body: object) -> Stamp | None:
    """The stamp of a message body, or None for a body a producer did not stamp."""
    if not isinstance(body, dict):
        return None
    producer, seq, started = body.get("p"), body.get("s"), body.get("t")
    if (
        not isinstance(producer, str)
        or not isinstance(seq, int)
        or isinstance(seq, bool)
        or not isinstance(started, int | float)
    ):
        return None
    posted = body.get("w")
    if not isinstance(posted, int | float) or isinstance(posted, bool):
        posted = None
    run, group, group_seq = body.get("r"), body.get("g"), body.get("k")
    if not isinstance(group, str) or not isinstance(group_seq, int) or isinstance(group_seq, bool):
        group, group_seq = "", 0
    return Stamp(
        producer,
        seq,
        float(started),
        None if posted is None else float(posted),
        run if isinstance(run, str) else "",
        group,
        group_seq,
    )


@dataclass(frozen=True, slots=True)
class Finding:
    """One failure: ``kind`` is GAP, DUPLICATE or REORDER; seqs ``first..last``."""

    kind: str
    queue: str
    producer: str
    first: int
    last: int

    def __str__(self) -> str:
        seqs = str(self.first) if self.first == self.last else f"{self.first}..{self.last}"
        what = {
            GAP: "acknowledged message(s) skipped",
            DUPLICATE: "message seen twice",
            REORDER: "message seen after a later one of its producer",
            LOST: "acknowledged message(s) never seen",
        }[self.kind]
        return f"{what}: queue {self.queue} producer {self.producer} seq {seqs}"


def _never(queue: str, producer: str, seq: int) -> bool:
    return False


@dataclass(slots=True)
class _Stream:
    last: int = 0
    # Ranges skipped (reported or excused), kept to tell a reorder from a duplicate.
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def take_skipped(self, seq: int) -> bool:
        for i, (lo, hi) in enumerate(self.skipped):
            if lo <= seq <= hi:
                parts = [(lo, seq - 1), (seq + 1, hi)]
                self.skipped[i : i + 1] = [(a, b) for a, b in parts if a <= b]
                return True
        return False


@dataclass(slots=True)
class FeedChecker:
    """Judges one reader's view of one queue, read from the head.

    ``consumed(queue, producer, seq)`` tells whether a consumer deleted (or
    tried to delete) that message; it is asked only about skipped seqs.
    With ``run``, stamps of other runs are passed over (``other_runs``).
    """

    queue: str
    consumed: Callable[[str, str, int], bool] = _never
    run: str | None = None
    checked: int = 0
    other_runs: int = 0
    excused_expired: int = 0
    excused_consumed: int = 0
    findings: int = 0
    #: the latest ``posted`` time among the stamps seen
    latest_posted: float | None = None
    _streams: dict[str, _Stream] = field(default_factory=dict)

    def see(self, stamp: Stamp, ttl: float, now: float) -> Finding | None:
        """Take the next message read (``ttl`` in seconds, ``now`` wall clock)."""
        if self.run is not None and stamp.run != self.run:
            self.other_runs += 1
            return None
        self.checked += 1
        if stamp.posted is not None and (
            self.latest_posted is None or stamp.posted > self.latest_posted
        ):
            self.latest_posted = stamp.posted
        stream = self._streams.get(stamp.producer)
        if stream is None:
            stream = self._streams[stamp.producer] = _Stream()
        seq = stamp.seq
        found: Finding | None = None
        if seq > stream.last:
            if seq > stream.last + 1:
                first, last = stream.last + 1, seq - 1
                stream.skipped.append((first, last))
                if now >= stamp.started + ttl - EXPIRY_SLACK:
                    self.excused_expired += last - first + 1
                elif all(self.consumed(self.queue, stamp.producer, s) for s in range(first, seq)):
                    self.excused_consumed += last - first + 1
                else:
                    found = Finding(GAP, self.queue, stamp.producer, first, last)
            stream.last = seq
        elif stream.take_skipped(seq):
            found = Finding(REORDER, self.queue, stamp.producer, seq, seq)
        else:
            found = Finding(DUPLICATE, self.queue, stamp.producer, seq, seq)
        if found is not None:
            self.findings += 1
        return found

    def lost(self, acknowledged: Mapping[str, int]) -> list[Finding]:
        """Findings for acknowledged messages never seen: ``acknowledged`` maps
        each stream to its last acknowledged seq. Only meaningful once the
        reader has read the queue to its end after the producers stopped."""
        found = []
        for producer, last in acknowledged.items():
            stream = self._streams.get(producer)
            seen = 0 if stream is None else stream.last
            if last > seen:
                found.append(Finding(LOST, self.queue, producer, seen + 1, last))
        self.findings += len(found)
        return found

    def missed(self, acks: Mapping[str, Sequence[tuple[float, int]]]) -> list[Finding]:
        """Findings for messages this reader must have seen by now and did not:
        ``acks`` maps each stream to its ``(time the 201 arrived, last seq it
        acknowledged)`` in order. Everything acknowledged before the latest
        ``posted`` time seen lies before that message in the queue. Messages a
        consumer deleted are excused, as in ``see``."""
        if self.latest_posted is None:
            return []
        found = []
        for producer, log in acks.items():
            index = bisect.bisect_left(log, (self.latest_posted, -1))
            if index == 0:
                continue
            required = log[index - 1][1]
            stream = self._streams.get(producer)
            seen = 0 if stream is None else stream.last
            unseen = [
                s
                for s in range(seen + 1, required + 1)
                if not self.consumed(self.queue, producer, s)
            ]
            if unseen:
                found.append(Finding(LOST, self.queue, producer, unseen[0], unseen[-1]))
        self.findings += len(found)
        return found
