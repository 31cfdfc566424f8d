"""Every Redis key name feedsvc uses, built in one place.

All keys of one queue share the hash tag ``{<project>/<queue>}`` so that every
script and every WATCH/MULTI transaction touches a single cluster slot. The
per-message and per-claim keys are derived from the queue prefix inside the
Lua scripts too (``prefix .. S_RECORD .. id``), so the two must agree: the
suffixes are defined here and written into the scripts where they say ``S_*``
(see ``record.lua_constants``).

Projects are free text (1..256 characters) and may contain characters that
would change a key's meaning (``{`` and ``}`` move the hash tag) or collide
with the separators; :func:`escape_project` percent-escapes them, which keeps
the mapping injective. Queue names (``[A-Za-z0-9_.-]``), message ids and claim
ids (lowercase hex, made by the service and validated on input) need no
escaping.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

NAMESPACE = "fs"

#: What a feed is: a queue, or a topic (Zaqar's /v2/topics). Both have the
#: same keys and records; a topic's keys live under ``fs:t:`` and its names
#: in a registry of their own, so a topic and a queue of the same name in
#: one project never share a key.
Kind = Literal["queue", "topic"]
KIND_PREFIX: dict[Kind, str] = {"queue": "", "topic": "t:"}
KINDS: tuple[Kind, ...] = ("queue", "topic")

META_SUFFIX = ":q"
FEED_SUFFIX = ":feed"  # a shard channel, not a key: notifications for followers
RECORD_INFIX = ":r:"  # a message (record.py)
MESSAGE_INFIX = ":m:"  # a message written before the compact record (record.py)
CLAIM_INFIX = ":c:"
IDEMPOTENCY_SUFFIX = ":idem"
#: ordered groups (docs/consumers.md#ordered-groups): the claim index, a zset
#: of ungrouped ids and group entries (GROUP_ENTRY + group), and one zset per group
CLAIM_INDEX_SUFFIX = ":ci"
GROUP_INFIX = ":g:"
GROUP_ENTRY = "g:"
#: the segment layout (issue 30, storage/segments.py): segment <k> of a
#: queue's messages (a string), the directory of its segments (zset k -> k),
#: the claim state of its segment messages (hash seq -> state), the segments
#: due for review (zset k -> when) and each segment's message count (hash)
SEGMENT_INFIX = ":p:"
DIRECTORY_SUFFIX = ":dir"
CLAIM_STATES_SUFFIX = ":cl"
REVIEWS_SUFFIX = ":sx"
SEGMENT_COUNTS_SUFFIX = ":sn"
#: queues whose segments are due for a review: "<kind> <project> <queue>" ->
#: when; one key, written only outside queue scripts (like fs:subscribed)
SWEEP_KEY = f"{NAMESPACE}:sweep"
#: each process's count of the queue's followers, for /metrics (--metrics-queues)
FOLLOWERS_SUFFIX = ":fol"
SUBSCRIPTIONS_SUFFIX = ":subs"
SUBSCRIBERS_SUFFIX = ":subu"
BURIED_SUFFIX = ":subx"
SUBSCRIPTION_INFIX = ":s:"
SUBSCRIBER_GUARD_INFIX = ":sg:"
LEASE_INFIX = ":sl:"
#: Every parent (queue or topic) that has or had subscriptions: JSON
#: ``[kind, project, name]`` members, score 0. One key in one slot: the
#: delivery workers' sweep reads it; adding to it is an idempotent ZADD.
SUBSCRIBED_KEY = f"{NAMESPACE}:subscribed"
REDRIVE_SUFFIX = ":rd"
ORIGINS_SUFFIX = ":dlo"
REDRIVEN_INFIX = ":rdm:"
#: Every dead-letter queue with a running redrive: JSON ``[project, queue]``
#: members. One key in one slot; the redrivers of every process read it
#: (``feedsvc.services.redriver``); a member whose redrive is over is removed.
REDRIVES_KEY = f"{NAMESPACE}:redrives"


def escape_project(project: str) -> str:
    return project.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace("/", "%2F")


def registry_key(project: str, kind: Kind = "queue") -> str:
    """Sorted set of a project's queue (or topic) names (score 0, ordered by name)."""
    return f"{NAMESPACE}:p:{{{escape_project(project)}}}:{kind}s"


