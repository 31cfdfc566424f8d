"""The stored records, written and read in one place: the codec.

This module owns the layout of a message hash (``Q:m:<id>``), a claim hash
(``Q:c:<claim id>``) and a queue hash (``Q:q``): their field names, the
record written when a message is posted, the commands that forget a
message, the rule by which a claim extends a message's life, and one
decoder per shape of reply (an HMGET row, and each script's reply).

A message hash has two fields: ``b``, the body, and ``h``, the *header*:
every other field of the message in one value of fixed-width fields
(:data:`HEADER_FIELDS`: seq ttl created expires due claim-expires
claim-count claim-id, zero-padded, then the author; seq 0 until the message
is indexed). One value instead of nine because the list script reads a
message with one HMGET of two fields instead of nine, compares the fields
it filters on as fixed-width strings where it converted each with
tonumber(), and answers three reply elements per message instead of seven:
each field a script reads, converts or answers costs Redis a fraction of a
microsecond, and a page of ten had about 150 of them (docs/BENCHMARKS.md,
"The list script's Redis cost"). What a claim changes
(claim id, claim expiry, count, expiry, ttl) is rewritten with the header,
in the same script or transaction that read it, so it stays atomic; the
body, the large part, is never rewritten.

Upgrade: releases before the header stored each field under its own name
(``LEGACY``: t c e u s d k x n). Those records are still read everywhere
(:meth:`Row.read`, ``_lib.lua``'s ``read_message``, list.lua's fallback):
a record without ``h`` is a legacy one. Every write to a message (a claim,
its renewal or release, parking) rewrites a legacy record in the new
layout and deletes its legacy fields in the same script or transaction, so
records migrate lazily and atomically; a legacy record nobody touches
expires with its ttl. Once a release has run for the longest message ttl
plus delay, no legacy record is left and the legacy reads can go.

The Lua scripts read and write the same records. They do not spell the
field names out: :func:`lua_prelude` generates ``local F_BODY = 'b'`` ...
from :data:`LUA_NAMES` and ``scripts.py`` puts it in front of every script
when it is loaded, so a rename here is a rename everywhere. A test fails if
a script spells a field name itself (``tests/test_record.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from feedsvc.storage.base import RESERVED_FIELDS, Claim, Message, MessagePage
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import (
    CLAIM_INFIX,
    FEED_SUFFIX,
    IDEMPOTENCY_SUFFIX,
    MESSAGE_INFIX,
    META_SUFFIX,
    QueueKeys,
)

# -- the message hash ------------------------------------------------------
BODY: Final = "b"  # the JSON body, returned verbatim
HEADER: Final = "h"  # every other field, see Header
# the legacy layout's fields (read, never written; see the docstring); some
# are the claim and queue hashes' field names too
TTL: Final = "t"  # ttl in seconds (grows when a claim outlives the message)
CREATED: Final = "c"  # ms
EXPIRES: Final = "e"  # ms; the key's PEXPIREAT too
AUTHOR: Final = "u"  # client id of the poster (for echo)
SEQ: Final = "s"  # sequence number, set when indexed: the marker
DUE: Final = "d"  # ms before which a delayed message is hidden; 0 = none
CLAIM: Final = "k"  # id of the claim holding it, '' = none
CLAIM_EXPIRES: Final = "x"  # ms
CLAIM_COUNT: Final = "n"  # how often it was claimed

# -- the claim hash (CREATED and TTL as above) -------------------------------
GRACE: Final = "g"  # grace in seconds
HELD: Final = "ids"  # the claimed message ids, space separated
# a claim's own expiry lives in CLAIM_EXPIRES ("x") as well

# -- the queue hash ----------------------------------------------------------
METADATA: Final = "m"  # user metadata, a JSON object (CREATED as above)
# and the reserved settings the scripts honour, as plain fields
DEFAULT_TTL: Final = RESERVED_FIELDS["_default_message_ttl"]
DEFAULT_DELAY: Final = RESERVED_FIELDS["_default_message_delay"]
MAX_POST_SIZE: Final = RESERVED_FIELDS["_max_messages_post_size"]
MAX_CLAIMS: Final = RESERVED_FIELDS["_max_claim_count"]
DEAD_LETTER_QUEUE: Final = RESERVED_FIELDS["_dead_letter_queue"]
DEAD_LETTER_TTL: Final = RESERVED_FIELDS["_dead_letter_queue_messages_ttl"]
ENCRYPTED: Final = RESERVED_FIELDS["_enable_encrypt_messages"]  # "1": post bodies sealed
DEAD_LETTER_SETTINGS: Final = (MAX_CLAIMS, DEAD_LETTER_QUEUE, DEAD_LETTER_TTL)
POST_SETTINGS: Final = (DEFAULT_TTL, DEFAULT_DELAY, MAX_POST_SIZE, ENCRYPTED)

# A message's fields in the legacy layout, as a Row reads them.
LEGACY: Final = (TTL, CREATED, EXPIRES, SEQ, CLAIM, CLAIM_EXPIRES, CLAIM_COUNT, AUTHOR, DUE)
# The fields read for a message, in this order, wherever Python reads one:
# the header and body, and the legacy fields for a record written before the
# header (absent fields of a two-field hash cost Redis little).
ROW: Final = (HEADER, BODY, *LEGACY)
# What a claim's holder is read with (see holder()), and a message's age (summary()).
HOLDER: Final = (HEADER, CLAIM)
SUMMARY: Final = (HEADER, CREATED, EXPIRES)

LUA_NAMES: Final = {
    "F_BODY": BODY,
    "F_HEADER": HEADER,
    "F_TTL": TTL,
    "F_CREATED": CREATED,
    "F_EXPIRES": EXPIRES,
    "F_AUTHOR": AUTHOR,
    "F_SEQ": SEQ,
    "F_DUE": DUE,
    "F_CLAIM": CLAIM,
    "F_CLAIM_EXPIRES": CLAIM_EXPIRES,
    "F_CLAIM_COUNT": CLAIM_COUNT,
    "F_GRACE": GRACE,
    "F_HELD": HELD,
    "F_METADATA": METADATA,
    "F_DEFAULT_TTL": DEFAULT_TTL,
    "F_DEFAULT_DELAY": DEFAULT_DELAY,
    "F_MAX_POST_SIZE": MAX_POST_SIZE,
    "F_MAX_CLAIMS": MAX_CLAIMS,
    "F_DEAD_LETTER_QUEUE": DEAD_LETTER_QUEUE,
    "F_DEAD_LETTER_TTL": DEAD_LETTER_TTL,
    "F_ENCRYPTED": ENCRYPTED,
    # and the key suffixes of keys.py, which scripts build keys with
    "S_META": META_SUFFIX,
    "S_MESSAGE": MESSAGE_INFIX,
    "S_CLAIM": CLAIM_INFIX,
    "S_IDEMPOTENCY": IDEMPOTENCY_SUFFIX,
    "S_FEED": FEED_SUFFIX,
}


def lua_header_names() -> dict[str, str]:
    """The Lua locals that lay out a message header: H_<FIELD> and
    H_<FIELD>_END, its first and last position (Lua counts from 1), H_AUTHOR
    where the author starts, HEADER_FORMAT, the string.format of a header,
    and H_MS_FORMAT, of a time in it."""
    names = {}
    for name, width in HEADER_FIELDS:
        at = OFFSETS[name]
        names[f"H_{name.upper()}"] = str(at.start + 1)
        names[f"H_{name.upper()}_END"] = str(at.start + width)
    names["H_AUTHOR"] = str(OFFSETS["author"].start + 1)
    formats = [f"%-{w}s" if name == "claim" else f"%0{w}d" for name, w in HEADER_FIELDS]
    names["HEADER_FORMAT"] = repr(" ".join([*formats, "%s"]))
    names["H_MS_FORMAT"] = repr(formats[[n for n, _ in HEADER_FIELDS].index("expires")])
    return names


def lua_prelude() -> bytes:
    """The Lua locals naming every field and key suffix, and laying out a
    message header, put before each script."""
    lines = ["-- generated by feedsvc/storage/record.py: field names and key suffixes"]
    lines += [f"local {name} = '{field}'" for name, field in LUA_NAMES.items()]
    lines += [f"local {name} = {value}" for name, value in lua_header_names().items()]
    return ("\n".join(lines) + "\n").encode()


def text(raw: Any) -> str:
    """A reply element as str (replies are bytes; decode_responses is off)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def parse_seq(raw: bytes | str | int | float) -> int:
    # Redis may format a large zset score in exponent notation (and RESP3
    # sends it as a double); every seq is below 2**53, so the float round
    # trip is exact.
    if isinstance(raw, int | float):
        return int(raw)
    try:
        return int(raw)
    except ValueError:
        return int(float(raw))


