"""The domain error tree: what can go wrong, independent of HTTP.

Handlers and drivers raise these; one middleware (``feedsvc.api.middleware``)
maps them to Zaqar-style JSON ``{"title": ..., "description": ...}`` with the
status from ``FeedError.status``. Nothing else catches them.

::

    FeedError
    ├── BadRequest                 400  malformed or out-of-range input
    │   ├── InvalidClaim           400  claim_id wrong or expired on delete
    │   ├── ClaimDoesNotHold       400  release of a message its claim does not hold
    │   │                               (gone, expired, another claim's, or never)
    │   ├── PostTooLarge           400  a message post over the service's or the
    │   │                               queue's size limit (Zaqar's status)
    │   ├── MarkerNotGivenOut      400  a marker or event id past the queue's last
    │   └── InvalidContentType     400  a body sent as a form (x-www-form-urlencoded)
    ├── Unauthorized               401  authentication required / refused
    ├── Forbidden                  403
    │   ├── InsufficientScope      403  the token's scope does not allow it
    │   ├── MessageIsClaimed       403  delete of a claimed message without claim_id
    │   └── QuotaExceeded          403  a post or queue over a quota (the title names it)
    │       ├── QueueFull               the queue's _max_messages
    │       ├── ProjectMessagesFull     the project's max_messages
    │       └── ProjectQueuesFull       the project's max_queues
    ├── NotFound                   404
    │   ├── QueueNotFound
    │   ├── MessageNotFound
    │   ├── ClaimNotFound
    │   └── SubscriptionNotFound
    ├── MethodNotAllowed           405
    ├── RequestTimeout             408  the client sent its body too slowly
    ├── Conflict                   409  e.g. json-patch replace of a missing key
    │   ├── SubscriptionExists          the queue has a subscription for that subscriber
    │   └── RedriveRunning              a redrive of that dead-letter queue is running
    ├── UnsupportedMediaType       415
    ├── RateLimited                429  the project is over its request rate
    │                                   (--project-rate; sent with Retry-After)
    ├── EncryptionUnavailable      500  an encrypted queue, and no (or another) key
    │   └── UnreadableMessage           one message cannot be decrypted (another
    │                                   key's, or altered): named reads only; a
    │                                   list, pop, claim or delivery skips it
    └── Unavailable                503  (always sent with Retry-After)
        ├── StorageUnavailable          Redis unreachable, timed out, loading
        │   ├── RedisOutOfMemory        Redis refused a write: at its maxmemory
        │   └── RedisMayEvict           a write refused: Redis may evict feedsvc's keys
        ├── PoolExhausted               no Redis connection free in time
        └── TooMuchContention           WATCH retries ran out

Any other body over what the service reads (262,144 bytes: claims, share) is
aiohttp's 413, shaped like these by the same middleware.
"""

from __future__ import annotations

from typing import ClassVar


class FeedError(Exception):
    """Base of every error that has a defined HTTP answer."""

    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal server error"

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class BadRequest(FeedError):
    status = 400
    title = "Invalid API request"


class InvalidClaim(BadRequest):
    title = "Unable to delete"


class ClaimDoesNotHold(BadRequest):
    """A release of one message names a claim that does not hold it now.
    400 as a delete with a wrong claim_id (:class:`InvalidClaim`), so a
    client handles one status for both."""

    title = "Unable to release"


class PostTooLarge(BadRequest):
    """A message post larger than the service's limit or the queue's own
    ``_max_messages_post_size``. 400, not 413: Zaqar treats both as failed
    validation, and python-zaqarclient turns a 400 into ``MalformedRequest``
    but has no exception of its own for a 413 (docs/zaqar-differences.md)."""


class MarkerNotGivenOut(BadRequest):
    """A marker (or Last-Event-ID) past the queue's counter: no page or event
    of this service named it. Taken, it would hide every message posted until
    the counter passed it; refused, the client learns that its id is bad."""

    title = "Unknown marker"


class InvalidContentType(BadRequest):
    title = "Invalid Content-Type"


class Unauthorized(FeedError):
    """No bearer token, or one that does not hold: RFC 6750's error code
    (invalid_token; none when no token was sent) goes in WWW-Authenticate."""

    status = 401
    title = "Authentication required"

    def __init__(self, description: str, error: str | None = None) -> None:
        super().__init__(description)
        self.error = error

    def challenge(self) -> str:
        return "Bearer" if self.error is None else f'Bearer error="{self.error}"'


class Forbidden(FeedError):
    status = 403
    title = "Forbidden"