def project_limits_key(project: str) -> str:
    """Hash: a project's own limits, set by the admin API (max_messages,
    max_queues, rate, burst; a field absent = the service's default). Under
    the project's hash tag, as its registries and reservations: one slot."""
    return f"{NAMESPACE}:limits:{{{escape_project(project)}}}"


def rate_bucket_key(project: str) -> str:
    """A project's request-rate bucket (``lua/rate_limit.lua``): the GCRA's
    theoretical arrival time, ms. Tagged as :func:`project_limits_key`, so the
    script that reads the project's overrides touches one cluster slot."""
    return f"{NAMESPACE}:rate:{{{escape_project(project)}}}"


SEQ_SUFFIX = ":seq"
INDEX_SUFFIX = ":idx"
EXPIRY_SUFFIX = ":exp"
CLAIMED_SUFFIX = ":claimed"
CLAIMS_SUFFIX = ":claims"
#: The keys every queue script gets as KEYS[1..n] (QueueKeys.fixed), in order.
FIXED_SUFFIXES = (
    META_SUFFIX,
    SEQ_SUFFIX,
    INDEX_SUFFIX,
    EXPIRY_SUFFIX,
    CLAIMED_SUFFIX,
    CLAIMS_SUFFIX,
)


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The keys of one queue. See ``feedsvc.storage.base`` for the schema."""

    prefix: str
    #: what fixed() returns, made once
    _fixed: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fixed = tuple(self.prefix + suffix for suffix in FIXED_SUFFIXES)
        object.__setattr__(self, "_fixed", fixed)

    @classmethod
    def of(cls, project: str, queue: str, kind: Kind = "queue") -> QueueKeys:
        return _queue_keys(project, queue, kind)

    @classmethod
    def builder(cls, kind: Kind) -> Callable[[str, str], QueueKeys]:
        """(project, name) -> the keys of that feed of this kind."""
        return lambda project, name: cls.of(project, name, kind)

    @property
    def meta(self) -> str:
        return self.prefix + META_SUFFIX

    @property
    def seq(self) -> str:
        return self.prefix + SEQ_SUFFIX

    @property
    def index(self) -> str:
        return self.prefix + INDEX_SUFFIX

    @property
    def expiry(self) -> str:
        return self.prefix + EXPIRY_SUFFIX

    @property
    def claimed(self) -> str:
        return self.prefix + CLAIMED_SUFFIX

    @property
    def claims(self) -> str:
        return self.prefix + CLAIMS_SUFFIX

    @property
    def feed(self) -> str:
        """The shard channel (SPUBLISH) on which posts and deletion are announced."""
        return self.prefix + FEED_SUFFIX

    @property
    def idempotency(self) -> str:
        """Hash: sha1(client id, Idempotency-Key) -> "<expires ms> <id> <id> ..."."""
        return self.prefix + IDEMPOTENCY_SUFFIX

    @property
    def followers(self) -> str:
        """Each process's followers of the queue: a report, not queue data."""
        return self.prefix + FOLLOWERS_SUFFIX

    @property
    def redrive(self) -> str:
        """Hash: the queue's redrive, as a dead-letter queue (storage/redrive.py)."""
        return self.prefix + REDRIVE_SUFFIX

    @property
    def origins(self) -> str:
        """Hash: dead letter id -> the queue it was dead-lettered from."""
        return self.prefix + ORIGINS_SUFFIX

    def redriven(self, message_id: str) -> str:
        """String: in a redrive's target, the mark that a dead letter was
        copied here (its idempotency key; storage/redrive.py)."""
        return self.prefix + REDRIVEN_INFIX + message_id

    @property
    def claim_index(self) -> str:
        """Zset, once the queue has a grouped message: what claims scan, in
        order (ungrouped id -> seq, GROUP_ENTRY + group -> its head's seq)."""
        return self.prefix + CLAIM_INDEX_SUFFIX

    def group(self, name: str) -> str:
        """Zset: the ids of a group's messages -> seq."""
        return self.prefix + GROUP_INFIX + name

    def segment(self, number: int) -> str:
        """String: segment ``number`` of the queue's messages (storage/segments.py)."""
        return f"{self.prefix}{SEGMENT_INFIX}{number}"

    @property
    def directory(self) -> str:
        """Zset: the numbers of the queue's segments (k -> k)."""
        return self.prefix + DIRECTORY_SUFFIX

    @property
    def claim_states(self) -> str:
        """Hash: seq -> claim state of a segment message (storage/segments.py)."""
        return self.prefix + CLAIM_STATES_SUFFIX

    @property
    def reviews(self) -> str:
        """Zset: segment number -> when (ms) the sweep looks at it next."""
        return self.prefix + REVIEWS_SUFFIX

    @property
    def segment_counts(self) -> str:
        """Hash: segment number -> its messages (storage/segments.py)."""
        return self.prefix + SEGMENT_COUNTS_SUFFIX

    def record(self, message_id: str) -> str:
        """A message: its header and body in one string (see record.py)."""
        return self.prefix + RECORD_INFIX + message_id

    def message(self, message_id: str) -> str:
        """A message in the legacy layout, a hash (see record.py)."""
        return self.prefix + MESSAGE_INFIX + message_id

    def claim(self, claim_id: str) -> str:
        return self.prefix + CLAIM_INFIX + claim_id

    def subscriptions(self) -> SubscriptionKeys:
        """The keys of this queue's (or topic's) subscriptions, under its hash tag."""
        return SubscriptionKeys(self.prefix)

    def fixed(self) -> list[str]:
        """The keys passed as KEYS[1..n] to every queue script, in this order:
        meta, seq, index, expiry, claimed, claims."""
        return list(self._fixed)


