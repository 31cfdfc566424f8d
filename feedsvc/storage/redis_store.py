"""What both drivers share: their lifecycle and the paths that involve no
choice between Lua and WATCH — queue metadata, queue listing, stats,
messages by id — and claim upkeep through its ``claims``
(``claim_upkeep.py``).

A driver is a :class:`RedisStore` subclass that adds the writes and the
listing (``lua_store.py``, ``watch_store.py``). It talks to Redis only
through its :class:`~feedsvc.storage.transport.Transport`, reads and writes
records only through ``record.py``, and takes the time from its clock.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Self

import orjson

from feedsvc.clock import Clock
from feedsvc.config import StoreSettings
from feedsvc.errors import (
    MarkerNotGivenOut,
    PostTooLarge,
    ProjectMessagesFull,
    QueueFull,
    QueueNotFound,
    RedisMayEvict,
    RedisOutOfMemory,
)
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import (
    ENCRYPT_MESSAGES,
    RESERVED_FIELDS,
    Claim,
    Follow,
    Message,
    MessageSummary,
    NewMessage,
    Parent,
    QueueInfo,
    QueueStats,
    StoreCounters,
    Unclaimable,
    Unreadable,
    reserved_fields,
)
from feedsvc.storage.claim_upkeep import ClaimUpkeep
from feedsvc.storage.coalescer import Command
from feedsvc.storage.deliveries import RedisDeliveries
from feedsvc.storage.follower_counts import RedisFollowerCounts
from feedsvc.storage.keys import KINDS, FeedSpace, Kind, QueueKeys, registry_key
from feedsvc.storage.quotas import ProjectQuotas, Reservation
from feedsvc.storage.rate_limits import RedisRateLimits
from feedsvc.storage.redrive import RedisRedrives
from feedsvc.storage.sealing import BodyOpener, BodySealer, MustSeal
from feedsvc.storage.segment_pages import segment_end, segment_messages
from feedsvc.storage.subscriptions import KeyBuilder, RedisSubscriptions
from feedsvc.storage.sweep_schedule import SweepSchedule
from feedsvc.storage.sweeper import Sweeper, start_sweeper
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_sweep import live_now

log = logging.getLogger("feedsvc")

#: How long (ms) a process trusts what it last learned of a queue's
#: encryption before reading it again. The post script checks it anyway;
#: this only spares a plain body a trip to Redis when the queue was made
#: encrypted meanwhile (see ``RedisStore.post_messages``).
SEALING_MEMORY_MS = 1000
SEALING_MEMORY_SIZE = 10000


def idempotency_token(client_id: str, key: str) -> str:
    """The field under which a client's Idempotency-Key is remembered."""
    return hashlib.sha1(f"{client_id}\n{key}".encode()).hexdigest()


def marker_ceiling(counter: Any, now: int) -> int:
    """The highest marker a feed can have given out: its counter (``Q:seq``),
    or with none (never posted to, or deleted) where its first post will
    start it, now in microseconds (list.lua computes the same)."""
    return int(counter) if counter is not None else now * 1000


async def read_tail_marker(transport: Transport, keys: QueueKeys) -> int:
    """FeedStore.tail_marker: the feed's counter, 0 if it has none."""
    [counter] = await transport.call_checked([("GET", keys.seq)], idempotent=True)
    return 0 if counter is None else r.parse_seq(counter)


def marker_not_given_out(feed: str, marker: int) -> MarkerNotGivenOut:
    return MarkerNotGivenOut(
        f"The marker {marker} is past the last message of {feed}: this service did not "
        "give it out. Resume from the id of the last message received, or start "
        "without a marker."
    )


async def live_end(
    transport: Transport, keys: QueueKeys, now: int, reverse: bool
) -> MessageSummary | None:
    """The first live message from the head (or the tail) of a feed's index."""
    offset, batch = 0, 16
    while True:
        order = ("REV",) if reverse else ()
        [ids] = await transport.call_checked(
            [("ZRANGE", keys.index, offset, offset + batch - 1, *order)]
        )
        if not ids:
            return None
        names = [r.text(i) for i in ids]
        replies = await transport.call_checked(
            [c for i in names for c in r.summary_commands(keys, i)]
        )
        for n, name in enumerate(names):
            found = r.summary(replies[2 * n], replies[2 * n + 1])
            if found is not None and found[1] > now:
                return MessageSummary(name, found[0])
        offset += batch
        batch = min(batch * 4, 1024)


