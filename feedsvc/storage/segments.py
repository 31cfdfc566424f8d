"""The packed segment layout (issue 30, docs/design-compact-storage.md): the codec.

This module owns how a queue stores messages once it uses *segments*: the
segment string, the record in it, a message's id, the claim state of a
segment message (``Q:cl``) and the Lua names the scripts use for all of
these (:func:`lua_names`, written into every script with record.py's).

A queue's messages from seq ``ns`` on (the queue hash's :data:`NEW_START`,
set once and for good by the first post in segments, = the counter + 1)
live in segments; seqs below it are records of the older layout
(``record.py``), read where they are until they expire. Segment *k*
(``Q:p:<k>``, keys.py) holds seqs ``k * 100 ... k * 100 + 99``:

* :data:`SLOTS` slots of :data:`SLOT_BYTES` bytes, big-endian: the offset of
  the slot's record in the string; 0 = no record (never written, or removed
  by a review); with :data:`GONE_BIT` set the message is gone (deleted,
  popped) but its record is still there until the segment's next review:
  its offset still ends the record before it. A record ends where the
  next slot with a non-zero value starts, or at the string's end.
* then the records, appended in seq order. Nothing in a record changes
  after it is written; the segment's PEXPIREAT is its latest expiry.

A *record*: expires ms (13 digits), due ms (13 digits, 0 = not delayed),
ttl s (7 digits), the author's client id as its 16 UUID bytes, the length
of the *extras* (:data:`EXTRAS_LENGTH_BYTES`, big-endian), the extras (the
message's group after GROUP_MARK and/or its headers, separated by a space,
as on an older record's author line; empty for most messages), the body as
posted (JSON bytes, or an encrypted queue's sealed bytes). ``created`` is
``expires - ttl * 1000``.

A segment message's *id* is 24 lowercase hex digits: the feed's tag (11,
:func:`id_tag`, from its key prefix) then its seq (13, :func:`message_id`).
Within a feed ids sort by seq; they reveal how many messages were posted
between two of one's own, and are not secret (docs/design.md). The tag
keeps an id of one queue from naming a message of another: seqs of two
queues overlap (each counter starts at its queue's creation in us).

Its *claim state*, only while it is claimed or was (``Q:cl``, seq ->
:class:`ClaimState`): claim id, claim expiry, times claimed, and the
message's expiry when a claim extended its life (0: not extended).
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from feedsvc.storage import reviews
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import (
    CLAIM_STATES_SUFFIX,
    DIRECTORY_SUFFIX,
    REVIEWS_SUFFIX,
    SEGMENT_COUNTS_SUFFIX,
    SEGMENT_INFIX,
    QueueKeys,
)

SLOTS: Final = 100  # seqs per segment
SLOT_BYTES: Final = 4
TABLE_BYTES: Final = SLOTS * SLOT_BYTES  # the slot table at a segment's start
GONE_BIT: Final = 0x80000000  # in a slot: the message is gone, its record not yet
OFFSET_MASK: Final = GONE_BIT - 1

# the queue hash's fields of the layout (record.py owns the others)
NEW_START: Final = "ns"  # the first seq in segments; absent: the queue has none
GONE: Final = "gone"  # segment messages swept or deleted (counts; compact-expiry)
#: the first seq a claim or pop need look at in the segments: every one
#: before it is gone for good (deleted, popped or expired); claims move it on
CLAIM_HEAD: Final = "ch"
#: set (to "1") once the older layout holds no message of the queue: its index
#: never gains one after NEW_START, so the post stops looking (post_segments.lua)
LEGACY_GONE: Final = "lg"

# the record: fixed-width text, then binary
EXPIRES_WIDTH: Final = 13
DUE_WIDTH: Final = 13
TTL_WIDTH: Final = 7
AUTHOR_AT: Final = EXPIRES_WIDTH + DUE_WIDTH + TTL_WIDTH  # 33
AUTHOR_BYTES: Final = 16
EXTRAS_LENGTH_AT: Final = AUTHOR_AT + AUTHOR_BYTES  # 49
EXTRAS_LENGTH_BYTES: Final = 2
EXTRAS_AT: Final = EXTRAS_LENGTH_AT + EXTRAS_LENGTH_BYTES  # 51
MAX_EXTRAS: Final = 256**EXTRAS_LENGTH_BYTES - 1
MAX_TTL: Final = 10**TTL_WIDTH - 1
ID_DIGITS: Final = 24
ID_TAG_DIGITS: Final = 11  # the feed's tag (id_tag)
SEQ_DIGITS: Final = ID_DIGITS - ID_TAG_DIGITS  # 13 hex digits: seqs (us) until 2112
GROUP_MARK: Final = b"g="  # the same mark as record.py's (a group follows it)
EXTRAS_SEPARATOR: Final = b" "


@functools.lru_cache(maxsize=4096)
def id_tag(prefix: str) -> str:
    """The first ID_TAG_DIGITS of every segment message id of the feed whose
    keys start with prefix (keys.QueueKeys.prefix): ids name seqs, and seqs
    of two queues overlap, so without it an id posted to one queue would
    name a message of another (DESIGN rule 3). _lib.lua's segment_tag is the same."""
    return hashlib.sha1(prefix.encode(), usedforsecurity=False).hexdigest()[:ID_TAG_DIGITS]


