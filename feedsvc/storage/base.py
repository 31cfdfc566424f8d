"""The storage interface (:class:`FeedStore`) and the Redis schema both drivers share.

Redis schema (``Q`` = ``fs:{<escaped project>/<queue>}``, see ``keys.py``;
the hash field names below are owned by ``record.py``, which generates them
into the Lua scripts too)::

    key                  type    contents
    -------------------  ------  ------------------------------------------------
    fs:p:{P}:queues      zset    the project's queue names, score 0 (lex order)
    fs:limits:{P}        hash    the project's own limits, set by an operator:
                                 rate (requests/s), burst, max_messages, max_queues
    fs:rate:{P}          string  the project's request-rate bucket (GCRA: its
                                 theoretical arrival time, ms); PX until full
    Q:q                  hash    c = created ms, m = user metadata (JSON object),
                                 plus the honoured reserved settings as plain
                                 fields: dttl, ddelay, mcc, dlq, dlqttl, mps, mm,
                                 enc ("1": bodies are posted sealed); gs = seq
                                 of the first grouped message (claim index on)
    Q:seq                string  last sequence number given to a message; starts
                                 at the creation time in microseconds, so a
                                 re-created queue never reuses old markers
    Q:idx                zset    message id -> seq (post order; the feed)
    Q:exp                zset    message id -> expires ms (GC, live counts)
    Q:claimed            zset    message id -> claim expires ms
    Q:claims             zset    claim id -> claim expires ms
    Q:ci                 zset    since gs: ungrouped id -> seq, "g:<G>" -> seq of
                                 G's head (the claim index, lua/claim.lua)
    Q:g:<G>              zset    group G's message ids -> seq
    Q:r:<id>             string  the message record (record.py): a header of
                                 fixed-width fields, seq (0 until indexed),
                                 ttl s, created ms, expires ms, due ms
                                 (delay), claim expires ms, times claimed,
                                 claim id; then the client id (then " g=" and
                                 its group, and a space and its headers as a
                                 JSON object, if it has them), a newline,
                                 the body (JSON bytes, returned verbatim; or,
                                 in an encrypted queue, sealed.MAGIC + nonce +
                                 AES-256-GCM of them); PEXPIREAT expires
    Q:m:<id>             hash    a message written by a release before the
                                 record (legacy): b t c e u s d k x n, a field
                                 each; read until it expires, moved to Q:r:<id>
                                 by the next write to it (see record.py)
    Q:p:<k>              string  segment k (a queue in segments, from seq ns of
                                 Q:q on): 100 slots, then records (segments.py)
    Q:dir                zset    k -> k for each segment there is
    Q:cl                 hash    seq -> a segment message's claim state
    Q:c:<claim id>       hash    t = ttl s, g = grace s, c = created ms,
                                 x = expires ms, ids = space-separated ids;
                                 PEXPIREAT x
    Q:dlo                hash    of a dead-letter queue: message id -> the queue
                                 it was dead-lettered from (storage/redrive.py)
    Q:rd                 hash    a dead-letter queue's redrive: state, window,
                                 counts, pace, lease (storage/redrive.py)
    Q:rdm:<id>           string  a redrive copied dead letter <id> here; PX past it
    fs:redrives          set     JSON [project, queue] of redrives that may run
    Q:fol                hash    process token -> "<followers> <valid until ms>"
                                 for the queues --metrics-queues names (see
                                 follower_counts.py); expires by itself
                                 soon after its last report, not deleted
                                 with the queue

A topic (``FeedStore.topics()``) has exactly these keys and records under
``fs:t:{<escaped project>/<topic>}``, and its names in ``fs:p:{P}:topics``
(see ``keys.FeedSpace``): a topic and a queue of one name share no key.
A queue's (or topic's) subscriptions and their delivery state live under its
tag too (``Q:subs``, ``Q:subu``, ``Q:s:<id>``, ``Q:sl:<id>``; their schema is
in ``feedsvc.storage.subscriptions``).

Invariants, kept by both drivers:

* A message is visible only once indexed (seq set, member of ``Q:idx``).
  A body written without its index entry (a crash between the two) is never
  shown and disappears at its own expiry.
* Sequence numbers are given out in commit order: the counter and the index
  entry change in one script / one EXEC, so a reader that has seen seq N will
  never later find a new message below N. Markers are sequence numbers,
  so none given out is past ``Q:seq``, or, while a queue has no counter
  (never posted to, or deleted), past now in microseconds, where its first
  post will start it: a list refuses such a marker (``check_marker``).
* The message key's PEXPIREAT equals its expiry; a claim that outlives the message
  raises both (never lowers them).
* Time is the service host's clock in milliseconds, passed to every script, so
  both drivers agree; Redis's own expiry is an extra safety net.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

# Reserved queue metadata that storage honours, and the plain field of Q:q
# that carries each (so scripts need not decode the metadata JSON).
RESERVED_FIELDS = {
    "_default_message_ttl": "dttl",
    "_default_message_delay": "ddelay",
    "_max_messages_post_size": "mps",
    # live messages the queue may hold (a quota: a post over it is 403)
    "_max_messages": "mm",
    "_max_claim_count": "mcc",
    "_dead_letter_queue": "dlq",
    "_dead_letter_queue_messages_ttl": "dlqttl",
    # message bodies encrypted at rest (see sealing.py): "1" when true
    "_enable_encrypt_messages": "enc",
}
ENCRYPT_MESSAGES = "_enable_encrypt_messages"


def checkpoint() -> None:
    """Raise CancelledError if this task was asked to stop and carried on.

    redis-py writes with asyncio.wait_for, which on Python 3.11 swallows a
    cancel() that lands just as the write completes: the task goes on as if
    never cancelled, though it still counts the request
    (``Task.cancelling()``; nothing in feedsvc takes one back). A task that
    loops over Redis calls calls this before it waits or starts over, so
    that a stop it was asked for is not lost.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


