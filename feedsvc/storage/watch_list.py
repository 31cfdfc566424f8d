"""The watch drivers' list: a page of a queue read without WATCH (a list
only reads), as lua/list.lua answers it; in a queue that switched to
segments, the part in the older layout (watch_segments.py reads the rest)."""

from __future__ import annotations

from typing import Any

from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import ListQuery, Message, MessagePage
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.redis_store import marker_ceiling, marker_not_given_out
from feedsvc.storage.segment_pages import PageScan
from feedsvc.storage.transport import Transport


async def scan_page(
    transport: Transport, keys: QueueKeys, queue: str, query: ListQuery, now: int, scan_limit: int
) -> MessagePage | PageScan:
    """One page of the queue for query, read without WATCH (a list reads
    only): the index in growing chunks, then the records of each chunk;
    bodies as stored. A queue in segments (segments.NEW_START) has its
    older messages here: a page that reaches their end with room left is
    answered as its scan so far, to be carried on in the segments."""
    found: list[Message] = []
    scanned = 0
    alive = alive_at_message = 0  # live entries met, and up to the last message found
    first_alive: int | None = None  # the seq of the first live entry met
    last: int | None = None
    next_due: int | None = None  # see MessagePage
    claim_ends: int | None = None  # see MessagePage
    start = "-inf" if query.marker is None else f"({query.marker}"
    chunk = query.limit + 2
    check = query.check_marker and query.marker is not None
    # the counter, read before the index (in the first read's round trip):
    # every seq up to it not found in the index is gone (see passed below)
    read_counter = check or query.passing
    top: int | None = None
    new_start: Any = None
    while len(found) < query.limit and scanned < scan_limit:
        want = min(chunk, scan_limit - scanned)
        commands: list[Command] = [
            ("ZRANGEBYSCORE", keys.index, start, "+inf", "WITHSCORES", "LIMIT", 0, want)
        ]
        if read_counter:
            commands.insert(0, ("GET", keys.seq))
        if scanned == 0:
            commands.append(("HGET", keys.meta, seg.NEW_START))
        [*counter, raw] = await transport.call_checked(commands)
        if scanned == 0:
            counter, raw, new_start = counter[:-1], counter[-1], raw
        if read_counter:
            top = None if counter[0] is None else r.parse_seq(counter[0])
            read_counter = False
        if check:
            assert query.marker is not None
            if query.marker > marker_ceiling(counter[0], now):
                raise marker_not_given_out(queue, query.marker)
            check = False
        entries = r.pairs(raw)
        if not entries:
            break
        ids = [r.text(m) for m, _ in entries]
        replies = await transport.call_checked(r.read_commands(keys, ids))
        rows = r.rows(ids, replies)
        for (_, score), row in zip(entries, rows, strict=True):
            scanned += 1
            last = r.parse_seq(score)
            if row is None or not row.alive(now):
                continue
            alive += 1
            first_alive = last if first_alive is None else first_alive
            if not query.echo and row.author.decode() == query.client_id:
                continue
            if row.claimed(now):
                if claim_ends is None or row.claim_expires < claim_ends:
                    claim_ends = row.claim_expires
                if not query.include_claimed:
                    continue
            if not query.include_delayed and row.due > now:
                if row.due < row.expires and (next_due is None or row.due < next_due):
                    next_due = row.due
                continue
            found.append(row.message(now))
            alive_at_message = alive
            next_due = None  # only those after the page's last message count (list.lua)
            if len(found) == query.limit:
                break
        if len(entries) < want:
            break
        start = f"({last}"
        chunk = min(chunk * 2, 512)
    if new_start is not None and len(found) < query.limit and scanned < scan_limit:
        tag = seg.id_tag(keys.prefix)
        scan = PageScan(tag, query, now, scan_limit, found, scanned, alive, alive_at_message)
        scan.first_alive, scan.next_due, scan.claim_ends, scan.last = (
            first_alive, next_due, claim_ends, last
        )  # fmt: skip
        return scan
    page = _page(found, last, scanned >= scan_limit, next_due, claim_ends)
    if page.next_marker is not None and query.marker is not None:
        met = alive_at_message if page.next_due is not None else alive
        if page.next_marker - query.marker > met:
            start_at = await _counted_from(transport, keys, query.marker)
            page.missed = max(0, page.next_marker - start_at - met)
    elif query.passing and query.marker is not None and not found and scanned < scan_limit:
        # how far this empty page lets a follower pass (list.lua's passed)
        start_at = await _counted_from(transport, keys, query.marker)
        if first_alive is not None:
            page.passed = max(start_at, first_alive - 1)
        else:  # nothing live after the marker: every seq up to the counter is gone
            page.passed = max(start_at, top or 0)
        page.missed = page.passed - start_at
    return page


async def _counted_from(transport: Transport, keys: QueueKeys, marker: int) -> int:
    """Where counting what is gone after marker starts: seqs are consecutive
    from the counter's start (list.lua's missed), later than an old marker
    of a queue deleted and made again."""
    [base] = await transport.call_checked([("HGET", keys.meta, r.SEQ_BASE)])
    return marker if base is None else max(marker, r.parse_seq(base))


def _page(
    found: list[Message], last: int | None, cut: bool, next_due: int | None, claim_ends: int | None
) -> MessagePage:
    """The page list.lua answers (its header explains next_marker, next_due,
    claim_ends and missed); cut: the scan stopped at the scan limit."""
    if next_due is not None and found:
        return MessagePage(found, found[-1].seq, next_due, claim_ends)
    if found or cut:
        return MessagePage(found, last, None, claim_ends)
    return MessagePage([], None, next_due, claim_ends)