def message_id(tag: str, seq: int) -> str:
    """The id of the segment message with this seq in the feed of this id_tag."""
    return f"{tag}{seq:0{SEQ_DIGITS}x}"


def seq_of(tag: str, message_id: str) -> int | None:
    """The seq a segment message's id names in the feed of this id_tag
    (None: not one of its segment ids, e.g. an id of the older layout, or
    of another feed)."""
    if len(message_id) != ID_DIGITS or not message_id.startswith(tag):
        return None
    try:
        return int(message_id[ID_TAG_DIGITS:], 16)
    except ValueError:
        return None


def table_read(key: str) -> tuple[str, str, int, int]:
    """The command that reads a segment's (key's) whole slot table."""
    return ("GETRANGE", key, 0, TABLE_BYTES - 1)


def segment_of(seq: int) -> tuple[int, int]:
    """(segment number, slot) of a seq."""
    return divmod(seq, SLOTS)


def author_bytes(client_id: str) -> bytes:
    """A client id as a record stores it: its 16 UUID bytes. The API only
    lets canonical UUIDs through; another string (a test's, a tool's) is
    stored as 16 bytes of its hash, so echo still tells it apart."""
    try:
        return uuid.UUID(client_id).bytes
    except ValueError:
        return hashlib.md5(client_id.encode(), usedforsecurity=False).digest()


def author_text(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw))


def extras(group: str | None, headers: bytes | None) -> bytes:
    """A message's extras: its group (after GROUP_MARK), then its headers."""
    out = GROUP_MARK + group.encode() if group else b""
    if headers:
        out += (EXTRAS_SEPARATOR if out else b"") + headers
    if len(out) > MAX_EXTRAS:
        raise ValueError("a message's group and headers are too long for a record")
    return out


def split_extras(raw: bytes) -> tuple[str | None, bytes | None]:
    """(group, headers) of a record's extras (None: none)."""
    if not raw:
        return None, None
    if not raw.startswith(GROUP_MARK):
        return None, raw
    group, _, headers = raw[len(GROUP_MARK) :].partition(EXTRAS_SEPARATOR)
    return group.decode(), headers or None


def encode_record(
    expires: int, due: int, ttl: int, author: bytes, extra: bytes, body: bytes
) -> bytes:
    """A record as a segment holds it: built here by every driver (the lua
    driver's post_segments.lua appends the ones LuaSegments builds)."""
    if ttl > MAX_TTL or len(author) != AUTHOR_BYTES:
        raise ValueError("a field does not fit a segment record")
    return b"%013d%013d%07d" % (expires, due, ttl) + record_tail(author, extra, body)


def record_tail(author: bytes, extra: bytes, body: bytes) -> bytes:
    """A record after its fixed-width times (encode_record's tail)."""
    return author + len(extra).to_bytes(EXTRAS_LENGTH_BYTES, "big") + extra + body


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """A segment message's record, as stored (see the module docstring)."""

    seq: int
    expires: int  # ms, as posted (a claim's extension is in its ClaimState)
    due: int  # ms; 0 = not delayed
    ttl: int  # s, as posted
    author: bytes  # 16 bytes
    extras: bytes
    body: bytes

    @classmethod
    def decode(cls, seq: int, raw: bytes) -> SegmentRecord:
        length = int.from_bytes(raw[EXTRAS_LENGTH_AT:EXTRAS_AT], "big")
        return cls(
            seq,
            int(raw[:EXPIRES_WIDTH]),
            int(raw[EXPIRES_WIDTH : EXPIRES_WIDTH + DUE_WIDTH]),
            int(raw[EXPIRES_WIDTH + DUE_WIDTH : AUTHOR_AT]),
            raw[AUTHOR_AT:EXTRAS_LENGTH_AT],
            raw[EXTRAS_AT : EXTRAS_AT + length],
            raw[EXTRAS_AT + length :],
        )

    @property
    def created(self) -> int:
        return self.expires - self.ttl * 1000


