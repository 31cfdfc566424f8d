"""The stored records, written and read in one place: the codec.

This module owns the layout of a message (``Q:r:<id>``), a claim hash
(``Q:c:<claim id>``) and a queue hash (``Q:q``): their field names, the
record written when a message is posted, the commands that forget a
message, the rule by which a claim extends a message's life, and one
decoder per shape of reply (a message read, and each script's reply).

A message is one string: its *header*, every field but the body in fixed-
width text (:data:`HEADER_FIELDS`: seq ttl created expires due claim-expires
claim-count claim-id, zero-padded and each followed by a space; seq 0 until
the message is indexed), the author (its client id), the message's headers
if it has any (a space, then the JSON object as :func:`Header.record` writes
it, see below), a newline, and the body. One string because the list script
then reads a page of messages with one MGET instead of an HMGET of nine
fields per message, compares the fields it filters on as fixed-width strings
instead of converting each with tonumber(), and answers two reply elements
per message instead of seven: each command, field and conversion costs Redis
a fraction of a microsecond, and a page of ten had about 150 of them
(docs/BENCHMARKS.md, "The list script's Redis cost"). What a claim changes
(claim id and expiry, count, expiry, ttl) is all in the fixed-width part:
one SETRANGE at offset 0 rewrites it, in the script or transaction that read
it, so it stays atomic and the body is never rewritten.

A message's *headers* (``"headers"`` of a post, docs/consumers.md) travel
on the author's line, after one space: an author is a client id (a UUID,
never a space in it) and the headers are orjson's encoding of an object of
strings, which never holds a raw newline. So a script that rewrites a
record whole (``_lib.lua``'s ``record``) keeps them without knowing they
are there, and the scripts hand the whole line back where a message leaves
them (claim, pop, a parked dead letter); Python splits it
(:func:`split_author`) and keeps the headers beside the author
(:attr:`Header.headers`, :attr:`Row.headers`, :attr:`Parked.headers`), so a
message copied elsewhere (a dead letter, a redrive) is written with them.
The body stays the record's tail (a sealed body is still recognised by its
first bytes), and list.lua's echo filter accepts a space after the author as
well as a newline. Headers are never sealed, even in an encrypted queue:
they are routing and tracing data the service itself reads (``traceparent``
for span links and webhook requests), and the scripts cannot decrypt.
A message's ordered *group* rides there too: the author line is
``<client id>[ g=<group>][ <headers>]`` (:func:`author_line`).

Upgrade: releases before this one stored a message as a hash under another
key, ``Q:m:<id>``, a field each (:data:`ROW`: b t c e s k x n u d). Those
*legacy* records are still read everywhere a message is read: Python reads
both keys (:func:`read_commands`, :meth:`Row.read`), the scripts fall back
to the hash when the string is missing (``_lib.lua``'s ``read_message``,
list.lua). Every write to a message (a claim, its renewal or release,
parking) moves a legacy record to the new key in the new layout and deletes
the hash in the same script or transaction, so records migrate lazily and
atomically; forgetting a message deletes both keys. A legacy record nobody
writes expires with its ttl: once a release has run for the longest message
ttl plus delay, none is left and the legacy reads can go. Two keys rather
than one key of two types, because a read of the wrong type is an error
that would abort a script's MGET or a WATCH transaction's reads.

The Lua scripts read and write the same records. They do not spell the
field names out: :func:`lua_constants` names them (``F_BODY`` is ``'b'``
...) from :data:`LUA_NAMES`, and the header's positions (``H_SEQ`` ...), and
``scripts.py`` writes the values in where a script names them when it is
loaded, so a change here is a change everywhere. A test fails if a script spells a field
name itself (``tests/test_record.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from feedsvc.storage import segments
from feedsvc.storage.base import RESERVED_FIELDS, Claim, Message, MessagePage, Unclaimable
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import (
    CLAIM_INDEX_SUFFIX,
    CLAIM_INFIX,
    FEED_SUFFIX,
    GROUP_ENTRY,
    GROUP_INFIX,
    IDEMPOTENCY_SUFFIX,
    MESSAGE_INFIX,
    META_SUFFIX,
    RECORD_INFIX,
    QueueKeys,
)

# -- the legacy message hash (read, never written; see the docstring) -----------
# some of its names are the claim and queue hashes' field names too
BODY: Final = "b"  # the JSON body, returned verbatim
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
SEQ_BASE: Final = "sb"  # where the seq counter started: no message has a seq at or below it
GROUPS_SINCE: Final = "gs"  # seq of the queue's first grouped message: claims scan Q:ci from it
# and the reserved settings the scripts honour, as plain fields
DEFAULT_TTL: Final = RESERVED_FIELDS["_default_message_ttl"]
DEFAULT_DELAY: Final = RESERVED_FIELDS["_default_message_delay"]
MAX_POST_SIZE: Final = RESERVED_FIELDS["_max_messages_post_size"]
MAX_MESSAGES: Final = RESERVED_FIELDS["_max_messages"]
MAX_CLAIMS: Final = RESERVED_FIELDS["_max_claim_count"]
DEAD_LETTER_QUEUE: Final = RESERVED_FIELDS["_dead_letter_queue"]
DEAD_LETTER_TTL: Final = RESERVED_FIELDS["_dead_letter_queue_messages_ttl"]
ENCRYPTED: Final = RESERVED_FIELDS["_enable_encrypt_messages"]  # "1": post bodies sealed
DEAD_LETTER_SETTINGS: Final = (MAX_CLAIMS, DEAD_LETTER_QUEUE, DEAD_LETTER_TTL)
POST_SETTINGS: Final = (DEFAULT_TTL, DEFAULT_DELAY, MAX_POST_SIZE, ENCRYPTED, MAX_MESSAGES)

# The fields of a legacy message hash, in this order, wherever one is read.
ROW: Final = (BODY, TTL, CREATED, EXPIRES, SEQ, CLAIM, CLAIM_EXPIRES, CLAIM_COUNT, AUTHOR, DUE)

LUA_NAMES: Final = {
    "F_BODY": BODY,
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
    "F_SEQ_BASE": SEQ_BASE,
    "F_DEFAULT_TTL": DEFAULT_TTL,
    "F_DEFAULT_DELAY": DEFAULT_DELAY,
    "F_MAX_POST_SIZE": MAX_POST_SIZE,
    "F_MAX_MESSAGES": MAX_MESSAGES,
    "F_MAX_CLAIMS": MAX_CLAIMS,
    "F_DEAD_LETTER_QUEUE": DEAD_LETTER_QUEUE,
    "F_DEAD_LETTER_TTL": DEAD_LETTER_TTL,
    "F_ENCRYPTED": ENCRYPTED,
    "F_GROUPS_SINCE": GROUPS_SINCE,
    # and the key suffixes of keys.py, which scripts build keys with
    "S_META": META_SUFFIX,
    "S_MESSAGE": MESSAGE_INFIX,
    "S_RECORD": RECORD_INFIX,
    "S_CLAIM": CLAIM_INFIX,
    "S_IDEMPOTENCY": IDEMPOTENCY_SUFFIX,
    "S_FEED": FEED_SUFFIX,
    "S_CLAIM_INDEX": CLAIM_INDEX_SUFFIX,
    "S_GROUP": GROUP_INFIX,
    "GROUP_ENTRY": GROUP_ENTRY,
}


def lua_header_names() -> dict[str, str]:
    """The Lua names that lay out a message header: H_<FIELD> and
    H_<FIELD>_END, its first and last position (Lua counts from 1), H_AUTHOR
    where the author starts, HEADER_FORMAT, the string.format of the
    fixed-width part (up to the author), H_MS_FORMAT, of a time in it,
    H_HEADERS_SEPARATOR, what comes between the author and a message's headers,
    and H_GROUP_MARK, what comes between the author and a message's group."""
    names = {}
    for name, width in HEADER_FIELDS:
        at = OFFSETS[name]
        names[f"H_{name.upper()}"] = str(at.start + 1)
        names[f"H_{name.upper()}_END"] = str(at.start + width)
    names["H_AUTHOR"] = str(OFFSETS["author"].start + 1)
    formats = [f"%-{w}s" if name == "claim" else f"%0{w}d" for name, w in HEADER_FIELDS]
    names["HEADER_FORMAT"] = repr("".join(f + " " for f in formats))
    names["H_MS_FORMAT"] = repr(formats[[n for n, _ in HEADER_FIELDS].index("expires")])
    names["H_HEADERS_SEPARATOR"] = repr(HEADERS_SEPARATOR.decode())
    names["H_GROUP_MARK"] = repr((HEADERS_SEPARATOR + GROUP_MARK).decode())
    return names