def new_id() -> str:
    """A message or claim id: 96 random bits as 24 lowercase hex digits."""
    return os.urandom(12).hex()


def reserved_fields(metadata: dict[str, Any]) -> dict[str, str]:
    """The Q:q fields for the reserved settings that metadata sets (a flag
    that is false sets none)."""
    return {
        field: "1" if value is True else str(value)
        for name, field in RESERVED_FIELDS.items()
        if (value := metadata.get(name)) is not None and value is not False
    }


@dataclass(slots=True)  # not frozen, as Message below: one per message posted
class NewMessage:
    """A message as posted: the body already encoded as JSON, and its headers
    (an object of strings, docs/consumers.md) too; b"": none; and its
    ordered group ("": none)."""

    body: bytes
    ttl: int | None = None
    delay: int | None = None
    headers: bytes = b""
    group: str = ""


# Not frozen: a frozen dataclass costs three to four times as much to build
# (1.0 µs against 0.3 here), and every page builds one per message. Nothing
# changes a Message once a decoder has made it. The same holds for the other
# values every request makes (NewMessage, ListQuery, MessagePage): nothing
# changes them after they are built.
@dataclass(slots=True)
class Message:
    id: str
    seq: int
    body: bytes
    ttl: int
    created_ms: int
    claim_id: str | None = None
    claim_count: int = 0
    author: str | None = None  # the poster's client id, where a list needs it
    # its headers, the JSON object as posted (docs/consumers.md); None: none
    headers: bytes | None = None
    group: str | None = None  # its ordered group (docs/consumers.md); None: none

    def age(self, now_ms: int) -> int:
        return max(0, (now_ms - self.created_ms) // 1000)


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A message whose body cannot be decrypted (see ``sealing.py``), where a
    reader must be told so instead of its body: delivery."""

    id: str
    reason: str


@dataclass(slots=True)  # one per list request: not frozen (see Message)
class ListQuery:
    client_id: str
    marker: int | None = None
    limit: int = 10
    echo: bool = False
    include_claimed: bool = False
    include_delayed: bool = False
    # each Message's author too (a shared tail filters echo per follower);
    # a list request filters it in the store and needs none
    with_authors: bool = False
    # the marker is a client's: MarkerNotGivenOut if it is past the queue's
    # counter (or, with no counter, past where a first post would start it);
    # off for the service's own positions, which never are
    check_marker: bool = False
    # a follower catching up: an empty page at the end says how far it may
    # pass (MessagePage.passed)
    passing: bool = False


@dataclass(slots=True)  # one per list request: not frozen (see Message)
class MessagePage:
    messages: list[Message]
    # None means "nothing more yet": the page was empty at the end of the feed.
    # It never passes a delayed message the query would show once due, unless
    # a message after that one is on the page.
    next_marker: int | None
    # When (ms) the first such delayed message after next_marker (after the
    # query's marker on an empty page) falls due; None: none is waiting. A
    # waiter sleeps until then at most, without asking Redis meanwhile.
    next_due: int | None = None
    # When (ms) the first live claim on a message the scan looked at ends
    # (the message shown with include_claimed, else passed over); None: it
    # met none. A follower that passed such a message is woken then.
    claim_ends: int | None = None
    # How many messages between the query's marker and next_marker are gone
    # (expired, deleted, popped) unseen: seqs are consecutive per queue, so
    # this is exact. 0 without a marker or a next_marker (an empty page at
    # the end passes nothing: the next page that moves on counts them).
    missed: int = 0
    # Asked with ListQuery.passing, on an empty page at the end after a
    # marker: the marker up to which every entry after the query's is gone
    # (up to the counter if none is live; missed counts them), so that a
    # follower may move there.
    passed: int | None = None


@dataclass(frozen=True, slots=True)
class Unclaimable:
    """A claim found nothing free. ``free_at``: the earliest time (ms) one
    of the messages it looked at becomes free by itself (it falls due, its
    claim expires); None: none will. A claim wait sleeps until then at most."""

    free_at: int | None


@dataclass(frozen=True, slots=True)
class QueueInfo:
    name: str
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class MessageSummary:
    id: str
    created_ms: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    claimed: int
    free: int
    total: int
    oldest: MessageSummary | None = None
    newest: MessageSummary | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    id: str
    ttl: int
    grace: int
    created_ms: int
    messages: list[Message] = field(default_factory=list)

    def age(self, now_ms: int) -> int:
        return max(0, (now_ms - self.created_ms) // 1000)


@dataclass(frozen=True, slots=True)
class Delivery:
    """A subscription's delivery state (``feedsvc.storage.subscriptions``)."""

    position: int = 0  # seq of the last message handled: delivered or given up
    attempts: int = 0  # failed attempts at the message after position
    due_ms: int = 0  # the next attempt not before this time (a retry's back-off)
    delivered: int = 0  # messages delivered
    failures: int = 0  # messages given up on after the retry policy ran out
    last_error: str | None = None
    control: bytes | None = None  # a confirmation request to send before anything else


@dataclass(frozen=True, slots=True)
class Subscription:
    id: str
    source: str  # the queue's (or topic's) name
    subscriber: str
    ttl: int
    created_ms: int
    expires_ms: int
    options: dict[str, Any]
    confirmed: bool
    delivery: Delivery = field(default_factory=Delivery)

    def age(self, now_ms: int) -> int:
        return max(0, (now_ms - self.created_ms) // 1000)


@dataclass(frozen=True, slots=True)
class NewSubscription:
    """What a create found: the id, whether it is new, and if not whether
    the existing one is confirmed (Zaqar: 409 if so, else confirm again)."""

    id: str
    created: bool
    confirmed: bool


@dataclass(frozen=True, slots=True)
class Parent:
    """What subscriptions hang off: a queue (``kind`` "queue") or a topic."""

    kind: str
    project: str
    name: str


class SubscriptionStore(Protocol):
    """Subscriptions of one kind of parent, with Zaqar's semantics: unique
    per parent and subscriber, listed by id, gone at their ttl."""

    async def create(
        self, parent: Parent, subscriber: str, ttl: int, options: dict[str, Any]
    ) -> NewSubscription: ...

    async def get(self, parent: Parent, subscription_id: str) -> Subscription:
        """SubscriptionNotFound if missing or expired."""
        ...

    async def list(self, parent: Parent, marker: str | None, limit: int) -> list[Subscription]: ...

    async def update(
        self,
        parent: Parent,
        subscription_id: str,
        subscriber: str | None,
        ttl: int | None,
        options: dict[str, Any] | None,
    ) -> None:
        """SubscriptionNotFound; SubscriptionExists if the new subscriber is taken."""
        ...

    async def delete(self, parent: Parent, subscription_id: str) -> None:
        """No error if missing."""
        ...

    async def confirm(
        self, parent: Parent, subscription_id: str, confirmed: bool, control: bytes | None
    ) -> None:
        """Set confirmed; a confirmation skips the backlog (delivery starts
        with the next message); control is sent to the subscriber first."""
        ...

    async def request_confirmation(
        self, parent: Parent, subscription_id: str, control: bytes
    ) -> None:
        """Send control (a confirmation request) before anything else."""
        ...

    async def purge(self, parent: Parent) -> None:
        """Delete every subscription of the parent: none is live once this
        returns, whatever their number; their records go in bounded steps."""
        ...


class DeliveryState(Protocol):
    """What the delivery workers need: the parents with subscriptions, a
    lease per subscription, the messages after a position, and the state."""

    async def parents(self) -> list[Parent]:
        """Every parent that may have subscriptions (a few may have none left)."""
        ...

    async def forget_if_empty(self, parent: Parent) -> None:
        """Drop the parent from the sweep list if it has no subscriptions and
        none deleted still to sweep."""
        ...

    async def sweep_buried(self, parent: Parent, limit: int) -> int:
        """Delete the records of up to about limit subscriptions deleted
        with their queue (or purged); how many are left."""
        ...

    async def subscription_ids(self, parent: Parent) -> list[str]: ...

    async def with_work(self, parent: Parent, ids: list[str], confirmed_only: bool) -> list[str]:
        """The live subscriptions among ids that have something to send: a
        confirmation request, or messages after their position (only if
        confirmed, with confirmed_only). One round trip, so a sweep costs
        little when everything is sent."""
        ...

    async def acquire(self, parent: Parent, subscription_id: str, token: str, ms: int) -> bool: ...

    async def renew(self, parent: Parent, subscription_id: str, token: str, ms: int) -> bool:
        """Extend the lease if it is still this token's (False: it was lost)."""
        ...

    async def release(self, parent: Parent, subscription_id: str, token: str) -> None: ...

    async def last_seq(self, parent: Parent) -> int: ...

    async def parent_metadata(self, parent: Parent) -> dict[str, Any]:
        """The queue's (or topic's) metadata; {} if it is gone."""
        ...

    async def messages_after(
        self, parent: Parent, position: int, limit: int
    ) -> list[tuple[int, Message | Unreadable | None]]:
        """(seq, message) in post order after position; None for a message
        that expired or was deleted before it could be delivered, Unreadable
        for one whose body cannot be decrypted."""
        ...

    async def note_failure(
        self, parent: Parent, subscription_id: str, token: str, error: str, due_ms: int
    ) -> bool:
        """Record a failure outside any attempt (a bug in the loop) as a
        failed attempt at the next message, due again at due_ms; False if
        the token no longer holds the lease."""
        ...

    async def settle(
        self,
        parent: Parent,
        subscription_id: str,
        token: str,
        delivery: Delivery,
        outcome: str,
        clear_control: bool = False,
    ) -> bool:
        """Write position, attempts, due and last error (if any) if the lease
        is still this token's; count outcome "delivered" or "failed" ("": a
        retry was scheduled); clear_control: the confirmation request is done."""
        ...


MAX_REDRIVE_RATE = 1000  # the largest max_per_second of a redrive


@dataclass(frozen=True, slots=True)
class Redrive:
    """A dead-letter queue's redrive as it stands (``storage/redrive.py``)."""

    state: str  # running, done, cancelled
    moved: int
    skipped: int  # left there: held by a claim, or no known source and no "to"
    remaining: int  # dead letters still to consider
    max_per_second: int
    to: str | None  # None: each back to the queue it came from
    started_at: int  # ms
    updated_at: int  # ms


class RedriveStore(Protocol):
    """Dead-letter queues' redrives: one per queue at a time, its progress in
    Redis, moved on in paced steps by whichever process holds its lease."""

    async def start(self, project: str, queue: str, max_per_second: int, to: str | None) -> Redrive:
        """QueueNotFound if no such queue, RedriveRunning if one runs."""
        ...

    async def get(self, project: str, queue: str) -> Redrive | None: ...
    async def cancel(self, project: str, queue: str) -> Redrive | None: ...
    async def running(self, limit: int) -> list[tuple[str, str]]: ...

    async def step(self, project: str, queue: str, owner: str) -> int | None:
        """One bounded, paced batch if owner holds (or may take) the lease:
        how many moved; None when it is not running."""
        ...


@dataclass(slots=True)
class StoreCounters:
    """Counters a load test or /metrics can read."""

    watch_retries: int = 0
    watch_conflicts_exhausted: int = 0
    watch_transactions: int = 0  # MULTI/EXEC blocks sent (executed or not)
    posts_combined: int = 0  # posts indexed in the same transaction or call as an earlier one
    noscript_reloads: int = 0
    cluster_redirects: int = 0
    read_retries: int = 0  # reads sent again after finding their connection closed
    not_replicated: int = 0  # writes answered 503: too few replicas confirmed them in time
    master_switches: int = 0  # new masters announced by the sentinels
    # messages passed over because they cannot be decrypted, each time one is met
    unreadable_skipped: int = 0
    out_of_memory: int = 0  # writes Redis refused with OOM (answered 503)
    redis_calls: int = 0
    redis_seconds: float = 0.0


class Follow(Protocol):
    """A follower's view of its queue's wake-ups (see ``FeedStore.follow``).

    Take a token before reading; if the read finds nothing new, wait with
    it: a wake-up between the two is not lost."""

    @property
    def ended(self) -> bool:
        """The queue was deleted."""
        ...

    def token(self) -> asyncio.Event: ...

    async def wait(self, token: asyncio.Event, seconds: float) -> bool:
        """Until woken (True) or seconds pass (False)."""
        ...

    @property
    def frees(self) -> int:
        """How many wake-ups so far may have freed a claimed message: all
        but a post's (a release, a timer, a new or lost subscription). A
        reader that passed claimed messages reads them again when it grows."""
        ...

    def due(self, at_ms: int) -> None:
        """Wake the queue's followers in this process at at_ms (the store's
        clock): something becomes visible then that no post will announce
        (a delayed message falls due, a claim expires). One timer per queue:
        the earliest asked for; a later moment is learnt again by the read
        that follows it."""
        ...


class FollowerCounts(Protocol):
    """Each process's followers of a queue, for any process's /metrics."""

    async def report(self, counts: dict[tuple[str, str], int], ttl_ms: int) -> None:
        """This process's followers of these (project, queue)s: each count
        holds for ttl_ms unless reported again; 0 withdraws its report."""
        ...

    async def count(self, project: str, queue: str) -> int:
        """The queue's followers in every process whose report still holds."""


@dataclass(frozen=True, slots=True)
class RateGrant:
    """What one call took from a project's request-rate bucket."""

    granted: int  # requests allowed, 0..want
    retry_after_ms: int  # when none is: until the bucket holds one again
    rate: float  # the project's rate in force (its override or the default); 0: no limit
    burst: int


class RateLimitStore(Protocol):
    """Projects' request-rate buckets, shared by every process on the Redis
    (``storage/rate_limits.py``)."""

    async def take(
        self, project: str, want: int, now_ms: int, rate: float, burst: int
    ) -> RateGrant:
        """Up to want requests of the project's bucket at now_ms. rate (per
        second) and burst are the defaults; the project's limits hash
        (``keys.project_limits_key``: fields rate, burst) overrides them.
        StorageUnavailable on Redis trouble."""


#: The fields of a project's limits (``keys.project_limits_key``): its
#: quotas, then the rate limiter's rate and burst.
LIMIT_FIELDS = ("max_messages", "max_queues", "rate", "burst")


class ProjectLimits(Protocol):
    """What the admin API needs of a project's limits (``quotas.ProjectQuotas``)."""

    def defaults(self) -> dict[str, int]:
        """The service's quotas (0: none), by field."""
        ...

    async def limits(self, project: str) -> dict[str, int | float | None]:
        """The project's own limits by LIMIT_FIELDS (None: the default applies)."""
        ...

    async def set_limits(self, project: str, values: dict[str, int | float | None]) -> None:
        """Set the limits given (None: back to the default), in one step."""
        ...

    async def reset(self, project: str) -> None: ...

    async def usage(self, project: str) -> dict[str, int]:
        """Live messages, queues, topics and messages in flight of the project."""
        ...


class FeedStore(Protocol):
    """What the HTTP layer needs from storage. Both drivers implement it.

    Projects and queue names arrive validated. Message and claim ids arrive
    validated as well-formed (lowercase hex); unknown ids are simply absent.
    """

    name: str

    @property
    def counters(self) -> StoreCounters: ...

    @property
    def quotas(self) -> ProjectLimits:
        """The project quotas and limits (see ``feedsvc.storage.quotas``)."""
        ...

    async def open(self) -> None:
        """Get ready to serve (the lua driver loads its scripts). Redis being
        unreachable is logged, not raised: the service starts anyway and
        answers 503 until Redis is back."""
        ...

    def follow(self, project: str, queue: str) -> AbstractAsyncContextManager[Follow]:
        """Wake-ups for a queue's followers in this process: after a post to
        it, when a delayed message falls due, when it is deleted (``ended``),
        and once after the subscription was lost. Subscribes on first use,
        unsubscribes when the last follower leaves; costs Redis nothing
        while waiting. See ``feedsvc.storage.notifier``."""
        ...

    async def ping(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Point-in-time numbers for /metrics: counters, pool and batch state."""
        ...

    def eviction_report(self) -> dict[str, Any]:
        """For /v2/health: each Redis primary's maxmemory-policy and whether
        writes are refused for it (``feedsvc.storage.memory_policy``)."""
        ...

    async def close(self) -> None: ...

    def topics(self) -> FeedStore:
        """The same store on the project's topics (Zaqar's /v2/topics): every
        operation below works on a topic as on a queue, with the same records
        and guarantees, in a namespace of its own (a topic and a queue of one
        name never share a key). Topics are not claimed (Zaqar has no topic
        claims), but nothing here forbids it; the HTTP layer offers no route."""
        ...

    async def create_queue(self, project: str, queue: str, metadata: dict[str, Any]) -> bool:
        """Create the queue if missing (True) or leave it as it is (False)."""
        ...

    async def get_queue_metadata(self, project: str, queue: str) -> dict[str, Any] | None:
        """The user metadata of the queue, or None if it does not exist."""
        ...

    async def delete_queue(self, project: str, queue: str) -> None:
        """Delete the queue and every key it owns; no error if missing."""
        ...

    async def list_queues(
        self, project: str, marker: str | None, limit: int, detailed: bool
    ) -> list[QueueInfo]: ...

    async def count_queues(self, project: str) -> int: ...

    async def queue_stats(self, project: str, queue: str) -> QueueStats:
        """Live counts; a queue that does not exist has none."""
        ...

    async def tail_marker(self, project: str, queue: str) -> int:
        """The marker after which only messages posted from now on come: the
        queue's counter; 0 (the head) if it has none, nothing was posted."""
        ...

    @property
    def follower_counts(self) -> FollowerCounts:
        """Followers of queues counted over every process (see
        ``feedsvc.storage.follower_counts``)."""
        ...

    async def post_messages(
        self,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int = 0,
        idempotency_key: str | None = None,
    ) -> list[str]:
        """Store and index the messages in order; the queue is created if needed.

        PostTooLarge if request_size exceeds the queue's _max_messages_post_size.
        With an idempotency key this client already used on this queue within
        the idempotency window, nothing is written and the first post's ids
        are returned.
        """
        ...

    async def list_messages(self, project: str, queue: str, query: ListQuery) -> MessagePage: ...

    async def get_messages(self, project: str, queue: str, ids: list[str]) -> list[Message]:
        """The live messages among ``ids``, in the order asked; absent ids skipped."""
        ...

    async def delete_message(
        self, project: str, queue: str, message_id: str, claim_id: str | None
    ) -> None:
        """Delete one message. MessageIsClaimed if claimed and no claim_id;
        InvalidClaim if claim_id does not hold it. No error if absent."""
        ...

    async def delete_messages(self, project: str, queue: str, ids: list[str]) -> None:
        """Delete the messages, claimed or not (as Zaqar's bulk delete does)."""
        ...

    async def pop_messages(self, project: str, queue: str, limit: int) -> list[Message]:
        """Atomically remove and return up to limit unclaimed, due messages."""
        ...

    async def purge_queue(self, project: str, queue: str) -> None:
        """Delete every message and claim; keep the queue and its metadata."""
        ...

    async def update_queue_metadata(
        self,
        project: str,
        queue: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        """Replace the metadata by change(current) atomically; QueueNotFound if missing."""
        ...

    async def claim_messages(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | None:
        """Claim up to limit free messages (None: nothing claimable)."""
        ...

    async def try_claim(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | Unclaimable:
        """claim_messages, saying when to try again if nothing was claimable
        (learnt in the same call: no extra Redis command)."""
        ...

    async def get_claim(self, project: str, queue: str, claim_id: str) -> Claim:
        """A live claim and the messages it still holds; ClaimNotFound otherwise."""
        ...

    async def renew_claim(
        self, project: str, queue: str, claim_id: str, ttl: int, grace: int
    ) -> None:
        """Restart the claim's ttl from now; ClaimNotFound if missing or expired."""
        ...

    async def release_claim(self, project: str, queue: str, claim_id: str) -> None:
        """Free the claim's messages and wake the queue's waiters (as a post
        does); no error if the claim is gone."""
        ...

    async def release_message(
        self, project: str, queue: str, message_id: str, claim_id: str, delay: int
    ) -> None:
        """Take one message out of its live claim: claimable again after
        delay seconds, its claim count and life kept, the claim's other
        messages untouched; the queue's waiters are told. MessageNotFound if
        the message is gone, ClaimDoesNotHold if that claim does not hold it
        (now); nothing changes then."""
        ...

    @property
    def subscriptions(self) -> SubscriptionStore:
        """The subscriptions of this store's feeds (queues; topics on ``topics()``)."""
        ...

    @property
    def deliveries(self) -> DeliveryState:
        """The delivery state of every subscription, for the delivery workers."""
        ...

    @property
    def rate_limits(self) -> RateLimitStore:
        """Projects' request-rate buckets (``--project-rate``)."""
        ...

    @property
    def redrives(self) -> RedriveStore:
        """The redrives of dead-letter queues."""
        ...


def feed_of(store: FeedStore, parent: Parent) -> FeedStore:
    """The store on the parent's kind of feed: itself for a queue, its topic
    view for a topic."""
    return store.topics() if parent.kind == "topic" else store
