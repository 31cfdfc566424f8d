"""The watch drivers' claims and pops: the free messages at a queue's head,
found without WATCH (the older layout's index, then the segments from their
claim head), then taken in a transaction that reads them again under WATCH."""

from __future__ import annotations

from typing import Any, TypeVar

from feedsvc.clock import Clock
from feedsvc.storage import record as r
from feedsvc.storage.base import Unclaimable
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

    async def free_candidates(
        self,
        keys: QueueKeys,
        now: int,
        limit: int,
        max_claims: int | None,
        opened: dict[str, bytes],
        where: tuple[str, str, str],
    ) -> tuple[list[str], int | None, Walk | None]:
        """Up to limit messages from the head that nobody holds (read without
        WATCH), and the earliest time one of the others looked at becomes
        free by itself (see Unclaimable); in the older layout's index, then
        in the segments (the walk: their records, the claim head).

        With max_claims, messages claimed that often (to be dead-lettered) are
        included too but do not count towards limit. A sealed body is
        included only if this process can open it (else it is skipped, logged
        and counted), and noted in opened as it was read.
        """
        found: list[str] = []
        next_free: int | None = None
        counted = 0
        offset, scanned, budget = 0, 0, self._scan_limit

        def look(row: r.Row | None) -> bool:
            """One message looked at; True: enough found."""
            nonlocal next_free, counted
            at = None if row is None else row.free_at(now)
            if at is not None and (next_free is None or at < next_free):
                next_free = at
            if row is not None and row.free(now):
                parked = max_claims is not None and row.count >= max_claims
                if not parked and is_sealed(row.body):  # parked ones move as stored
                    op, project, queue = where
                    if not self._opener.verdict(row.id, row.body, op, self._noun, project, queue):
                        return False
                    opened[row.id] = row.body
                found.append(row.id)
                if max_claims is None or row.count < max_claims:
                    counted += 1
            return counted == limit

        while counted < limit and scanned < budget:
            [ids] = await self._transport.call_checked(
                [("ZRANGE", keys.index, offset, offset + 99)]
            )
            if not ids:
                break
            offset += len(ids)
            names = [r.text(i) for i in ids]
            replies = await self._transport.call_checked(r.read_commands(keys, names))
            for row in r.rows(names, replies):
                scanned += 1
                if look(row):
                    break
        walk = None
        if counted < limit and scanned < budget:
            async for step in walk_segments(self._segments, keys, now, limit + 1):
                walk, slots, rows = step
                scanned += slots
                if any(look(row) for row in rows) or scanned >= budget:
                    break
        return found, next_free, walk

    async def take(
        self, keys: QueueKeys, limit: int, plan_for: Any, where: tuple[str, str, str]
    ) -> Any:
        """Find free candidates, then run plan_for(now, candidates, meta) over
        them in a transaction; again after a backoff on conflict (a sealed
        body changed since it was opened is one). Unclaimable when nothing is
        free; where is (what, project, queue) for the log."""
        transport = self._transport
        attempt = 0
        async with transport.transactions.write_slot():
            while True:
                now = self._clock.now_ms()
                [meta] = await transport.call_checked(
                    [("HMGET", keys.meta, *r.DEAD_LETTER_SETTINGS)]
                )
                plan, max_claims = plan_for(now, meta)
                opened: dict[str, bytes] = {}
                candidates, next_free, walk = await self.free_candidates(
                    keys, now, limit, max_claims, opened, where
                )
                tidy = [] if walk is None else walk.tidy(keys)
                if not candidates:
                    if tidy:  # the claim head moves on (a courtesy: the next walk is shorter)
                        await transport.call_checked(tidy)
                    return Unclaimable(next_free)
                walked = {} if walk is None else walk.records
                taking = Taking(keys, candidates, {i: walked[i] for i in candidates if i in walked})
                watch = [keys.meta, *taking.watch()]
                reads: list[Command] = [("HMGET", keys.meta, *r.DEAD_LETTER_SETTINGS)]
                reads += taking.reads()
                run = _as_opened(taking, opened, _tidied(plan(taking), tidy))
                done, result = await transport.transactions.attempt(watch, reads, run)
                if done and result is not None:
                    return result
                await transport.transactions.backoff(attempt)
                attempt += 1


def _tidied(plan: Plan[T], tidy: list[Command]) -> Plan[T]:
    """plan, with the claim head moved on where it writes."""
    if not tidy:
        return plan

    def run(replies: list[Any]) -> tuple[list[Command] | None, T]:
        writes, result = plan(replies)
        return (None if writes is None else [*writes, *tidy]), result

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