def lua_constants() -> dict[str, str]:
    """The names the scripts use for every field and key suffix, the
    message header's layout and the segment layout's: name -> its value,
    a Lua literal (scripts.py writes it in where a script names it)."""
    names = {name: f"'{field}'" for name, field in LUA_NAMES.items()}
    return {**names, **lua_header_names(), **segments.lua_names()}


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
# one space, then the author up to a newline, then the body. Numbers are
# zero-padded decimals, so a script compares two of the same width as
# strings, without converting them (list.lua). The widths hold every ms time
# until the year 2286, and a seq of microseconds.
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
NEWLINE: Final = b"\n"  # ends the author (and headers); the body follows
HEADERS_SEPARATOR: Final = b" "  # between the author and a message's headers
GROUP_MARK: Final = b"g="  # after the author and a space: the message's group follows
SPACE: Final = ord(" ")  # the first byte of the claim field when no claim holds it


def _offsets() -> dict[str, slice]:
    out, at = {}, 0
    for name, width in HEADER_FIELDS:
        out[name] = slice(at, at + width)
        at += width + 1
    out["author"] = slice(at, None)
    return out


OFFSETS: Final = _offsets()
_SEQ, _TTL, _CREATED, _EXPIRES, _DUE, _CLAIM_EXPIRES, _COUNT, _CLAIM, _AUTHOR = OFFSETS.values()
FIXED: Final = _AUTHOR.start  # the length of the fixed-width part


