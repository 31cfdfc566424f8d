"""Where a message's bytes are in Redis, in either layout (record.py's key
per message, or segments.py's segment): for tests that look at or alter
what is stored."""

from __future__ import annotations

from typing import Any

from feedsvc.storage import record, segments
from feedsvc.storage.keys import QueueKeys


async def body_span(client: Any, keys: QueueKeys, message_id: str) -> tuple[str, int, int]:
    """(key, first byte, last byte) of a stored message's body."""
    raw = await client.get(keys.record(message_id))
    if raw is not None:
        start = raw.index(record.NEWLINE, record.FIXED) + 1
        return keys.record(message_id), start, len(raw) - 1
    seq = segments.seq_of(segments.id_tag(keys.prefix), message_id)
    assert seq is not None, f"{message_id} is in neither layout"
    k, slot = segments.segment_of(seq)
    key = keys.segment(k)
    table = await client.getrange(key, 0, segments.TABLE_BYTES - 1)
    values = [v & segments.OFFSET_MASK for v in segments.slot_offsets(table)]
    assert values[slot], f"{message_id} has no record"
    end = next((v for v in values[slot + 1 :] if v), int(await client.strlen(key))) - 1
    at = values[slot] + segments.EXTRAS_LENGTH_AT
    length = int.from_bytes(await client.getrange(key, at, at + 1), "big")
    return key, values[slot] + segments.EXTRAS_AT + length, end


async def stored_body(client: Any, keys: QueueKeys, message_id: str) -> bytes:
    """A message's body as Redis holds it (sealed, in an encrypted queue)."""
    key, start, end = await body_span(client, keys, message_id)
    raw = await client.getrange(key, start, end)
    assert isinstance(raw, bytes)
    return raw


async def is_stored(client: Any, keys: QueueKeys, message_id: str) -> bool:
    """Whether the feed of these keys holds the message's record, in either
    layout (a segment message's id carries its feed's tag)."""
    if await client.exists(keys.record(message_id)):
        return True
    seq = segments.seq_of(segments.id_tag(keys.prefix), message_id)
    if seq is None:
        return False
    k, slot = segments.segment_of(seq)
    at = slot * segments.SLOT_BYTES
    raw = await client.getrange(keys.segment(k), at, at + segments.SLOT_BYTES - 1)
    value = int.from_bytes(raw, "big") if len(raw) == segments.SLOT_BYTES else 0
    return bool(value & segments.OFFSET_MASK) and not value & segments.GONE_BIT
