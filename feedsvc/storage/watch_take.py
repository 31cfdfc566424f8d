"""The watch drivers' claims and pops: the free messages at a queue's head,
found without WATCH by claim_scan.Scan (the older layout's index, then the
segments from their claim head; in a queue with ordered groups, the index
below ``gs``, the segments below it, then the claim index), each message
looked up by id in either layout (_lib.lua's read_message), then taken in a
transaction that reads them again under WATCH."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from feedsvc.clock import Clock
from feedsvc.storage import groups, segment_claims
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import Unclaimable
from feedsvc.storage.claim_scan import Found, Judge, Reader, Scan, Verdict, Walker
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.optimistic import Conflicted, Plan
from feedsvc.storage.sealing import BodyOpener, is_sealed
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_segments import Taking, Walk, WatchSegments, walk_segments

T = TypeVar("T")


class Taker:
    """Claims' and pops' candidates and their transaction, for one store
    (noun: what its feeds are called in the log; scan_limit: the entries a
    claim or pop looks at, at most)."""

    def __init__(
        self,
        transport: Transport,
        clock: Clock,
        opener: BodyOpener,
        segments: WatchSegments,
        noun: str,
        scan_limit: int,
    ) -> None:
        self._transport, self._clock, self._opener = transport, clock, opener
        self._segments, self._noun, self._scan_limit = segments, noun, scan_limit

    def _judge(
        self, max_claims: int | None, opened: dict[str, bytes], where: tuple[str, str, str]
    ) -> Judge:
        """What a claim does with a free message (claim_scan.Verdict). With
        max_claims, one claimed that often is parked for the dead-letter
        queue. A sealed body is taken only if this process can open it (else
        it is left, logged and counted), and noted in opened as it was read."""

        def judge(row: r.Row) -> Verdict:
            if max_claims is not None and row.count >= max_claims:
                return "park"  # parked ones move as stored
            if is_sealed(row.body):
                op, project, queue = where
                if not self._opener.verdict(row.id, row.body, op, self._noun, project, queue):
                    return "leave"
                opened[row.id] = row.body
            return "take"

        return judge

    def _reader(self, keys: QueueKeys, records: dict[str, seg.SegmentRecord]) -> Reader:
        """The rows of ids in either layout (_lib.lua's read_message): an id
        naming a segment message is read there (its record noted in
        records, for the transaction), any other as a record."""
        transport, tag = self._transport, seg.id_tag(keys.prefix)

        async def read(ids: list[str]) -> list[r.Row | None]:
            found: dict[str, r.Row | None] = {}
            numbered = [i for i in ids if seg.seq_of(tag, i) is not None]
            if numbered:
                recs = await segment_claims.read_records(transport, keys, numbered)
                if recs:
                    states = ("HMGET", keys.claim_states, *(c.seq for c in recs.values()))
                    [raw] = await transport.call_checked([states], idempotent=True)
                    for (message_id, rec), state in zip(recs.items(), raw, strict=True):
                        decoded = seg.ClaimState.decode(state) if state else None
                        found[message_id] = segment_claims.segment_row(message_id, rec, decoded)
                    records.update(recs)
            older = [i for i in ids if i not in found]
            if older:
                replies = await transport.call_checked(r.read_commands(keys, older))
                found.update(zip(older, r.rows(older, replies), strict=True))
            return [found[i] for i in ids]

        return read

    def _walker(
        self,
        keys: QueueKeys,
        now: int,
        limit: int,
        walks: list[Walk],
        records: dict[str, seg.SegmentRecord],
    ) -> Walker:
        """The segments' walk from the claim head (its Walk kept in walks,
        the records it read in records)."""

        async def walker(high: int | None) -> AsyncIterator[tuple[int, list[r.Row]]]:
            async for walk, slots, rows in walk_segments(
                self._segments, keys, now, limit + 1, high
            ):
                walks[:] = [walk]
                records.update(walk.records)
                yield slots, rows

        return walker

    async def take(
        self, keys: QueueKeys, limit: int, plan_for: Any, where: tuple[str, str, str]
    ) -> Any:
        """Find candidates (claim_scan.Scan, read without WATCH, in either
        layout), then run plan_for(now, meta)'s plan over them in a
        transaction, with the claim index's upkeep the scan found and the
        claim head moved on; again after a backoff on conflict (a sealed
        body changed since it was opened is one). Unclaimable when nothing
        is free; where is (what, project, queue) for the log."""
        transport = self._transport
        attempt = 0
        settings: Command = ("HMGET", keys.meta, *r.DEAD_LETTER_SETTINGS, r.GROUPS_SINCE)
        async with transport.transactions.write_slot():
            while True:
                now = self._clock.now_ms()
                [meta] = await transport.call_checked([settings])
                plan, max_claims = plan_for(now, meta)
                opened: dict[str, bytes] = {}
                records: dict[str, seg.SegmentRecord] = {}
                walks: list[Walk] = []
                scan = Scan(
                    transport, keys, now, limit, self._scan_limit,
                    self._judge(max_claims, opened, where),
                    self._reader(keys, records), self._walker(keys, now, limit, walks, records),
                )  # fmt: skip
                found = await scan.run(groups.groups_since(meta[-1]))
                candidates = found.ids
                tidy = walks[0].tidy(keys) if walks else []
                taking = Taking(
                    keys, candidates, {i: records[i] for i in candidates if i in records}
                )
                watch = [keys.meta, *taking.watch(), *found.upkeep_watch(keys)]
                reads: list[Command] = [settings, *taking.reads(), *found.upkeep_reads(keys)]
                if not candidates:
                    if found.upkeep:  # once, as a courtesy: the next scan does it otherwise
                        await transport.transactions.attempt(
                            watch, reads, _upkeep_only(keys, found, meta, tidy)
                        )
                    elif tidy:  # the claim head moves on (the next walk is shorter)
                        await transport.call_checked(tidy)
                    return Unclaimable(found.next_free)
                run = _as_opened(taking, opened, _with_upkeep(keys, found, plan(taking), tidy))
                done, result = await transport.transactions.attempt(watch, reads, run)
                if done and result is not None:
                    return result
                await transport.transactions.backoff(attempt)
                attempt += 1


def _with_upkeep(keys: QueueKeys, found: Found, plan: Plan[T], tidy: list[Command]) -> Plan[T]:
    """plan, with the claim index's upkeep the scan found (its reads are the
    last replies) and the claim head moved on, where it writes."""
    if not found.upkeep and not found.parked and not tidy:
        return plan
    sizes = len(found.emptied)

    def run(replies: list[Any]) -> tuple[list[Command] | None, T]:
        upkeep = found.upkeep_writes(keys, replies[len(replies) - sizes :])
        writes, result = plan(replies)
        if writes is None:
            return None, result
        return [*writes, *upkeep, *tidy], result

    return run


def _upkeep_only(keys: QueueKeys, found: Found, meta: list[Any], tidy: list[Command]) -> Plan[None]:
    """The claim index's upkeep by itself (a scan that found nothing to take)."""
    sizes = len(found.emptied)

    def run(replies: list[Any]) -> tuple[list[Command] | None, None]:
        if replies[0] != meta:
            raise Conflicted
        return [*found.upkeep_writes(keys, replies[len(replies) - sizes :]), *tidy], None

    return run


def _as_opened(taking: Taking, opened: dict[str, bytes], plan: Plan[T]) -> Plan[T]:
    """plan, once the sealed bodies read in the transaction are the ones
    opened before it (Conflicted otherwise: the next attempt opens again)."""
    if not opened:
        return plan

    def run(replies: list[Any]) -> tuple[list[Command] | None, T]:
        for row in taking.rows(replies[1:]):
            if row is not None and row.id in opened and row.body != opened[row.id]:
                raise Conflicted
        return plan(replies)

    return run