def flat(fields: dict[str, Any]) -> list[Any]:
    return [item for pair in fields.items() for item in pair]


# -- writing -------------------------------------------------------------------


# The header's fixed-width fields: (name, width), in order, each followed by
# one space, then the author (any length) to the end. Numbers are zero-padded
# decimals, so a script compares two of the same width as strings, without
# converting them (list.lua; the cost of that is in docs/BENCHMARKS.md). The
# widths hold every ms time until the year 2286, and a seq of microseconds.
HEADER_FIELDS: Final = (
    ("seq", 17),
    ("ttl", 10),
    ("created", 13),
    ("expires", 13),
    ("due", 13),
    ("claim_expires", 13),
    ("count", 10),
    ("claim", 24),  # a claim id (new_id()), or spaces: none
)


def _offsets() -> dict[str, slice]:
    out, at = {}, 0
    for name, width in HEADER_FIELDS:
        out[name] = slice(at, at + width)
        at += width + 1
    out["author"] = slice(at, None)
    return out


OFFSETS: Final = _offsets()
_SEQ, _TTL, _CREATED, _EXPIRES, _DUE, _CLAIM_EXPIRES, _COUNT, _CLAIM, _AUTHOR = OFFSETS.values()


@dataclass(frozen=True, slots=True)
class Header:
    """Every field of a message but its body, stored as one value (``h``).

    _lib.lua (``header``, ``read_message``) and list.lua read and write the
    same text, laid out by HEADER_FIELDS: fixed-width fields, each followed by
    a space, then the author (a canonical UUID). seq is 0 until indexed."""

    seq: int  # 0 until indexed: the marker
    ttl: int  # s; grows when a claim outlives the message
    created: int  # ms
    expires: int  # ms; the key's PEXPIREAT too
    due: int  # ms before which a delayed message is hidden; 0 = none
    claim_expires: int  # ms
    count: int  # how often it was claimed
    claim: str  # id of the claim holding it, '' = none
    author: str  # client id of the poster (for echo)

    def encode(self) -> str:
        text = (
            f"{self.seq:017d} {self.ttl:010d} {self.created:013d} {self.expires:013d} "
            f"{self.due:013d} {self.claim_expires:013d} {self.count:010d} {self.claim:24} "
            f"{self.author}"
        )
        if len(text) != _AUTHOR.start + len(self.author):
            raise ValueError(f"a field does not fit the message header: {self!r}")
        return text

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        return cls(
            int(raw[_SEQ]),
            int(raw[_TTL]),
            int(raw[_CREATED]),
            int(raw[_EXPIRES]),
            int(raw[_DUE]),
            int(raw[_CLAIM_EXPIRES]),
            int(raw[_COUNT]),
            raw[_CLAIM].rstrip().decode(),
            raw[_AUTHOR].decode(),
        )