@dataclass(frozen=True, slots=True)
class Header:
    """Every field of a message but its body: the start of its record.

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
    headers: bytes = b""  # the message's headers, a JSON object; b"" = none
    group: str = ""  # the message's ordered group; "" = none

    def fixed(self) -> bytes:
        """The fixed-width part: what a write after the post rewrites (SETRANGE 0)."""
        text = (
            f"{self.seq:017d} {self.ttl:010d} {self.created:013d} {self.expires:013d} "
            f"{self.due:013d} {self.claim_expires:013d} {self.count:010d} {self.claim:24} "
        )
        if len(text) != FIXED:
            raise ValueError(f"a field does not fit the message header: {self!r}")
        return text.encode()

    def record(self, body: bytes) -> bytes:
        """The whole message record."""
        return self.fixed() + author_line(self.author, self.headers, self.group) + NEWLINE + body

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        """The header at the start of a record (or of a GETRANGE of one)."""
        end = raw.find(NEWLINE, FIXED)
        author, group, headers = split_author(raw[FIXED : None if end < 0 else end])
        return cls(
            int(raw[_SEQ]),
            int(raw[_TTL]),
            int(raw[_CREATED]),
            int(raw[_EXPIRES]),
            int(raw[_DUE]),
            int(raw[_CLAIM_EXPIRES]),
            int(raw[_COUNT]),
            raw[_CLAIM].rstrip().decode(),
            author.decode(),
            headers,
            group,
        )


def author_line(author: str, headers: bytes, group: str = "") -> bytes:
    """What follows a record's fixed part up to the newline: the author, then
    a message's group after a space and GROUP_MARK, then its headers after
    a space, each if it has them (a group holds no space, headers never
    start with GROUP_MARK: they are a JSON object)."""
    line = author.encode()
    if group:
        line += HEADERS_SEPARATOR + GROUP_MARK + group.encode()
    if headers:
        line += HEADERS_SEPARATOR + headers
    return line


def split_author(line: bytes) -> tuple[bytes, str, bytes]:
    """(author, group, headers) of an author line ("" group, b"" headers: none)."""
    author, _, rest = line.partition(HEADERS_SEPARATOR)
    if not rest.startswith(GROUP_MARK):
        return author, "", rest
    group, _, headers = rest[len(GROUP_MARK) :].partition(HEADERS_SEPARATOR)
    return author, group.decode(), headers


def unindexed(author: str, body: bytes, headers: bytes = b"", group: str = "") -> bytes:
    """The record a body is written as before post.lua indexes it (seq 0)."""
    # the same as Header(0, 0, 0, 0, 0, 0, 0, "", author, headers, group).record(body),
    # whose fixed part, all zeros, is made once (formatting it cost each post 2.6 µs)
    return _UNINDEXED + author_line(author, headers, group) + NEWLINE + body


_UNINDEXED: Final = Header(0, 0, 0, 0, 0, 0, 0, "", "").fixed()


def posted(
    author: str,
    ttl: int,
    now: int,
    seq: int,
    delay: int,
    count: int = 0,
    headers: bytes = b"",
    group: str = "",
) -> Header:
    """The header of a message when it is indexed (post.lua writes the same)."""
    due = now + delay * 1000 if delay > 0 else 0
    return Header(seq, ttl, now, now + ttl * 1000, due, 0, count, "", author, headers, group)


def post_commands(keys: QueueKeys, message_id: str, header: Header, body: bytes) -> list[Command]:
    """The writes of an indexed message's record (the watch driver's post,
    a dead-letter copy); the caller adds the index entries."""
    key = keys.record(message_id)
    return [("SET", key, header.record(body)), ("PEXPIREAT", key, header.expires)]


def body_commands(
    keys: QueueKeys,
    message_id: str,
    author: str,
    body: bytes,
    orphan_ttl: int,
    headers: bytes = b"",
    group: str = "",
) -> list[Command]:
    """A body written ahead of its indexing (the lua driver's pipeline, the
    tuned watch driver's write before WATCH): the record with seq 0, which
    nothing reads as a message, expiring by itself after orphan_ttl seconds
    unless indexing sets its exact expiry."""
    record = unindexed(author, body, headers, group)
    return [("SET", keys.record(message_id), record, "EX", orphan_ttl)]


def header_commands(keys: QueueKeys, message_id: str, header: Header) -> list[Command]:
    """Index a body written ahead (:func:`body_commands`, which the caller
    checked exists): its header in place and the key's exact expiry."""
    key = keys.record(message_id)
    return [("SETRANGE", key, 0, header.fixed()), ("PEXPIREAT", key, header.expires)]


def index_commands(keys: QueueKeys, message_id: str, header: Header) -> list[Command]:
    """A message's index entries (post.lua writes the same): by seq, by expiry."""
    return [
        ("ZADD", keys.index, header.seq, message_id),
        ("ZADD", keys.expiry, header.expires, message_id),
    ]


def forget_commands(keys: QueueKeys, ids: Sequence[Any]) -> list[Command]:
    """The writes that remove messages (either layout) and their index
    entries (_lib.lua's forget)."""
    return [
        ("DEL", *(k for i in ids for k in message_keys(keys, text(i)))),
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


def rewrite_commands(keys: QueueKeys, row: Row, header: Header) -> list[Command]:
    """Store a message's new header; a legacy record moves to the new layout
    (its hash deleted in the same transaction)."""
    key = keys.record(row.id)
    if not row.legacy:
        return [("SETRANGE", key, 0, header.fixed())]
    return [
        ("SET", key, header.record(row.body)),
        ("PEXPIREAT", key, header.expires),
        ("DEL", keys.message(row.id)),
    ]


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
    key = keys.record(row.id)
    header = dataclasses.replace(
        row.header(),
        claim=claim_id,
        claim_expires=claim_expires,
        expires=keep,
        ttl=ttl,
        count=row.count if count is None else count,
    )
    return [
        *rewrite_commands(keys, row, header),
        ("PEXPIREAT", key, keep),
        ("ZADD", keys.expiry, keep, row.id),
        ("ZADD", keys.claimed, claim_expires, row.id),
    ]


def hold_commands(keys: QueueKeys, row: Row, claim_id: str, claim_expires: int) -> list[Command]:
    """Park a message under a claim (for the dead-letter queue): held, its
    life and count unchanged."""
    header = dataclasses.replace(row.header(), claim=claim_id, claim_expires=claim_expires)
    return [
        *rewrite_commands(keys, row, header),
        ("ZADD", keys.claimed, claim_expires, row.id),
    ]


def release_commands(keys: QueueKeys, row: Row) -> list[Command]:
    """Free a message from its claim."""
    header = dataclasses.replace(row.header(), claim="", claim_expires=0)
    return [
        *rewrite_commands(keys, row, header),
        ("ZREM", keys.claimed, row.id),
    ]


def requeue_commands(keys: QueueKeys, row: Row, due: int) -> list[Command]:
    """Free one message from its claim, hidden until due (ms; 0: free at
    once), its life and claim count kept (a release of one message)."""
    header = dataclasses.replace(row.header(), claim="", claim_expires=0, due=due)
    return [
        *rewrite_commands(keys, row, header),
        ("ZREM", keys.claimed, row.id),
    ]


def claim_record(ttl: int, grace: int, now: int, expires: int, ids: Sequence[str]) -> list[Any]:
    """HSET arguments of a claim hash."""
    return [TTL, ttl, GRACE, grace, CREATED, now, CLAIM_EXPIRES, expires, HELD, " ".join(ids)]


# -- reading -------------------------------------------------------------------


def message_keys(keys: QueueKeys, message_id: str) -> list[str]:
    """The keys a message may live under: its record, its legacy hash."""
    return [keys.record(message_id), keys.message(message_id)]


def read_commands(keys: QueueKeys, ids: Sequence[str]) -> list[Command]:
    """The reads of messages in either layout: two replies per message, for rows()."""
    commands: list[Command] = []
    for i in ids:
        commands += [("GET", keys.record(i)), ("HMGET", keys.message(i), *ROW)]
    return commands


def rows(ids: Sequence[str], replies: Sequence[Any]) -> list[Row | None]:
    """The messages read_commands(ids) read (None: gone)."""
    return [Row.read(i, replies[2 * n], replies[2 * n + 1]) for n, i in enumerate(ids)]


def live_messages(ids: Sequence[str], replies: Sequence[Any], now: int) -> list[Message | None]:
    """The messages read_commands(ids) read, those alive (else None)."""
    return [None if m is None or not m.alive(now) else m.message(now) for m in rows(ids, replies)]


@dataclass(frozen=True, slots=True)
class Row:
    """A message as read_commands read it (None: the message is gone), in
    either layout."""

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
    legacy: bool = False  # read from the legacy hash (see the module docstring)
    headers: bytes = b""  # the message's headers, a JSON object; b"" = none (legacy: always)
    group: str = ""  # the message's ordered group; "" = none (legacy: always)

    @classmethod
    def read(cls, message_id: str, record: bytes | None, legacy: Sequence[Any]) -> Row | None:
        """A message from its record (a GET) or else its legacy hash (HMGET ROW)."""
        if record is not None:
            h = Header.decode(record)
            return cls(
                message_id,
                record[record.index(NEWLINE, FIXED) + 1 :],
                h.ttl,
                h.created,
                h.expires,
                h.seq or None,
                h.claim,
                h.claim_expires,
                h.count,
                h.author.encode(),
                h.due,
                headers=h.headers,
                group=h.group,
            )
        body = legacy[0]
        if body is None:
            return None
        ttl, created, expires, seq, claim, claim_expires, count, author, due = legacy[1:]
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
            self.headers,
            self.group,
        )

    def alive(self, now: int) -> bool:
        """Indexed and not expired."""
        return self.seq is not None and self.expires > now

    def claimed(self, now: int) -> bool:
        return bool(self.claim) and self.claim_expires > now

    def free(self, now: int) -> bool:
        """Claimable or poppable: alive, due, and held by no live claim."""
        return self.alive(now) and self.due <= now and not self.claimed(now)

    def free_at(self, now: int) -> int | None:
        """When a message not free now becomes free by itself (it falls due,
        its claim expires), if it is still alive then; None: never, or it is
        free already. _lib.lua's free_at is the same rule."""
        if not self.alive(now):
            return None
        at = max(self.due, self.claim_expires if self.claim else 0)
        return at if now < at < self.expires else None

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
            headers=self.headers or None,
            group=self.group or None,
        )