def queue_full(noun: str, queue: str, limit: bytes) -> QueueFull:
    """A post that would take the feed over its own _max_messages (limit, as read)."""
    return QueueFull(
        f"{noun} {queue} holds at most {int(limit)} live messages "
        "(its _max_messages); delete or consume some, or wait for them to expire."
    )


def post_too_large(noun: str, queue: str, limit: bytes) -> PostTooLarge:
    """A post over the feed's own _max_messages_post_size (limit, as read)."""
    return PostTooLarge(f"{noun} {queue} accepts posts of at most {int(limit)} bytes.")


class SealingMemory:
    """What this process last learned of each queue's encryption, trusted
    for SEALING_MEMORY_MS (see ``RedisStore.post_messages``)."""

    def __init__(self, transport: Transport, clock: Clock) -> None:
        self._transport = transport
        self._clock = clock
        self._known: dict[str, tuple[bool, int]] = {}  # queue prefix -> (sealed, learned at ms)

    async def seals(self, keys: QueueKeys) -> bool:
        now = self._clock.now_ms()
        known = self._known.get(keys.prefix)
        if known is not None and now - known[1] < SEALING_MEMORY_MS:
            return known[0]
        [flag] = await self._transport.call_checked([("HGET", keys.meta, r.ENCRYPTED)])
        return self.learn(keys, flag == b"1")

    def learn(self, keys: QueueKeys, sealed: bool) -> bool:
        if len(self._known) >= SEALING_MEMORY_SIZE:
            self._known.clear()
        self._known[keys.prefix] = (sealed, self._clock.now_ms())
        return sealed


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessParts:
    """What a store and its topic view share, one of each per process: the
    opener of sealed bodies and what was learned of queues' sealing,
    follower counts, subscriptions (the same layout under each kind's keys)
    and their one delivery state, rate limits, project quotas and redrives."""

    opener: BodyOpener
    sealing: SealingMemory
    follower_counts: RedisFollowerCounts
    subscriptions: dict[str, RedisSubscriptions]
    deliveries: RedisDeliveries
    rate_limits: RedisRateLimits
    quotas: ProjectQuotas
    redrives: RedisRedrives
    sweeps: SweepSchedule

    @classmethod
    def make(cls, transport: Transport, settings: StoreSettings, clock: Clock) -> ProcessParts:
        sealer = BodySealer(settings.message_encryption_key, settings.old_encryption_keys())
        opener = BodyOpener(sealer, transport.counters)
        quotas = ProjectQuotas(transport, settings, clock)
        sweeps = SweepSchedule(transport, clock)
        builders: dict[str, KeyBuilder] = {kind: QueueKeys.builder(kind) for kind in KINDS}
        return cls(
            opener,
            SealingMemory(transport, clock),
            RedisFollowerCounts(transport, clock),
            {kind: RedisSubscriptions(transport, clock, kind, b) for kind, b in builders.items()},
            RedisDeliveries(
                transport, clock, builders, functools.partial(open_for_delivery, opener)
            ),
            RedisRateLimits(transport),
            quotas,
            RedisRedrives(transport, settings, clock, quotas, sweeps),
            sweeps,
        )


def open_for_delivery(
    opener: BodyOpener, messages: list[Message], parent: Parent
) -> list[Message | Unreadable]:
    return opener.each(messages, "delivery", parent.kind, parent.project, parent.name)