def unindexed(author: str) -> str:
    """The header a body is written with before post.lua indexes it (seq 0)."""
    return Header(0, 0, 0, 0, 0, 0, 0, "", author).encode()


def posted(author: str, ttl: int, now: int, seq: int, delay: int, count: int = 0) -> Header:
    """The header of a message when it is indexed (post.lua writes the same)."""
    due = now + delay * 1000 if delay > 0 else 0
    return Header(seq, ttl, now, now + ttl * 1000, due, 0, count, "", author)


def record_fields(header: Header, body: bytes) -> list[Any]:
    """HSET arguments of a whole message record."""
    return [HEADER, header.encode(), BODY, body]


def forget_commands(keys: QueueKeys, ids: Sequence[Any]) -> list[Command]:
    """The writes that remove messages and their index entries (_lib.lua's forget)."""
    return [
        ("DEL", *(keys.message(text(i)) for i in ids)),
        ("ZREM", keys.index, *ids),
        ("ZREM", keys.expiry, *ids),
        ("ZREM", keys.claimed, *ids),
    ]


def claim_extension(expires: int, created: int, claim_expires: int, grace: int) -> tuple[int, int]:
    """A claimed message's new (expires ms, ttl s): it lives at least until the
    claim expires plus grace, never shorter than it would have (claim.lua's
    extend_for_claim is the same rule)."""
    keep = max(expires, claim_expires + grace * 1000)
    return keep, round((keep - created) / 1000)


