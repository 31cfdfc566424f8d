"""The watch drivers' delete by ids, in either layout, ordered groups kept.

The older layout's messages go in one transaction that reads each record's
author line as it goes (its group rides there); the segments' have their
slots marked gone in an optimistic one (watch_segments.Forgetting), their
groups known from their records (read before: a record never changes). In
a queue with groups, a last transaction takes them out of the claim index
and their groups (a scan meanwhile meets them gone and skips them) and
wakes claim waits: a group's next message may be free now.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from feedsvc.storage import groups
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.coalescer import Command
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_segments import Forgetting

# What a delete by ids reads of each record's author line for its group:
# a client id (a UUID), " g=" and a group of up to 128 characters, with room.
AUTHOR_LINE = 255


async def delete_by_ids(transport: Transport, forgetting: Forgetting, now: int) -> None:
    """Delete forgetting's ids at now (ms; see the module docstring)."""
    keys = forgetting.keys
    older = [i for i in forgetting.ids if i not in forgetting.seqs]
    has_groups: Command = ("HEXISTS", keys.meta, r.GROUPS_SINCE)
    gone: list[tuple[str, str]] = []
    grouped = False
    if older:
        lines: list[Command] = [
            ("GETRANGE", keys.record(i), r.FIXED, r.FIXED + AUTHOR_LINE) for i in older
        ]
        replies = await transport.transaction([has_groups, *lines, *r.forget_commands(keys, older)])
        grouped = bool(replies[0])
        gone += [(i, _group_of(line)) for i, line in zip(older, replies[1:], strict=False)]
    if forgetting.seqs:
        mine = dataclasses.replace(forgetting, ids=list(forgetting.seqs))

        def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
            return mine.writes(replies[1:], now), bool(replies[0])

        reads = [has_groups, *mine.reads()]
        grouped = await transport.transactions.optimistic(mine.watch(), reads, plan)
        for message_id, rec in forgetting.records.items():
            gone.append((message_id, seg.split_extras(rec.extras)[0] or ""))
    if not grouped:
        return
    writes = groups.forget_commands(keys, gone)
    if any(group for _, group in gone):
        writes.append(("SPUBLISH", keys.feed, r.FREED))
    await transport.transaction(writes)


def _group_of(line: bytes) -> str:
    """The group on the start of an author line (GETRANGE of a record from
    record.FIXED, AUTHOR_LINE long; "": none, or no record)."""
    return r.split_author(line.partition(r.NEWLINE)[0])[1]