def holder_commands(keys: QueueKeys, message_id: str) -> list[Command]:
    """The reads of the claim holding a message, for holder()."""
    claim = OFFSETS["claim"]
    return [
        ("GETRANGE", keys.record(message_id), claim.start, claim.stop - 1),
        ("HGET", keys.message(message_id), CLAIM),
    ]


def holder(record: bytes, legacy: bytes | None) -> str:
    """The claim id holding a message ('' = none) from holder_commands' replies."""
    if record:
        return record.rstrip().decode()
    return text(legacy) if legacy else ""


def summary_commands(keys: QueueKeys, message_id: str) -> list[Command]:
    """The reads of a message's creation and expiry, for summary()."""
    return [
        ("GETRANGE", keys.record(message_id), 0, FIXED - 1),
        ("HMGET", keys.message(message_id), CREATED, EXPIRES, SEQ),
    ]


def summary(record: bytes, legacy: Sequence[Any]) -> tuple[int, int] | None:
    """(created, expires) ms of an indexed message from summary_commands'
    replies; None if gone."""
    if record:
        h = Header.decode(record)
        return (h.created, h.expires) if h.seq else None
    created, expires, seq = legacy
    if expires is None or seq is None:
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
    headers: bytes = b""  # the message's headers (b"": none): a copy keeps them
    group: str = ""  # the message's ordered group ("": none): a copy keeps it


