"""The consumption checker: what the consumers did with this run's messages,
judged once the run is over (at-least-once, group order, one claim per group).

Pure logic, no Locust and no I/O, so that it can be unit-tested on synthetic
events. The locustfile feeds it, from one Locust process: every message a
producer posted (acknowledged or of unknown outcome), every claim a consumer
got (the time it sent the request, the time the answer arrived, the claim's
ttl), every delete and release of a message (sent, answered, status), and
every release of a whole claim. After the final drain (the locustfile claims
and deletes what is left) ``finish`` returns the findings.

What the producers promise
--------------------------
A message is named by its stamp (checker.py): queue, producer stream, seq.
A grouped message's stamp also carries its group and its *group seq*: a
Locust process posts to each of its groups one request at a time (a lock
per queue and group), so group seq j < k means j's 201 had arrived before k
was sent: j is before k in the group's post order. A post of unknown
outcome (no 201) is left out of every judgement: it may be stored, late.

What feedsvc promises (issue 32 point 4, docs/consumers.md)
-----------------------------------------------------------
Every acknowledged message stays until someone deletes it (ttl aside); at
most one claim at a time holds messages of a group, and it holds a prefix of
the group's live messages, taken in post order. Timestamps bound what the
service did: a claim ran between its request being sent and its answer
arriving, a delete between sent and answered.

* **unacknowledged**: an acknowledged post that no delete answered 204, by
  the end of the drain. A delete that got no answer (timeout, 5xx) may have
  removed it: excused, counted as ``excused_unanswered``.
* **ack order**: group seq k was surely deleted (its first 204 had
  arrived) before an earlier message j of its group could have been (no
  delete of j had been sent yet). Either k was claimed while j was live
  and not in the same claim, or the consumer got the claim's messages of
  the group out of order; both break the group's order.
* **handed early**: k was claimed (the answer had arrived) while its
  predecessor in the group (the nearest earlier acknowledged one) was
  surely still there (no delete of it sent yet), and that claim did not
  also hold the predecessor: the claimed messages were not a prefix.
* **group shared**: two claims surely held messages of one group at the
  same moment: each from its claim's answer arriving until the request that
  ended the hold was sent (the delete or release of the message, a release
  of an earlier message of the group in the same claim, or the release of
  the whole claim), and never past the claim's request time plus its ttl
  (when it may have expired). An end whose request failed ends the
  certainty at the claim's answer.

Each check asserts only what the timestamps prove, so it can miss a
violation that happened within a request's round trip but never accuses a
correct service.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from loadtest.checker import Stamp

UNACKNOWLEDGED: Final = "unacknowledged"
ACK_ORDER: Final = "ack order"
HANDED_EARLY: Final = "handed early"
GROUP_SHARED: Final = "group shared"

MessageKey = tuple[str, str, int]  # queue, producer stream, seq


def answered(status: int) -> bool:
    """Whether a status says what the request did (no answer, or a 5xx, may
    hide a request that did its work)."""
    return 0 < status < 500


@dataclass(frozen=True, slots=True)
class ConsumptionFinding:
    kind: str
    queue: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: queue {self.queue} {self.detail}"


@dataclass(slots=True)
class _Delivery:
    """One claim's hold on one message."""

    claim: str
    received: float  # the claim's answer arrived
    expires: float  # the claim's request was sent + its ttl: it held at least until then
    held_until: float | None = None  # the request that ended the hold was sent

    def sure_end(self) -> float:
        end = self.expires if self.held_until is None else self.held_until
        return min(end, self.expires)


@dataclass(slots=True)
class _Message:
    stamp: Stamp
    acknowledged: bool  # the post got its 201
    deliveries: list[_Delivery] = field(default_factory=list)
    first_deleted: float | None = None  # a 204 to a delete arrived (surely gone by then)
    first_delete_sent: float | None = None  # a delete that may have removed it was sent
    unanswered_deletes: int = 0