def rewrite_commands(key: str, row: Row, header: Header) -> list[Command]:
    """Store a message's new header; a legacy record moves to the new layout
    (its legacy fields deleted in the same transaction)."""
    commands: list[Command] = [("HSET", key, HEADER, header.encode())]
    if row.legacy:
        commands.append(("HDEL", key, *LEGACY))
    return commands


def extend_commands(
    keys: QueueKeys,
    row: Row,
    claim_id: str,
    claim_expires: int,
    keep: int,
    ttl: int,
    count: int | None = None,
) -> list[Command]:
    """Hold a message under a claim until claim_expires, alive until keep
    (and set its claim count, for a new claim)."""
    key = keys.message(row.id)
    header = dataclasses.replace(
        row.header(),
        claim=claim_id,
        claim_expires=claim_expires,
        expires=keep,
        ttl=ttl,
        count=row.count if count is None else count,
    )
    return [
        *rewrite_commands(key, row, header),
        ("PEXPIREAT", key, keep),
        ("ZADD", keys.expiry, keep, row.id),
        ("ZADD", keys.claimed, claim_expires, row.id),
    ]


def hold_commands(keys: QueueKeys, row: Row, claim_id: str, claim_expires: int) -> list[Command]:
    """Park a message under a claim (for the dead-letter queue): held, its
    life and count unchanged."""
    header = dataclasses.replace(row.header(), claim=claim_id, claim_expires=claim_expires)
    return [
        *rewrite_commands(keys.message(row.id), row, header),
        ("ZADD", keys.claimed, claim_expires, row.id),
    ]


def release_commands(keys: QueueKeys, row: Row) -> list[Command]:
    """Free a message from its claim."""
    header = dataclasses.replace(row.header(), claim="", claim_expires=0)
    return [
        *rewrite_commands(keys.message(row.id), row, header),
        ("ZREM", keys.claimed, row.id),
    ]


def claim_record(ttl: int, grace: int, now: int, expires: int, ids: Sequence[str]) -> list[Any]:
    """HSET arguments of a claim hash."""
    return [TTL, ttl, GRACE, grace, CREATED, now, CLAIM_EXPIRES, expires, HELD, " ".join(ids)]


