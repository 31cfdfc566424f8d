"""A project's quotas: how many live messages its queues and topics may
hold together (max_messages) and how many queues and topics it may have
(max_queues); the service's defaults (flags) or the project's own (the
admin API's ``fs:limits:{P}`` hash, which holds the rate limiter's ``rate``
and ``burst`` too).

A post is admitted by ``admit.lua``, on the project's slot: it counts the
project's live messages (each feed's ``Q:exp`` from now on: an expired
message holds no room, collected or not), adds the room held by posts in
flight (the ``fs:p:{P}:held`` reservations), and either refuses the post or
holds its room. The post script (or the WATCH transaction) lets go of the
reservation in the same step that indexes the messages, so they are never
counted twice nor missed: on one server (and Sentinel) the count is exact.
On a cluster the feeds' indexes live in other slots: the caller counts
first, then admits, and lets go after the post; a post indexed between
another's count and its admission is missed by it, so the project may
overshoot by the messages of posts in flight, never more (docs/design.md:
Quotas). Nothing needs giving back: delete, pop, expiry, dead-lettering,
purge and queue deletion all shrink ``Q:exp``, or a segment feed's posted
less ``gone``, which is what is counted. An expired segment message joins
``gone`` only at its segment's review: when that would refuse a post,
admit.lua says ``expired`` and the caller counts those (``_survey``) for
it, so a quota counts exactly what is live in either layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from feedsvc.clock import Clock
from feedsvc.config import QuotaSettings
from feedsvc.errors import ProjectMessagesFull, ProjectQueuesFull, StorageUnavailable
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import LIMIT_FIELDS, new_id
from feedsvc.storage.keys import (
    KINDS,
    Kind,
    QueueKeys,
    project_limits_key,
    registry_key,
    reservations_key,
)
from feedsvc.storage.scripts import load_script
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_sweep import expired_unswept, soon_read, unswept_reads

#: How long (ms) a post's reservation holds room at most: a process that
#: dies mid-post leaks that room for this long, no longer.
HOLD_MS = 60_000
#: How often admit.lua may say "these are not the registries' names" in a row.
STALE_ROUNDS = 10
#: Projects whose feed names a process remembers (to name their indexes).
NAMES_KEPT = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class LiveCount:
    """Feeds' live messages as admit.lua counts them (live), of which
    expired segment messages not yet counted gone (unswept), and each
    feed's gone field ('-': none) as read."""

    live: int
    unswept: int
    gone: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """The room a post holds until its messages are indexed."""

    key: str
    member: str
    #: whether the post itself must let go (one server: the post script or
    #: transaction removes it as it indexes); else the caller does, after
    in_script: bool