def _message(
    out: list[Any], i: int, line: bytes, claim_id: str | None = None, count: int = 0
) -> Message:
    """The five fields every script reply starts a message with: id, seq,
    body, ttl, created; line is the message's author line (its headers)."""
    # positional: one of these per message of every page
    _, group, headers = split_author(line)
    return Message(
        text(out[i]),  # id
        parse_seq(out[i + 1]),  # seq
        out[i + 2],  # body
        int(out[i + 3]),  # ttl
        int(out[i + 4]),  # created_ms
        claim_id,
        count,  # claim_count
        None,  # author
        headers or None,
        group or None,
    )


def list_reply(out: list[Any], now: int, with_authors: bool) -> MessagePage:
    """list.lua: {next marker or '', next due or '', claim ends or '', missed,
    passed or '', then id, record...}; now is the time the script was given
    (a claim is shown only while it lasts)."""
    return MessagePage(
        listed(out, 5, now, with_authors),
        parse_seq(out[0]) if out[0] else None,
        int(out[1]) if out[1] else None,
        int(out[2]) if out[2] else None,
        int(out[3]),
        parse_seq(out[4]) if out[4] else None,
    )


def listed(out: list[Any], start: int, now: int, with_authors: bool) -> list[Message]:
    """The messages of list.lua's reply out (id, record...) from start on."""
    messages = []
    for i in range(start, len(out), 2):
        # inline slices of the record: one of these per message of every page
        rec = out[i + 1]
        end = rec.index(NEWLINE, FIXED)
        held = rec[_CLAIM.start] != SPACE and int(rec[_CLAIM_EXPIRES]) > now
        gap = rec.find(HEADERS_SEPARATOR, FIXED, end)  # -1: no headers, no group
        group, headers = None, None if gap < 0 else rec[gap + 1 : end]
        if headers is not None and headers.startswith(GROUP_MARK):
            _, group, headers = split_author(rec[FIXED:end])
        messages.append(
            Message(
                out[i].decode(),
                int(rec[_SEQ]),
                rec[end + 1 :],
                int(rec[_TTL]),
                int(rec[_CREATED]),
                rec[_CLAIM].rstrip().decode() if held else None,
                int(rec[_COUNT]),
                rec[FIXED : end if gap < 0 else gap].decode() if with_authors else None,
                headers or None,
                group,
            )
        )
    return messages


