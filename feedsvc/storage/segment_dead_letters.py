"""Dead letters copied into a dead-letter queue that stores its messages in
segments (claim_upkeep.py's step 2, storage/segments.py's layout).

A copy there is a new message with a new id (its seq: an id in segments is
a position), its body, author, headers and group as they were, its claim
count kept (in its claim state), the dead-letter ttl. Its origin goes in
``Q:dlo`` as every dead letter's does (new id -> source queue), and beside
it the field ``"<source queue> <source id>"`` -> new id, so that copying
the same message again (the service stopped between the copy and the
forget) finds its copy: it is not copied again while that copy is still
there (not consumed, redriven or deleted), as in the older layout, where
the copy keeps the message's id and is found by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from feedsvc.storage import groups
from feedsvc.storage import record as r
from feedsvc.storage import segments as s
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.optimistic import Conflicted
from feedsvc.storage.segment_writes import Appending, append_transaction
from feedsvc.storage.transport import Transport


def copy_field(queue: str, message_id: str) -> str:
    """The field of Q:dlo naming the copy of a source queue's message."""
    return f"{queue} {message_id}"


async def copy_dead_letters(
    transport: Transport,
    queue: str,
    target: QueueKeys,
    parked: Sequence[r.Parked],
    now: int,
    keep_after_ms: int,
) -> int | None:
    """Step 2 into a dead-letter queue in segments; Q:dlo kept keep_after_ms
    past the latest copy's expiry (a claim can stretch one's life). Returns
    the segment review the copies scheduled (ms; None: none), for fs:sweep."""
    fields = [copy_field(queue, m.id) for m in parked]
    tag = s.id_tag(target.prefix)
    [named] = await transport.call_checked([("HMGET", target.origins, *fields)])
    copies = [None if n is None else s.seq_of(tag, r.text(n)) for n in named]
    slots: list[Command] = []
    for seq in copies:
        if seq is not None:
            k, slot = s.segment_of(seq)
            at = slot * s.SLOT_BYTES
            slots.append(("GETRANGE", target.segment(k), at, at + s.SLOT_BYTES - 1))

    def plan(where: Appending, replies: list[Any]) -> tuple[list[Command] | None, None]:
        again, origins_ttl, (created, since_raw), *tables = replies
        if list(again) != list(named):
            raise Conflicted  # another copy meanwhile: read again
        found = iter(tables)
        fresh = []
        for m, seq in zip(parked, copies, strict=True):
            if seq is not None:
                [value] = s.slot_offsets(next(found)) or [0]
                if value and not value & s.GONE_BIT:
                    continue  # copied before, and the copy is still there
            fresh.append(m)
        if not fresh:
            return None, None
        since = groups.groups_since(since_raw)
        records: list[tuple[bytes, int]] = []
        writes: list[Command] = []
        latest = 0
        for n, m in enumerate(fresh):
            seq = where.top + 1 + n
            new_id = s.message_id(tag, seq)
            expires = now + m.ttl * 1000
            author = s.author_bytes(m.author.decode())
            extras = s.extras(m.group or None, m.headers or None)
            records.append((s.encode_record(expires, 0, m.ttl, author, extras, m.body), expires))
            if m.count:
                state = s.ClaimState("", 0, m.count)
                writes.append(("HSET", target.claim_states, seq, state.encode()))
            grouped, since = groups.index_commands(target, new_id, seq, m.group, since)
            writes += grouped
            writes.append(("HSET", target.origins, new_id, queue, copy_field(queue, m.id), new_id))
            latest = max(latest, expires)
        keep = latest + keep_after_ms
        if int(origins_ttl) < 0 or now + int(origins_ttl) < keep:
            writes.append(("PEXPIREAT", target.origins, keep))
        if created is None:
            writes.append(("HSET", target.meta, r.CREATED, now, r.METADATA, "{}"))
        # visible there as a post's messages are: wake its followers alike
        writes.append(("SPUBLISH", target.feed, r.notification(where.top + len(fresh), 0)))
        return where.commands(records) + writes, None

    watch = [target.origins, target.meta, *(c[1] for c in slots)]
    reads: list[Command] = [
        ("HMGET", target.origins, *fields),
        ("PTTL", target.origins),
        ("HMGET", target.meta, r.CREATED, r.GROUPS_SINCE),
        *slots,
    ]
    _, review = await append_transaction(transport, target, len(parked), watch, reads, plan)
    return review