# -- reading -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """A message hash as read with HMGET ROW (None: the message is gone),
    in either layout."""

    id: str
    body: bytes
    ttl: int
    created: int
    expires: int
    seq: int | None
    claim: str
    claim_expires: int
    count: int
    author: bytes
    due: int
    legacy: bool = False  # written before the header (see the module docstring)

    @classmethod
    def read(cls, message_id: str, raw: Sequence[Any]) -> Row | None:
        header, body = raw[0], raw[1]
        if body is None:
            return None
        if header is not None:
            h = Header.decode(header)
            return cls(
                message_id,
                body,
                h.ttl,
                h.created,
                h.expires,
                h.seq or None,
                h.claim,
                h.claim_expires,
                h.count,
                h.author.encode(),
                h.due,
            )
        ttl, created, expires, seq, claim, claim_expires, count, author, due = raw[2:]
        if expires is None:
            return None
        return cls(
            message_id,
            body,
            int(ttl or 0),
            int(created or 0),
            int(expires),
            None if seq is None else parse_seq(seq),
            text(claim) if claim else "",
            int(claim_expires or 0),
            int(count or 0),
            author or b"",
            int(due or 0),
            legacy=True,
        )

    def header(self) -> Header:
        return Header(
            self.seq or 0,
            self.ttl,
            self.created,
            self.expires,
            self.due,
            self.claim_expires,
            self.count,
            self.claim,
            self.author.decode(),
        )

    def alive(self, now: int) -> bool:
        """Indexed and not expired."""
        return self.seq is not None and self.expires > now

    def claimed(self, now: int) -> bool:
        return bool(self.claim) and self.claim_expires > now

    def free(self, now: int) -> bool:
        """Claimable or poppable: alive, due, and held by no live claim."""
        return self.alive(now) and self.due <= now and not self.claimed(now)

    def message(self, now: int) -> Message:
        assert self.seq is not None
        return Message(
            id=self.id,
            seq=self.seq,
            body=self.body,
            ttl=self.ttl,
            created_ms=self.created,
            claim_id=self.claim if self.claimed(now) else None,
            claim_count=self.count,
            author=self.author.decode(),
        )


def live_message(message_id: str, raw: Sequence[Any], now: int) -> Message | None:
    """The message an HMGET ROW reply describes, if it is alive."""
    row = Row.read(message_id, raw)
    return row.message(now) if row is not None and row.alive(now) else None


def holder(raw: Sequence[Any]) -> str:
    """The claim id holding a message ('' = none), from an HMGET HOLDER reply."""
    header, legacy = raw
    if header is not None:
        return Header.decode(header).claim
    return text(legacy) if legacy else ""


def summary(raw: Sequence[Any]) -> tuple[int, int] | None:
    """(created, expires) ms of a message, from an HMGET SUMMARY reply; None if gone."""
    header, created, expires = raw
    if header is not None:
        h = Header.decode(header)
        return (h.created, h.expires) if h.seq else None
    if expires is None:
        return None
    return int(created or 0), int(expires)


@dataclass(frozen=True, slots=True)
class Parked:
    """A message a claim set aside for the dead-letter queue (see claim_upkeep.py)."""

    id: str
    body: bytes
    author: bytes
    ttl: int  # its ttl in the dead-letter queue
    count: int  # how often it was claimed


def _message(
    out: list[Any], i: int, claim_id: str | None = None, count: int = 0, author: str | None = None
) -> Message:
    """The five fields every script reply starts a message with: id, seq,
    body, ttl, created."""
    # positional: one of these per message of every page
    return Message(
        text(out[i]),  # id
        parse_seq(out[i + 1]),  # seq
        out[i + 2],  # body
        int(out[i + 3]),  # ttl
        int(out[i + 4]),  # created_ms
        claim_id,
        count,  # claim_count
        author,
    )


def list_reply(out: list[Any], now: int, with_authors: bool) -> MessagePage:
    """list.lua: {next marker or '', then id, header, body...}; now is the
    time the script was given (a claim is shown only while it lasts)."""
    messages = []
    for i in range(1, len(out), 3):
        # inline slices of the header: one of these per message of every page
        h = out[i + 1]
        claim = h[_CLAIM].rstrip()
        messages.append(
            Message(
                out[i].decode(),
                int(h[_SEQ]),
                out[i + 2],
                int(h[_TTL]),
                int(h[_CREATED]),
                claim.decode() if claim and int(h[_CLAIM_EXPIRES]) > now else None,
                int(h[_COUNT]),
                h[_AUTHOR].decode() if with_authors else None,
            )
        )
    return MessagePage(messages, parse_seq(out[0]) if out[0] else None)


def claim_reply(
    out: list[Any], claim_id: str, ttl: int, grace: int, now: int
) -> tuple[Claim | None, list[Parked]]:
    """claim.lua: {claim id or '', parked count, parked (id, body, author, ttl,
    count)..., claimed (id, seq, body, ttl, created, count)...}."""
    start = 2 + 5 * int(out[1])
    parked = [
        Parked(text(out[i]), out[i + 1], out[i + 2], int(out[i + 3]), int(out[i + 4]))
        for i in range(2, start, 5)
    ]
    if not out[0]:
        return None, parked
    messages = [_message(out, i, claim_id, int(out[i + 5])) for i in range(start, len(out), 6)]
    return Claim(claim_id, ttl, grace, now, messages), parked


def pop_reply(out: list[Any]) -> list[Message]:
    """pop.lua: {id, seq, body, ttl, created...}."""
    return [_message(out, i) for i in range(0, len(out), 5)]


# -- notifications on a queue's feed channel -------------------------------------

ENDED: Final = b"end"


def notification(seq: int, due: int) -> str:
    """What a post publishes: the last seq it indexed, and the earliest time
    (ms) one of its delayed messages becomes visible (0: none). _lib.lua's
    notify writes the same."""
    return f"{seq} {due}"


@dataclass(frozen=True, slots=True)
class Notification:
    seq: int = 0
    due: int = 0
    ended: bool = False  # the queue was deleted

    @classmethod
    def read(cls, data: bytes) -> Notification:
        if data == ENDED:
            return cls(ended=True)
        seq, _, due = data.partition(b" ")
        return cls(int(seq), int(due or 0))


def pairs(reply: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Field/value or member/score pairs: RESP2 answers a flat list, RESP3 a list of pairs."""
    if reply and isinstance(reply[0], list):
        return [(a, b) for a, b in reply]
    return list(zip(reply[::2], reply[1::2], strict=True))