@dataclass(frozen=True, slots=True)
class ClaimState:
    """A segment message's entry in ``Q:cl``: "<claim id> <claim expires ms>
    <count> <expires ms>" (claim id "-": none now, and then a claim expiry
    is when a release with a delay makes it due; expires 0: as posted)."""

    claim: str  # "" = none
    claim_expires: int
    count: int
    expires: int = 0  # the message's expiry if a claim extended it

    def encode(self) -> bytes:
        return b"%s %d %d %d" % (
            (self.claim or "-").encode(),
            self.claim_expires,
            self.count,
            self.expires,
        )

    @classmethod
    def decode(cls, raw: bytes) -> ClaimState:
        claim, claim_expires, count, expires = raw.split(b" ")
        return cls(
            "" if claim == b"-" else claim.decode(), int(claim_expires), int(count), int(expires)
        )

    def held(self, now: int) -> bool:
        return bool(self.claim) and self.claim_expires > now

    def due(self, posted: int) -> int:
        """When the message is due, posted: its record's due. A state with no
        claim but a claim expiry was released with a delay: due then
        (_lib.lua's segment_record reads it the same)."""
        return posted if self.claim else max(posted, self.claim_expires)


def live_count_commands(keys: QueueKeys, now: int) -> list[Command]:
    """The reads of a feed's live count (live_count), in either layout."""
    return [
        ("ZCOUNT", keys.expiry, f"({now}", "+inf"),
        ("HMGET", keys.meta, NEW_START, GONE),
        ("GET", keys.seq),
    ]


def live_count(replies: Sequence[Any]) -> int:
    """How many live messages a feed holds, from live_count_commands'
    replies (_lib.lua's live_count is the same count): the older layout's
    from its expiry index, the segments' as posted less those gone. Until
    the sweep has counted them, expired segment messages still count."""
    live, (new_start, gone), top = replies
    count = int(live)
    if new_start is not None:
        count += max(0, int(top or 0) - int(new_start) + 1 - int(gone or 0))
    return count


def slot_offsets(table: bytes) -> list[int]:
    """The raw slot values of (part of) a slot table."""
    return [int.from_bytes(table[i : i + SLOT_BYTES], "big") for i in range(0, len(table), 4)]


def lua_names() -> dict[str, str]:
    """The Lua names of the layout, written into every script
    (record.lua_constants): literal Lua values."""
    return {
        "SEG_SLOTS": str(SLOTS),
        "SEG_SLOT_BYTES": str(SLOT_BYTES),
        "SEG_TABLE_BYTES": str(TABLE_BYTES),
        "SEG_GONE_BIT": str(GONE_BIT),
        "SEG_RECORD_FORMAT": repr(f"%0{EXPIRES_WIDTH}d%0{DUE_WIDTH}d%0{TTL_WIDTH}d"),
        "SEG_EXPIRES_END": str(EXPIRES_WIDTH),
        "SEG_DUE_END": str(EXPIRES_WIDTH + DUE_WIDTH),
        "SEG_AUTHOR_AT": str(AUTHOR_AT + 1),
        "SEG_EXTRAS_LENGTH_AT": str(EXTRAS_LENGTH_AT + 1),
        "SEG_EXTRAS_AT": str(EXTRAS_AT + 1),
        "SEG_EXTRAS_LENGTH_FORMAT": repr(f">I{EXTRAS_LENGTH_BYTES}"),
        "SEG_SEQ_FORMAT": repr(f"%0{SEQ_DIGITS}x"),
        "SEG_ID_TAG_DIGITS": str(ID_TAG_DIGITS),
        "SEG_ID_DIGITS": str(ID_DIGITS),
        "F_NEW_START": repr(NEW_START),
        "F_GONE": repr(GONE),
        "F_CLAIM_HEAD": repr(CLAIM_HEAD),
        "F_LEGACY_GONE": repr(LEGACY_GONE),
        "S_SEGMENT": repr(SEGMENT_INFIX),
        "S_DIRECTORY": repr(DIRECTORY_SUFFIX),
        "S_CLAIM_STATES": repr(CLAIM_STATES_SUFFIX),
        "S_REVIEWS": repr(REVIEWS_SUFFIX),
        "S_SEGMENT_COUNTS": repr(SEGMENT_COUNTS_SUFFIX),
        **reviews.lua_names(),
    }