def claim_reply(
    out: list[Any], claim_id: str, ttl: int, grace: int, now: int
) -> tuple[Claim | Unclaimable, list[Parked]]:
    """claim.lua: {claim id or '', parked count, free at or '', parked (id,
    body, author line, ttl, count)..., claimed (id, seq, body, ttl, created,
    count, author line)...}."""
    start = 3 + 5 * int(out[1])
    parked = []
    for i in range(3, start, 5):
        author, group, headers = split_author(out[i + 2])
        parked.append(
            Parked(
                text(out[i]), out[i + 1], author, int(out[i + 3]), int(out[i + 4]), headers, group
            )
        )
    if not out[0]:
        return Unclaimable(int(out[2]) if out[2] else None), parked
    messages = [
        _message(out, i, out[i + 6], claim_id, int(out[i + 5])) for i in range(start, len(out), 7)
    ]
    return Claim(claim_id, ttl, grace, now, messages), parked


def pop_reply(out: list[Any]) -> list[Message]:
    """pop.lua's messages: {id, seq, body, ttl, created, author line...}
    (its reply less the review it leads with)."""
    return [_message(out, i, out[i + 5]) for i in range(0, len(out), 6)]


# -- notifications on a queue's feed channel -------------------------------------

ENDED: Final = b"end"


def notification(seq: int, due: int) -> str:
    """What a post publishes: the last seq it indexed, and the earliest time
    (ms) one of its delayed messages becomes visible (0: none). _lib.lua's
    notify writes the same."""
    return f"{seq} {due}"


#: What a release publishes: nothing new was indexed, but messages were
#: freed (claim waits and readers of claimed messages re-read).
FREED: Final = notification(0, 0)


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