# Every request names its queue's keys, and a busy process names the same
# few again and again: building them (escaping the project included) cost
# ≈ 1 µs a request. Bounded: names come from clients.
@functools.lru_cache(maxsize=4096)
def _queue_keys(project: str, queue: str, kind: Kind) -> QueueKeys:
    return QueueKeys(f"{NAMESPACE}:{KIND_PREFIX[kind]}{{{escape_project(project)}/{queue}}}")


class FeedSpace:
    """The key names of one kind of feed, the base of the stores and their
    claim upkeep: a store's topic view (``FeedStore.topics()``) is the same
    store's class made with ``kind="topic"``, so every operation is written
    once for both."""

    def __init__(self, kind: Kind) -> None:
        self._kind: Kind = kind

    def _keys(self, project: str, name: str) -> QueueKeys:
        return QueueKeys.of(project, name, self._kind)

    def _registry(self, project: str) -> str:
        return registry_key(project, self._kind)

    @property
    def _noun(self) -> str:
        """What error messages call the feed: "Queue" or "Topic"."""
        return self._kind.capitalize()


@dataclass(frozen=True, slots=True)
class SubscriptionKeys:
    """The subscription keys of one parent (a queue; a topic's keys are built
    the same way from its own prefix). They share the parent's hash tag, so a
    delivery reads the parent's messages and writes its own state in one slot.
    See ``feedsvc.storage.subscriptions`` for the schema."""

    prefix: str

    @property
    def index(self) -> str:
        """Sorted set: subscription id -> 0 (listed by id, as Zaqar's Redis driver does)."""
        return self.prefix + SUBSCRIPTIONS_SUFFIX

    @property
    def buried(self) -> str:
        """Sorted set: ids of subscriptions deleted with their queue (or by a
        purge) whose records are still to be swept away, in bounded steps."""
        return self.prefix + BURIED_SUFFIX

    @property
    def subscribers(self) -> str:
        """Hash: subscriber URI -> subscription id (subscribers are unique per parent)."""
        return self.prefix + SUBSCRIBERS_SUFFIX

    def record(self, subscription_id: str) -> str:
        return self.prefix + SUBSCRIPTION_INFIX + subscription_id

    def guard(self, subscriber: str) -> str:
        """String: touched by every write of subscriber's entry in ``subscribers``
        and WATCHed by them, so that only writes about one subscriber contend
        (a WATCH of the whole hash made every create on a queue conflict with
        every other). Set and deleted in one transaction: it never stays."""
        digest = hashlib.sha1(subscriber.encode(), usedforsecurity=False).hexdigest()
        return self.prefix + SUBSCRIBER_GUARD_INFIX + digest

    def lease(self, subscription_id: str) -> str:
        """String: the token of the worker delivering this subscription; PX = the lease."""
        return self.prefix + LEASE_INFIX + subscription_id


def reservations_key(project: str) -> str:
    """Sorted set: the room of a project's posts in flight, ``"<id> <n>"`` ->
    the ms until which it is held (see ``feedsvc.storage.quotas``)."""
    return f"{NAMESPACE}:p:{{{escape_project(project)}}}:held"