class RedisStore(FeedSpace, ABC):
    """Base of both drivers. Subclasses implement the writes and listing;
    claims after they are made are its ``claims``' (``claim_upkeep.py``)."""

    name = "redis"

    def __init__(
        self,
        transport: Transport,
        settings: StoreSettings,
        clock: Clock,
        kind: Kind = "queue",
        queues: RedisStore | None = None,
    ) -> None:
        """A store of one kind of feed; a topic view (``topics()``) is made
        with ``kind="topic"`` and the queue store whose parts it shares."""
        super().__init__(kind)
        self._transport, self._settings, self._clock = transport, settings, clock
        self._topic_view: Self | None = None
        self.sweeper: Sweeper | None = None
        parts = ProcessParts.make(transport, settings, clock) if queues is None else queues.parts
        self.parts: ProcessParts = parts
        self._opener, self._sealing = parts.opener, parts.sealing
        self.follower_counts, self.rate_limits = parts.follower_counts, parts.rate_limits
        self.quotas, self.redrives = parts.quotas, parts.redrives
        claims = self.claims = ClaimUpkeep(
            kind, transport, settings, clock, parts.opener, parts.quotas, parts.sweeps
        )
        # a claim, once made, is answered by the claim upkeep itself
        self.get_claim, self.renew_claim = claims.get_claim, claims.renew_claim
        self.release_claim, self.release_message = claims.release_claim, claims.release_message
        self._share(queues)

    def _share(self, queues: RedisStore | None) -> None:
        """A driver's own per-process parts: made here, or taken from ``queues``."""

    def topics(self) -> Self:
        """This store on the project's topics: the same operations and records
        under the topic namespace (see ``keys.FeedSpace``)."""
        if self._kind == "topic":
            return self
        if self._topic_view is None:
            self._topic_view = type(self)(
                self._transport, self._settings, self._clock, "topic", self
            )
        return self._topic_view

    @property
    def subscriptions(self) -> RedisSubscriptions:
        """The subscriptions of this store's kind of feed (queues, or topics on
        the topic view)."""
        return self.parts.subscriptions[self._kind]

    @property
    def deliveries(self) -> RedisDeliveries:
        return self.parts.deliveries

    @property
    def counters(self) -> StoreCounters:
        return self._transport.counters

    async def open(self) -> None:
        self._transport.open()
        # one sweep loop a process (the topic view shares it): storage/sweeper.py
        self.sweeper = start_sweeper(
            self._kind, self._settings.sweep_interval, self.parts.sweeps, self._clock,
            self._sweep_queue,
        )  # fmt: skip

    def follow(self, project: str, queue: str) -> AbstractAsyncContextManager[Follow]:
        return self._transport.notifier.follow(self._keys(project, queue).feed)

    async def ping(self) -> None:
        await self._transport.ping()

    def stats(self) -> dict[str, float]:
        # the sweep's lag: how late the oldest due segment review was at its last look
        return {**self._transport.stats(), "sweep_lag_seconds": self.parts.sweeps.lag_ms / 1000}

    def eviction_report(self) -> dict[str, Any]:
        return self._transport.memory_policy.report()

    async def close(self) -> None:
        if self.sweeper is not None:
            await self.sweeper.close()
        await self.parts.sweeps.noted()  # reviews noted in the background are written
        await self._transport.close()

    async def _sweep_queue(
        self, kind: Kind, project: str, queue: str, most: int
    ) -> tuple[int, int | None]:
        """Up to ``most`` due reviews of a queue's segments: (reviews run,
        the next due in ms or None)."""
        store = self if kind == self._kind else self.topics()
        return await store._sweep(store._keys(project, queue), most)

    @abstractmethod
    async def _sweep(self, keys: QueueKeys, most: int) -> tuple[int, int | None]:
        """The driver's reviews for _sweep_queue."""

    async def claim_messages(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | None:
        claim = await self.try_claim(project, queue, ttl, grace, limit)
        return claim if isinstance(claim, Claim) else None

    def _claim_scan_limit(self) -> int:
        """How many index entries a claim or pop may look at to find free messages."""
        return self._settings.scan_limit * 10

    async def _registry_add(self, project: str, queue: str, kind: Kind | None = None) -> Command:
        """List the queue in its project's registry, as the first read of a
        transaction on the queue's slot: on one server the ZADD rides along
        with those reads; on a cluster the registry lives in another slot, so
        it is sent by itself first and a PING keeps its place among the reads.
        """
        registry = self._registry(project) if kind is None else registry_key(project, kind)
        add: Command = ("ZADD", registry, 0, queue)
        if not self._transport.cluster:
            return add
        await self._transport.call_checked([add])
        return ("PING",)

    async def get_queue_metadata(self, project: str, queue: str) -> dict[str, Any] | None:
        meta = self._keys(project, queue).meta
        [(created, raw)] = await self._transport.call_checked(
            [("HMGET", meta, r.CREATED, r.METADATA)]
        )
        if created is None:
            return None
        metadata: dict[str, Any] = orjson.loads(raw) if raw else {}
        return metadata

    async def list_queues(
        self, project: str, marker: str | None, limit: int, detailed: bool
    ) -> list[QueueInfo]:
        keys = functools.partial(self._keys, project)
        registry = self._registry(project)
        return await registry_page(self._transport, registry, keys, marker, limit, detailed)

    async def count_queues(self, project: str) -> int:
        [count] = await self._transport.call_checked([("ZCARD", self._registry(project))])
        return int(count)

    async def queue_stats(self, project: str, queue: str) -> QueueStats:
        keys = self._keys(project, queue)
        return await queue_stats(self._transport, keys, self._clock.now_ms(), self._live_swept)

    async def _live_swept(self, keys: QueueKeys) -> int | None:
        """A queue in segments: its live messages counted exactly, after its
        due reviews (storage/reviews.py); None: the driver cannot (then
        expired messages count until the sweep has been)."""
        return None

    async def get_messages(self, project: str, queue: str, ids: list[str]) -> list[Message]:
        keys = self._keys(project, queue)
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return []
        now = self._clock.now_ms()
        reads = [*r.read_commands(keys, wanted), ("HGET", keys.meta, seg.NEW_START)]
        replies = await self._transport.call_checked(reads)
        found = r.live_messages(wanted, replies[:-1], now)
        if replies[-1] is not None:
            # a queue in segments: an id not found in the older layout is a seq
            new_start, tag = int(replies[-1]), seg.id_tag(keys.prefix)
            seqs = {
                i: q
                for i, m in zip(wanted, found, strict=True)
                if m is None and (q := seg.seq_of(tag, i)) is not None and q >= new_start
            }
            if seqs:
                more = await segment_messages(self._transport, keys, list(seqs.values()), now)
                found = [m or more.get(seqs.get(i, 0)) for i, m in zip(wanted, found, strict=True)]
        return self._opener.reveal([m for m in found if m is not None])

    # -- encrypted queues (see sealing.py) ------------------------------------

    async def post_messages(
        self,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int = 0,
        idempotency_key: str | None = None,
    ) -> list[str]:
        """Post, sealing the bodies if the queue is encrypted.

        Whether it is comes from what this process last learned (at most
        SEALING_MEMORY_MS old), else from one read of the queue hash. The
        driver's write checks it again atomically (post.lua, or the WATCHed
        queue hash) and writes nothing but MustSeal if the queue asks for
        sealed bodies and these are not: then they are sealed and sent again.
        So a plain body is never indexed in an encrypted queue; it reaches
        Redis at all (and is deleted by the same script) only when another
        process made the queue encrypted in the last second.
        """
        keys = self._keys(project, queue)
        sealed = await self._sealing.seals(keys)
        token = None if idempotency_key is None else idempotency_token(client_id, idempotency_key)
        post = functools.partial(self._post, keys, project, queue, client_id)
        for _ in range(2):
            batch = [
                dataclasses.replace(m, body=self._opener.sealer.seal(m.body)) if sealed else m
                for m in messages
            ]
            try:
                held = await self.quotas.admit(project, self._kind, queue, len(messages))
            except ProjectMessagesFull:
                # the retry of a stored post is answered as the first was
                if (first := await self.quotas.first_answer(keys, token)) is None:
                    raise
                return first
            posted = False
            try:
                ids = await post(batch, request_size, idempotency_key, sealed, held)
                posted = True
                return ids
            except MustSeal:
                # nothing was indexed and the hold is gone: admitted again
                self._sealing.learn(keys, True)
                sealed = True
            finally:
                await self.quotas.release(held, posted)
        raise AssertionError("a post of sealed bodies cannot need sealing")

    @abstractmethod
    async def try_claim(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | Unclaimable:
        """Each driver makes claims its own way (a script, or a transaction)."""

    @abstractmethod
    async def _post(
        self,
        keys: QueueKeys,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int,
        idempotency_key: str | None,
        sealed: bool,
        held: Reservation | None = None,
    ) -> list[str]:
        """The driver's post (keys: the queue's, which the caller has made);
        MustSeal if the queue is encrypted and not sealed. held: the room the
        post holds under its project's quota, which the post lets go of as
        it indexes when ``held.in_script``."""

    def _too_large(self, queue: str, limit: bytes) -> PostTooLarge:
        return post_too_large(self._noun, queue, limit)

    # Queue metadata changes are rare, uncontended writes: both drivers run
    # them as WATCH/MULTI transactions, which are correct against the lua
    # driver's scripts too (a script touching a watched key aborts the
    # transaction).
    async def update_queue_metadata(
        self,
        project: str,
        queue: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        keys = self._keys(project, queue)

        def plan(replies: list[Any]) -> tuple[list[Command] | None, dict[str, Any] | None]:
            created, raw = replies[0]
            if created is None:
                return None, None
            updated = change(orjson.loads(raw) if raw else {})
            fields = reserved_fields(updated)
            writes: list[Command] = [
                ("HSET", keys.meta, r.METADATA, orjson.dumps(updated), *r.flat(fields))
            ]
            stale = [f for f in RESERVED_FIELDS.values() if f not in fields]
            if stale:
                writes.append(("HDEL", keys.meta, *stale))
            return writes, updated

        reads: list[Command] = [("HMGET", keys.meta, r.CREATED, r.METADATA)]
        result = await self._transport.transactions.optimistic([keys.meta], reads, plan)
        if result is None:
            raise QueueNotFound(queue, self._noun)
        self._sealing.learn(keys, result.get(ENCRYPT_MESSAGES) is True)
        return result


async def registry_page(
    transport: Transport,
    registry: str,
    keys_of: Callable[[str], QueueKeys],
    marker: str | None,
    limit: int,
    detailed: bool,
) -> list[QueueInfo]:
    """A page of a project's queues by name (its registry), skipping entries
    whose queue is gone (deleted meanwhile), so a page is short only at the end."""
    out: list[QueueInfo] = []
    start = "-" if marker is None else f"({marker}"
    while len(out) < limit:
        want = limit - len(out)
        [names] = await transport.call_checked(
            [("ZRANGEBYLEX", registry, start, "+", "LIMIT", 0, want)]
        )
        if not names:
            break
        rows = await transport.call_checked(
            [("HMGET", keys_of(r.text(raw)).meta, r.CREATED, r.METADATA) for raw in names]
        )
        for raw, (created, meta) in zip(names, rows, strict=True):
            if created is None:
                continue
            metadata = (orjson.loads(meta) if meta else {}) if detailed else None
            out.append(QueueInfo(r.text(raw), metadata))
        if len(names) < want:
            break
        start = f"({r.text(names[-1])}"
    return out


async def queue_stats(
    transport: Transport,
    keys: QueueKeys,
    now: int,
    live_swept: Callable[[QueueKeys], Awaitable[int | None]],
) -> QueueStats:
    """A queue's counts and its oldest and newest live messages, in either
    layout (live_swept: the driver's exact count of a queue in segments,
    after its due reviews; while Redis takes no writes, full or refused for
    its memory policy, the same count with reads only)."""
    *counts, claimed = await transport.call_checked(
        [*seg.live_count_commands(keys, now), ("ZCOUNT", keys.claimed, f"({now}", "+inf")]
    )
    total, legacy, segmented = seg.live_count(counts), int(counts[0]), counts[1][0] is not None
    swept = None
    if segmented:
        try:
            swept = await live_swept(keys)
        except (RedisOutOfMemory, RedisMayEvict):
            swept = await live_now(transport, keys, now)
    total = total if swept is None else swept
    oldest = newest = None
    if legacy:
        oldest = await live_end(transport, keys, now, reverse=False)
    if segmented and total > legacy:
        oldest = oldest or await segment_end(transport, keys, now, reverse=False)
        newest = await segment_end(transport, keys, now, reverse=True)
    if legacy:
        newest = newest or await live_end(transport, keys, now, reverse=True)
    return QueueStats(
        claimed=int(claimed),
        free=max(0, int(total) - int(claimed)),
        total=int(total),
        oldest=oldest,
        newest=newest,
    )