@dataclass(slots=True)
class ConsumptionChecker:
    """Takes the events of one Locust process's producers and consumers."""

    acknowledged: int = 0
    deletes: int = 0
    releases: int = 0
    redelivered: int = 0
    excused_unanswered: int = 0
    #: claim requests that got no answer (stopped, timed out, 5xx): they may
    #: hold messages nobody knows of until they expire
    unanswered_claims: int = 0
    findings: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    _messages: dict[MessageKey, _Message] = field(default_factory=dict)
    _unreleased: set[str] = field(default_factory=set)
    _open: dict[tuple[str, MessageKey], _Delivery] = field(default_factory=dict)
    _claims_in_flight: int = 0
    _pending: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def posting(self, queue: str, stamp: Stamp) -> None:
        """A producer is about to send this message (a consumer may claim and
        delete it before the producer has read its 201)."""
        self._messages[(queue, stamp.producer, stamp.seq)] = _Message(stamp, False)

    def posted(self, queue: str, stamp: Stamp, acknowledged: bool) -> None:
        """The post of a message sent (``posting``) got its 201, or not."""
        message = self._messages[(queue, stamp.producer, stamp.seq)]
        message.acknowledged = acknowledged
        if acknowledged:
            self.acknowledged += 1
            if message.first_deleted is None:
                self._pending[queue] += 1

    def pending(self, queue: str) -> int:
        """Acknowledged messages of ``queue`` that no delete has answered 204 yet."""
        return self._pending[queue]

    def claim_requested(self) -> None:
        """A claim request is about to be sent (see ``claim_answered``)."""
        self._claims_in_flight += 1

    def claim_answered(self, status: int) -> None:
        """A claim request's answer (0: none); call before ``claimed``."""
        self._claims_in_flight -= 1
        if not answered(status):
            self.unanswered_claims += 1

    def claims_maybe_holding(self) -> int:
        """Claim requests that may hold messages unknown to this checker until
        they expire: unanswered, or still on their way (their consumer was
        stopped)."""
        return self.unanswered_claims + self._claims_in_flight

    def claimed(
        self, queue: str, claim: str, stamps: Iterable[Stamp], sent: float, received: float,
        ttl: float,
    ) -> None:  # fmt: skip
        """A claim's answer: the stamps of the messages of this run it holds."""
        self._unreleased.add(claim)
        for stamp in stamps:
            key = (queue, stamp.producer, stamp.seq)
            message = self._messages.get(key)
            if message is None:  # posted by another process
                continue
            if message.deliveries:
                self.redelivered += 1
            delivery = _Delivery(claim, received, sent + ttl)
            message.deliveries.append(delivery)
            self._open[(claim, key)] = delivery

    def deleted(
        self, queue: str, claim: str, stamp: Stamp, sent: float, received: float, status: int
    ) -> None:
        """A delete of a claimed message through its href, and its answer."""
        key = (queue, stamp.producer, stamp.seq)
        self._end(claim, key, sent, status == 204)
        message = self._messages.get(key)
        if message is None:
            return
        self.deletes += 1
        removed_maybe = status == 204 or not answered(status)
        if removed_maybe and (
            message.first_delete_sent is None or sent < message.first_delete_sent
        ):
            message.first_delete_sent = sent
        if status == 204 and message.first_deleted is None:
            if message.acknowledged:
                self._pending[queue] -= 1
            message.first_deleted = received
        elif not answered(status):
            message.unanswered_deletes += 1

    def released(self, queue: str, claim: str, stamp: Stamp, sent: float, status: int) -> None:
        """A release of a message (asked for, or implied by the release of an
        earlier message of its group in the same claim)."""
        key = (queue, stamp.producer, stamp.seq)
        self._end(claim, key, sent, status == 204)
        if key in self._messages:
            self.releases += 1

    def claim_released(self, claim: str, sent: float, status: int) -> None:
        """The whole claim was released (``DELETE`` on its Location)."""
        self._unreleased.discard(claim)
        for owner, key in list(self._open):
            if owner == claim:
                self._end(claim, key, sent, status == 204)

    def unreleased_claims(self) -> set[str]:
        """Claims whose consumer did not release them (it was stopped): the
        drain releases them so that their messages can be claimed again."""
        return set(self._unreleased)

    def _end(self, claim: str, key: MessageKey, sent: float, done: bool) -> None:
        delivery = self._open.pop((claim, key), None)
        if delivery is not None:
            # a failed end proves nothing past the claim's answer
            delivery.held_until = sent if done else delivery.received

    def finish(self) -> list[ConsumptionFinding]:
        """All findings, once the drain is over."""
        found = self._unacknowledged()
        groups: dict[tuple[str, str], list[_Message]] = defaultdict(list)
        for (queue, _, _), message in self._messages.items():
            if message.stamp.group and message.acknowledged:
                groups[(queue, message.stamp.group)].append(message)
        for (queue, group), messages in sorted(groups.items()):
            messages.sort(key=lambda m: m.stamp.group_seq)
            found += self._ack_order(queue, group, messages)
            found += self._handed_early(queue, group, messages)
            found += self._shared(queue, group, messages)
        self.findings += len(found)
        for finding in found:
            self.by_kind[finding.kind] = self.by_kind.get(finding.kind, 0) + 1
        return found

    def _unacknowledged(self) -> list[ConsumptionFinding]:
        lost: dict[tuple[str, str], list[int]] = defaultdict(list)
        for (queue, producer, seq), message in self._messages.items():
            if not message.acknowledged or message.first_deleted is not None:
                continue
            if message.unanswered_deletes:
                self.excused_unanswered += 1
            else:
                lost[(queue, producer)].append(seq)
        found = []
        for (queue, producer), seqs in sorted(lost.items()):
            for first, last in _runs(sorted(seqs)):
                seqs_text = str(first) if first == last else f"{first}..{last}"
                detail = f"producer {producer} seq {seqs_text}: acknowledged, never deleted"
                found.append(ConsumptionFinding(UNACKNOWLEDGED, queue, detail))
        return found

    @staticmethod
    def _ack_order(queue: str, group: str, messages: list[_Message]) -> list[ConsumptionFinding]:
        found = []
        latest: _Message | None = None  # the earlier message whose removal began latest
        for message in messages:
            if (
                latest is not None
                and latest.first_delete_sent is not None
                and message.first_deleted is not None
                and message.first_deleted < latest.first_delete_sent
            ):
                detail = (
                    f"group {group}: group seq {message.stamp.group_seq} was deleted before "
                    f"the delete of group seq {latest.stamp.group_seq} was sent"
                )
                found.append(ConsumptionFinding(ACK_ORDER, queue, detail))
            start = message.first_delete_sent
            if start is not None and (
                latest is None
                or latest.first_delete_sent is None
                or start > latest.first_delete_sent
            ):
                latest = message
        return found

    @staticmethod
    def _handed_early(queue: str, group: str, messages: list[_Message]) -> list[ConsumptionFinding]:
        found = []
        for before, message in itertools.pairwise(messages):
            gone = before.first_delete_sent
            if gone is None:  # never removed: expired, or lost (reported as such)
                continue
            with_before = {d.claim for d in before.deliveries}
            for delivery in message.deliveries:
                if delivery.received < gone and delivery.claim not in with_before:
                    detail = (
                        f"group {group}: claim {delivery.claim} got group seq "
                        f"{message.stamp.group_seq} while group seq {before.stamp.group_seq} "
                        "was still there and not in that claim"
                    )
                    found.append(ConsumptionFinding(HANDED_EARLY, queue, detail))
        return found

    @staticmethod
    def _shared(queue: str, group: str, messages: list[_Message]) -> list[ConsumptionFinding]:
        holds = sorted(
            (d.received, d.sure_end(), d.claim)
            for m in messages
            for d in m.deliveries
            if d.sure_end() > d.received
        )
        found = []
        # the two latest-ending holds so far, of two different claims
        best: tuple[float, str] | None = None
        second: tuple[float, str] | None = None
        for start, end, claim in holds:
            other = second if best is not None and best[1] == claim else best
            if other is not None and start < other[0]:
                detail = f"group {group}: claims {other[1]} and {claim} held it at once"
                found.append(ConsumptionFinding(GROUP_SHARED, queue, detail))
            if best is None or end > best[0]:
                if best is not None and best[1] != claim:
                    second = best
                best = (end, claim)
            elif claim != best[1] and (second is None or end > second[0]):
                second = (end, claim)
        return found


def _runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted seqs, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for seq in seqs:
        if runs and runs[-1][1] == seq - 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return runs
