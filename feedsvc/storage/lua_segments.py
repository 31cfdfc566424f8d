"""The lua driver's side of the segment layout (storage/segments.py).

Its post (``post_segments.lua``: the arguments, the answer; the posts to a
queue that arrive while its previous call is in flight go together in the
next, through a :class:`~feedsvc.storage.combiner.Combiner`) and its thin
read (``read_segments.lua``), whose replies ``segment_pages.py`` turns into
pages; a page list.lua began in the older layout is carried on here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from feedsvc.clock import Clock
from feedsvc.config import StoreSettings
from feedsvc.errors import FeedError, StorageUnavailable
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import ListQuery, MessagePage, NewMessage
from feedsvc.storage.coalescer import Command
from feedsvc.storage.combiner import Combiner
from feedsvc.storage.keys import FeedSpace, Kind, QueueKeys
from feedsvc.storage.known_tables import KnownTables, read_known, seed_key
from feedsvc.storage.quotas import Reservation
from feedsvc.storage.redis_store import idempotency_token, post_too_large, queue_full
from feedsvc.storage.scripts import LuaScript, load_script
from feedsvc.storage.sealing import MustSeal
from feedsvc.storage.segment_pages import PageScan, scan_segments
from feedsvc.storage.sweep_schedule import SweepSchedule
from feedsvc.storage.transport import Transport

log = logging.getLogger("feedsvc")

#: LuaStore._script: (script, keys, args, idempotent) -> its reply
RunScript = Callable[[LuaScript, list[str], list[Any], bool], Awaitable[Any]]
#: LuaStore._script_reply: (script, keys, args, reply as sent back) -> its reply
ScriptReply = Callable[[LuaScript, list[str], list[Any], Any], Awaitable[Any]]


def _flag(value: bool) -> str:
    return "1" if value else "0"


@dataclass(frozen=True, slots=True)
class SegmentPost:
    """What a post writes (LuaStore._post's arguments)."""

    keys: QueueKeys
    project: str
    queue: str
    client_id: str
    messages: list[NewMessage]
    request_size: int
    sealed: bool
    held: Reservation | None


#: A call of post_segments.lua takes at most this many posts, with at most
#: MAX_CALL_MESSAGES messages and MAX_CALL_BYTES of bodies between them (a
#: single post over a bound goes alone); the rest wait for the next call.
#: Redis runs nothing else while a script runs: a call of 100 one-message
#: posts costs ≈ 0.3 ms of its time, ≈ 3 µs a message against ≈ 15 µs for
#: a call of one (docs/design-compact-storage.md), so past a few dozen
#: posts a bigger call saves little and only holds every other client
#: longer. 100 messages span at most two segments; 1 MiB of bodies is
#: copied by the segment's APPEND in well under a millisecond. One
#: process's posts in flight to one queue rarely reach these bounds (the
#: bench keeps 32): they matter for a burst.
MAX_CALL_POSTS = 64
MAX_CALL_MESSAGES = 100
MAX_CALL_BYTES = 1 << 20

#: a queue's default ttl and delay as its hash holds them ('' = unset): what a
#: post's records are built with (post_segments.lua checks them)
Defaults = tuple[str, str]
NO_DEFAULTS: Defaults = ("", "")
#: in place of the defaults when no message of a call takes one: not checked
UNCHECKED: Defaults = ("-", "")
#: calls a post makes at most while its queue's defaults change under it
DEFAULTS_READS = 3

#: a post on its way to the combiner: what it writes, its idempotency token ('' = none)
Pending = tuple[SegmentPost, str]
#: what a post comes to: its ids, or the exception its request gets
Outcome = list[str] | Exception


class LuaSegments(FeedSpace):
    def __init__(
        self,
        kind: Kind,
        transport: Transport,
        settings: StoreSettings,
        clock: Clock,
        run: RunScript,
        reply: ScriptReply,
        sweeps: SweepSchedule | None = None,
    ) -> None:
        super().__init__(kind)
        self._transport, self._settings, self._clock = transport, settings, clock
        self._run, self._reply = run, reply
        self._sweeps = sweeps
        self._tables = KnownTables()
        # each queue's defaults as its last post learnt them (by key prefix)
        self._defaults: dict[str, Defaults] = {}
        self._combiner: Combiner[Pending, list[str]] = Combiner(
            self._combined, MAX_CALL_POSTS, self._cut
        )

    def refused(self, queue: str, reply: list[Any]) -> None:
        """Raise what a post script's refusal says (a replay is no refusal)."""
        if reply and reply[0] == b"seal":
            raise MustSeal
        if reply and reply[0] == b"toolarge":
            raise post_too_large(self._noun, queue, reply[1])
        if reply and reply[0] == b"full":
            raise queue_full(self._noun, queue, reply[1])

    async def post(
        self, post: SegmentPost, idempotency_key: str | None, may_switch: bool
    ) -> list[str] | None:
        """The post's ids, or None if the queue has no segments and
        may_switch is off (then nothing was done). With may_switch on, it
        goes through the combiner: with the other posts to its queue that
        arrived while the queue's previous call was in flight."""
        token = (
            "" if idempotency_key is None else idempotency_token(post.client_id, idempotency_key)
        )
        if may_switch:
            return await self._combiner.submit(post.keys.prefix, (post, token))
        outcomes = await self._call([(post, token)], False)
        if outcomes is None:
            return None
        [outcome] = outcomes
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def close(self) -> None:
        """Stop the combiner (posts still waiting for it are cancelled)."""
        await self._combiner.close()

    async def _combined(self, prefix: str, batch: list[Pending]) -> list[Outcome]:
        self._transport.counters.posts_combined += len(batch) - 1
        outcomes = await self._call(batch, True)
        assert outcomes is not None  # a call that may switch always posts
        return outcomes

    async def _call(self, batch: list[Pending], may_switch: bool) -> list[Outcome] | None:
        """post_segments.lua for the posts of batch (all to one queue): per
        post its ids or the exception its request gets; None if the queue
        has no segments and may_switch is off (then nothing was done). The
        records are built here with the queue's default ttl and delay as
        this process last saw them; the script refuses them if those changed
        (it answers the new ones), and they are built again."""
        script = load_script("post_segments")
        first = batch[0][0]
        tag = seg.id_tag(first.keys.prefix)
        defaults = self._defaults.get(first.keys.prefix, NO_DEFAULTS)
        for _ in range(DEFAULTS_READS):
            all_keys, args = self._post_args(batch, may_switch, defaults)
            replies = await self._transport.call(
                [
                    ("ZADD", self._registry(first.project), 0, first.queue),
                    ("EVALSHA", script.sha, len(all_keys), *all_keys, *args),
                ]
            )
            # as LuaStore._post: once the script has written, the posts are stored
            # (a failed registry ZADD is made good by the next post)
            reply = await self._reply(script, all_keys, args, replies[-1])
            if not reply or reply[0] != b"defaults":
                break
            defaults = (reply[1].decode(), reply[2].decode())
            if len(self._defaults) >= 10_000:
                self._defaults.clear()
            self._defaults[first.keys.prefix] = defaults
        else:
            raise StorageUnavailable("The queue's default ttl and delay keep changing; retry.")
        if reply and reply[0] == b"records":
            return None
        # the review the call scheduled (ms), 0: none
        self.note_soon(first.project, first.queue, int(reply[0]))
        return [
            self._outcome(tag, post, answer)
            for (post, _), answer in zip(batch, reply[1:], strict=True)
        ]

    def _post_args(
        self, batch: list[Pending], may_switch: bool, defaults: Defaults
    ) -> tuple[list[str], list[Any]]:
        """post_segments.lua's keys and arguments for the posts of batch,
        their records built with the queue's defaults as given."""
        settings, first = self._settings, batch[0][0]
        now = self._clock.now_ms()
        default_ttl = int(defaults[0] or settings.default_message_ttl)
        default_delay = int(defaults[1] or 0)
        # a topic stores a message's group but has no claims to order by it
        grouping = self._kind == "queue"
        all_keys, held_key = first.keys.fixed(), None
        sizes: list[int] = []
        specials: list[Any] = []  # the posts out of the common (post_segments.lua)
        groups: list[Any] = []
        records: list[bytes] = []
        earliest = latest = first_due = 0
        took_default = False
        for post, token in batch:
            held = post.held if post.held is not None and post.held.in_script else None
            if held is not None and held_key is None:
                held_key = held.key  # the project's: the same for every post of the queue
                all_keys.append(held_key)
            sizes.append(post.request_size)
            if len(post.messages) != 1 or token or post.sealed or held is not None:
                specials += [len(sizes), len(post.messages), token, _flag(post.sealed)]
                specials.append(held.member if held else "")
            author = seg.author_bytes(post.client_id)
            for message in post.messages:
                took_default = took_default or message.ttl is None or message.delay is None
                ttl = default_ttl if message.ttl is None else message.ttl
                delay = default_delay if message.delay is None else message.delay
                expires = now + ttl * 1000
                due = now + delay * 1000 if delay > 0 else 0
                extras = seg.extras(message.group, message.headers)
                records.append(seg.encode_record(expires, due, ttl, author, extras, message.body))
                earliest = min(earliest or expires, expires)
                latest = max(latest, expires)
                if due and (not first_due or due < first_due):
                    first_due = due
                if grouping and message.group:
                    groups += [len(records), message.group]
        args: list[Any] = [
            now,
            settings.idempotency_window * 1000,
            seg.id_tag(first.keys.prefix),
            _flag(may_switch),
            len(batch),
            *(defaults if took_default else UNCHECKED),
            earliest,
            latest,
            first_due,
            len(groups) // 2,
            len(specials) // 5,
        ]
        return all_keys, [*args, *sizes, *specials, *groups, *records]

    def _outcome(self, tag: str, post: SegmentPost, answer: int | list[Any]) -> Outcome:
        """One post's answer from the script: its ids, or its refusal."""
        if isinstance(answer, int):
            # posted: the script answers with the first seq only, the ids are made here
            return [seg.message_id(tag, answer + i) for i in range(len(post.messages))]
        if answer[0] == b"replay":
            return [r.text(i) for i in answer[1:]]
        try:
            self.refused(post.queue, answer)
        except (FeedError, MustSeal) as exc:
            return exc
        raise StorageUnavailable(f"post_segments.lua answered {answer!r}")

    def _cut(self, batch: list[Pending]) -> int:
        """How many of batch's first posts one call takes (see MAX_CALL_POSTS)."""
        messages = size = 0
        for i, (post, _) in enumerate(batch):
            messages += len(post.messages)
            size += sum(len(m.body) for m in post.messages)
            if i and (messages > MAX_CALL_MESSAGES or size > MAX_CALL_BYTES):
                return i
        return len(batch)

    def note_soon(self, project: str, queue: str, when: int) -> None:
        """A script moved a segment review of the queue earlier (to ``when``,
        ms; 0: it moved none): noted in fs:sweep in the background."""
        if when and self._sweeps is not None:
            self._sweeps.note_soon(self._kind, project, queue, when)

    async def note_review(self, project: str, queue: str, when: int) -> None:
        """A script scheduled a review of the queue's segments (reviews.py):
        note it in fs:sweep. The write it answers is done: a failure here
        only delays the review until the queue's next post or claim runs it."""
        if self._sweeps is None:
            return
        try:
            await self._sweeps.note(self._kind, project, queue, when)
        except FeedError as exc:
            log.warning("a segment review of %s/%s waits: %s", project, queue, exc)

    async def sweep_due(self, keys: QueueKeys, most: int) -> tuple[int, int | None]:
        """One review a call (lua/sweep.lua), up to most while due: (reviews
        run, the next one due in ms or None)."""
        ran = 0
        while True:
            one, due, _ = await self.sweep(keys, 1, False)
            ran += one
            if not one or ran >= most or due is None or due > self._clock.now_ms():
                return ran, due

    async def sweep(
        self, keys: QueueKeys, most: int, count: bool
    ) -> tuple[int, int | None, int | None]:
        """sweep.lua: run up to ``most`` due reviews of the queue; (reviews
        run, the next one due in ms or None, the live messages if counted)."""
        args = [self._clock.now_ms(), most, _flag(count)]
        ran, due, live = await self._run(load_script("sweep"), keys.fixed(), args, False)
        return (
            int(ran),
            None if due in (b"", "") else int(float(due)),
            None if live in (b"", "") else int(live),
        )

    async def read(
        self, keys: QueueKeys, now: int, start: int | None, want: int, legacy_read: bool,
        check: int | None,
    ) -> list[Any]:  # fmt: skip
        """read_segments.lua (segment_pages.SegmentRead), or, when the
        segment's slot table is known, the same by plain reads
        (known_tables.py); reads only: may be sent again. The script's
        call reads the table the page after it needs in the same round trip."""
        known = await read_known(
            self._transport, self._tables, keys, start, want, legacy_read, check
        )
        if known is not None:
            return known
        script = load_script("read_segments")
        args = ["" if start is None else start, want, _flag(legacy_read), now]
        args.append("" if check is None else check)
        # the keys a common page reads, named here: the script builds no key name
        segment = keys.meta if start is None else keys.segment(seg.segment_of(start)[0])
        all_keys = [*keys.fixed(), keys.claim_states, segment]
        commands: list[Command] = [("EVALSHA", script.sha, len(all_keys), *all_keys, *args)]
        seed = seed_key(keys, start, want)
        if seed is not None:
            commands.append(seg.table_read(seed))
        replies = await self._transport.call(commands, True)
        if seed is not None:
            self._tables.note(seed, replies[1])
        reply: list[Any] = await self._reply(script, all_keys, args, replies[0])
        return reply

    async def page(self, keys: QueueKeys, query: ListQuery, now: int) -> MessagePage | None:
        """A page read from the segments; None: the older layout first (list.lua)."""
        read = functools.partial(self.read, keys, now)
        check = query.marker if query.check_marker else None
        scan = PageScan(seg.id_tag(keys.prefix), query, now, self._settings.scan_limit)
        return await scan_segments(read, scan, query.marker, check, False)

    async def carry_on(
        self, keys: QueueKeys, reply: list[Any], query: ListQuery, now: int
    ) -> MessagePage:
        """The page list.lua began (its ``more`` reply), carried on in the segments."""
        read = functools.partial(self.read, keys, now)
        tag, limit = seg.id_tag(keys.prefix), self._settings.scan_limit
        scan = PageScan.after_legacy(reply, tag, query, now, limit)
        page = await scan_segments(read, scan, query.marker, None, True)
        assert page is not None
        return page