class ProjectQuotas:
    """Admission under the project quotas, and the admin API's storage."""

    def __init__(self, transport: Transport, settings: QuotaSettings, clock: Clock) -> None:
        self._transport = transport
        self._clock = clock
        self._max_messages = settings.project_max_messages
        self._max_queues = settings.project_max_queues
        #: quotas are checked when a default is set, or the admin API may set one
        self.active = bool(
            self._max_messages or self._max_queues or settings.admin_secret() is not None
        )
        # project -> (queue names, topic names) as the registries last held them
        self._names: dict[str, tuple[list[str], list[str]]] = {}

    async def admit(self, project: str, kind: Kind, name: str, count: int) -> Reservation | None:
        """Admit a post of count messages to the feed (count 0: its creation),
        listing the feed in its registry; the reservation to let go of after
        the post, if one was made. ProjectQueuesFull or ProjectMessagesFull
        if over a quota: then nothing changed."""
        if not self.active:
            return None
        cluster = self._transport.cluster
        queues, topics = self._names.get(project, ([], []))
        member = f"{new_id()} {count}"
        now = self._clock.now_ms()
        live: int | None = None
        expired = ""
        for _ in range(STALE_ROUNDS):
            keys = [
                project_limits_key(project),
                registry_key(project, "queue"),
                registry_key(project, "topic"),
                reservations_key(project),
            ]
            feeds = [QueueKeys.of(project, q, "queue") for q in queues]
            feeds += [QueueKeys.of(project, t, "topic") for t in topics]
            if not cluster:
                keys += [k for f in feeds for k in (f.expiry, f.meta, f.seq)]
            args: list[Any] = [now, self._max_messages, self._max_queues, kind, name, count]
            args += [member, now + HOLD_MS, "" if live is None else live, expired, len(queues)]
            args += [*queues, *topics]
            reply = await self._eval(keys, args)
            outcome = r.text(reply[0])
            if outcome == "stale":
                split = int(reply[1]) + 2
                queues = [r.text(x) for x in reply[2:split]]
                topics = [r.text(x) for x in reply[split:]]
                self._remember(project, queues, topics)
                live, expired = None, ""
                if cluster:  # count them before asking again
                    named = [QueueKeys.of(project, q, "queue") for q in queues]
                    named += [QueueKeys.of(project, t, "topic") for t in topics]
                    live = await self._count(named, now)
            elif outcome == "count":
                live = await self._count(feeds, now)
            elif outcome == "expired":
                survey = await self._survey(feeds, now)
                expired = " ".join([str(survey.unswept), *survey.gone])
            elif outcome == "queues":
                raise ProjectQueuesFull(
                    f"Project {project} may have at most {int(reply[1])} queues and topics "
                    "(its max_queues); delete one first."
                )
            elif outcome == "messages":
                raise ProjectMessagesFull(
                    f"Project {project} may hold at most {int(reply[1])} live messages across "
                    "its queues and topics (its max_messages); delete or consume some, or "
                    "wait for them to expire."
                )
            else:
                if name not in (queues if kind == "queue" else topics):
                    self._names.pop(project, None)  # it has one more feed now
                if outcome == "held":
                    return Reservation(reservations_key(project), member, not cluster)
                return None
        raise StorageUnavailable("The project's queues kept changing; retry.")

    async def first_answer(self, keys: QueueKeys, token: str | None) -> list[str] | None:
        """The ids the post with this idempotency token got, if still in its
        window: a post refused by the project quota may be the retry of a
        stored one, whose own messages fill the project."""
        if token is None:
            return None
        [seen] = await self._transport.call_checked([("HGET", keys.idempotency, token)])
        if seen is None:
            return None
        until, *ids = r.text(seen).split()
        return ids if int(until) > self._clock.now_ms() else None

    async def release(self, held: Reservation | None, posted: bool) -> None:
        """Let go of a post's room, unless its post script did (posted, on one server)."""
        if held is None or (posted and held.in_script):
            return
        await self._transport.call_checked([("ZREM", held.key, held.member)])

    async def limits(self, project: str) -> dict[str, int | float | None]:
        """The project's own limits (None: the service's default applies)."""
        [row] = await self._transport.call_checked(
            [("HMGET", project_limits_key(project), *LIMIT_FIELDS)]
        )
        out: dict[str, int | float | None] = {}
        for name, raw in zip(LIMIT_FIELDS, row, strict=True):
            value = None if raw is None else float(r.text(raw))
            out[name] = int(value) if value is not None and value.is_integer() else value
        return out

    def defaults(self) -> dict[str, int]:
        return {"max_messages": self._max_messages, "max_queues": self._max_queues}

    async def set_limits(self, project: str, values: dict[str, int | float | None]) -> None:
        """Set the given limits (None: back to the default) in one step."""
        key = project_limits_key(project)
        commands: list[tuple[Any, ...]] = []
        kept = [x for pair in values.items() if pair[1] is not None for x in pair]
        if kept:
            commands.append(("HSET", key, *kept))
        dropped = [name for name, value in values.items() if value is None]
        if dropped:
            commands.append(("HDEL", key, *dropped))
        if commands:
            await self._transport.transaction(commands)

    async def reset(self, project: str) -> None:
        await self._transport.call_checked([("DEL", project_limits_key(project))])

    async def usage(self, project: str) -> dict[str, int]:
        """What the project uses now: live messages, queues, topics, and the
        messages of posts in flight."""
        now = self._clock.now_ms()
        names = await self._transport.call_checked(
            [("ZRANGE", registry_key(project, kind), 0, -1) for kind in KINDS]
        )
        feeds = [
            QueueKeys.of(project, r.text(n), kind)
            for kind, listed in zip(KINDS, names, strict=True)
            for n in listed
        ]
        [held] = await self._transport.call_checked(
            [("ZRANGEBYSCORE", reservations_key(project), f"({now}", "+inf")]
        )
        return {
            "messages": await self._count(feeds, now),
            "queues": len(names[0]),
            "topics": len(names[1]),
            "in_flight": sum(int(r.text(h).rpartition(" ")[2]) for h in held),
        }

    async def _count(self, feeds: Sequence[QueueKeys], now: int) -> int:
        """The feeds' live messages at now, exactly: an expired segment
        message does not count, though its segment's review is to come."""
        count = await self._survey(feeds, now)
        return max(0, count.live - count.unswept)

    async def _survey(self, feeds: Sequence[QueueKeys], now: int) -> LiveCount:
        """The feeds' live count as admit.lua counts it (segments.live_count),
        the expired segment messages in it (not yet counted gone: every one
        is in a segment whose review is soon, watch_sweep.expired_unswept),
        and each feed's gone field as read first (admit.lua's check that no
        review or delete came between)."""
        if not feeds:
            return LiveCount(0, 0, [])
        step = len(seg.live_count_commands(feeds[0], now)) + 1
        reads = [c for f in feeds for c in (*seg.live_count_commands(f, now), soon_read(f, now))]
        replies = await self._transport.call_checked(reads, idempotent=True)
        live, gone, surveys = 0, [], []
        for f, i in zip(feeds, range(0, len(replies), step), strict=True):
            *counts, soon = replies[i : i + step]
            live += seg.live_count(counts)
            gone.append("-" if counts[1][1] is None else r.text(counts[1][1]))
            surveys.append((f, [int(k) for k in soon]))
        per_feed = [unswept_reads(f, soon) for f, soon in surveys]
        segments = [c for feed_reads in per_feed for c in feed_reads]
        found = await self._transport.call_checked(segments, idempotent=True) if segments else []
        unswept, at = 0, 0
        for (_, soon), feed_reads in zip(surveys, per_feed, strict=True):
            unswept += expired_unswept(soon, found[at : at + len(feed_reads)], now)
            at += len(feed_reads)
        return LiveCount(live, unswept, gone)

    def _remember(self, project: str, queues: list[str], topics: list[str]) -> None:
        if len(self._names) >= NAMES_KEPT:
            self._names.clear()
        self._names[project] = (queues, topics)

    async def _eval(self, keys: list[str], args: list[Any]) -> Any:
        script = load_script("admit")
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        [reply] = await self._transport.call([command])
        if isinstance(reply, NoScriptError):
            _, reply = await self._transport.call([("SCRIPT", "LOAD", script.source), command])
        if isinstance(reply, Exception):
            async with self._transport.errors():
                raise reply
        return reply