class InsufficientScope(Forbidden):
    """A verified token whose scopes do not allow the action on that name."""

    def __init__(self, action: str, name: str | None) -> None:
        what = f"{action} on {name!r}" if name is not None else f"{action} on every name"
        super().__init__(f"The token's scope does not allow {what}.")
        self.scope = f"{action}:{name or '*'}"

    def challenge(self) -> str:
        return f'Bearer error="insufficient_scope", scope="{self.scope}"'


class MessageIsClaimed(Forbidden):
    title = "Unable to delete"


class QuotaExceeded(Forbidden):
    """A post (or a queue's creation) that would take a queue or a project
    over one of its quotas: refused whole, nothing of it stored. 403, as
    SQS answers OverLimit; the title names the quota (docs/design.md: Quotas)."""

    title = "Quota exceeded"


class QueueFull(QuotaExceeded):
    title = "Quota exceeded: _max_messages"


class ProjectMessagesFull(QuotaExceeded):
    title = "Quota exceeded: max_messages"


class ProjectQueuesFull(QuotaExceeded):
    title = "Quota exceeded: max_queues"


class NotFound(FeedError):
    status = 404
    title = "Not found"


class QueueNotFound(NotFound):
    def __init__(self, queue: str, noun: str = "Queue") -> None:
        super().__init__(f"{noun} {queue} does not exist.")


class MessageNotFound(NotFound):
    def __init__(self, message_id: str) -> None:
        super().__init__(f"Message {message_id} does not exist.")


class ClaimNotFound(NotFound):
    def __init__(self, claim_id: str) -> None:
        super().__init__(f"Claim {claim_id} does not exist.")


class SubscriptionNotFound(NotFound):
    def __init__(self, subscription_id: str) -> None:
        super().__init__(f"Subscription {subscription_id} does not exist.")


class MethodNotAllowed(FeedError):
    status = 405
    title = "Method not allowed"


class RequestTimeout(FeedError):
    status = 408
    title = "Request timeout"


class Conflict(FeedError):
    status = 409
    title = "Conflict"


class SubscriptionExists(Conflict):
    def __init__(self) -> None:
        # Zaqar's words
        super().__init__(
            "Such subscription already exists. Subscriptions are unique by "
            "project + queue + subscriber URI."
        )


class RedriveRunning(Conflict):
    def __init__(self, queue: str) -> None:
        super().__init__(
            f"A redrive of {queue} is running; cancel it (DELETE) or wait until it is done."
        )


class UnsupportedMediaType(FeedError):
    status = 415
    title = "Unsupported media type"


class RateLimited(FeedError):
    """The project has used its request rate (``--project-rate``, or its own
    in the limits hash): nothing was done. retry_after is when the next
    request will be allowed, in whole seconds rounded up."""

    status = 429
    title = "Too many requests"

    def __init__(self, retry_after: int) -> None:
        super().__init__(
            "This project is over its request rate; retry after "
            f"{retry_after} second{'s' if retry_after != 1 else ''}."
        )
        self.retry_after = retry_after


class EncryptionUnavailable(FeedError):
    """A queue's messages are encrypted and the service lacks the key (or has
    another one): the operator's to fix, not the client's, and retrying will
    not help until then, so 500 rather than 503. Nothing is lost or changed."""

    status = 500
    title = "Message encryption unavailable"


class UnreadableMessage(EncryptionUnavailable):
    """One message's body cannot be decrypted with the service's keys (sealed
    with another key, or altered in storage). Raised where the message was
    asked for by id; everywhere else it is skipped, logged and counted."""


class Unavailable(FeedError):
    status = 503
    title = "Service temporarily unavailable"
    retry_after: ClassVar[int] = 1


class StorageUnavailable(Unavailable):
    pass


class RedisOutOfMemory(StorageUnavailable):
    """Redis refused a write with OOM: it is at its ``maxmemory`` and, as
    feedsvc requires, evicts nothing. The write did not happen; reads go on,
    and writes succeed again once memory is freed (messages expire, queues
    are deleted, maxmemory is raised)."""

    title = "Redis is out of memory"
    retry_after = 5


class RedisMayEvict(StorageUnavailable):
    """A write refused because a Redis primary's maxmemory-policy may evict
    feedsvc's keys (``feedsvc.storage.memory_policy``): it would be lost
    without a word. Reads go on; writes resume once the policy is noeviction."""

    title = "Redis may evict data"
    retry_after = 5


class TooManyFollowers(Unavailable):
    """The process serves --max-followers streams and long polls already."""


class NotReplicated(StorageUnavailable):
    """A write done on the primary but not confirmed by --min-replicas-ack
    replicas in time: it may or may not survive a failover."""


class PoolExhausted(Unavailable):
    pass


class TooMuchContention(Unavailable):
    pass
