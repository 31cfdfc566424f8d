"""What a client may send, said once: every query parameter and numeric body
field with its type, bounds and default, the names' and ids' patterns, and
which query parameters each route reads.

Both sides read it: ``feedsvc.api.validation`` holds requests to these rules
(its readers take a :class:`Param` or a :class:`Field`), and the OpenAPI
document (``feedsvc.api.openapi``) describes them from the same objects, so
the two cannot drift. The bounds that come from the settings are built once
per :class:`~feedsvc.config.Settings` (:func:`rules`); the handlers look them
up on every request, so that lookup is one identity check.
``tests/test_openapi_spec.py`` holds the handlers to the table: every query
parameter a handler reads is declared for its route, and every one declared
is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from feedsvc.auth import access
from feedsvc.config import MAX_QUOTA, Settings

#: A queue's or topic's name. "." and ".." are refused: HTTP clients (curl,
#: requests) resolve them out of a URL path, so such a queue could be made
#: but never reached.
MAX_NAME_LENGTH = 64
NAME_PATTERN = rf"^(?!\.\.?$)[a-zA-Z0-9_.-]{{1,{MAX_NAME_LENGTH}}}$"
#: A queue list marker is a place in the sorted names, not a queue that must
#: exist, so it may be any string that could sort among them.
QUEUE_MARKER_PATTERN = rf"^[a-zA-Z0-9_.-]{{1,{MAX_NAME_LENGTH}}}$"
#: Ids are made by the service (24 lowercase hex digits); anything else cannot
#: exist, which also keeps every id from forming another key.
ID_PATTERN = r"^[0-9a-f]{24}$"
#: What a message marker looks like (a sequence number).
MARKER_PATTERN = "^[0-9]{1,19}$"
#: X-Project-ID's longest, as tokens name projects too (feedsvc.auth.access).
MAX_PROJECT_LENGTH = access.MAX_PROJECT_LENGTH
#: The most claims a queue's _max_claim_count may allow.
MAX_CLAIM_COUNT = 2**31
#: The longest long poll, in seconds (as SQS's WaitTimeSeconds).
MAX_WAIT = 20.0
#: Zaqar's default claim limit, capped by the configured maximum.
ZAQAR_DEFAULT_CLAIM_LIMIT = 10
#: Zaqar's default page of subscriptions (not capped: as Zaqar).
DEFAULT_SUBSCRIPTIONS_PER_PAGE = 10
#: What flags accept besides true and false, in any case.
TRUE = ("true", "1", "yes", "on", "y", "t")
FALSE = ("false", "0", "no", "off", "n", "f")

# The routes' paths as routes.py writes them; topic routes read what their
# queue routes read (feedsvc.api.routes.FEED).
QUEUES = "/v2/queues"
QUEUE = "/v2/queues/{queue}"
TOPIC = "/v2/topics/{topic}"


Kind = Literal["integer", "number", "boolean", "string", "array"]


@dataclass(frozen=True, slots=True)
class Param:
    """One query parameter: its name, type, bounds, default and meaning."""

    name: str
    type: Kind
    description: str
    minimum: int | float | None = None
    maximum: int | float | None = None
    default: int | float | bool | None = None
    pattern: str | None = None
    enum: tuple[str, ...] | None = None
    #: arrays: the pattern of each item
    items_pattern: str | None = None
    required: bool = False
    in_: Literal["query"] = "query"


@dataclass(frozen=True, slots=True)
class Field:
    """An integer field of a JSON body: its bounds and default (None: none,
    or one that depends on the queue)."""

    name: str
    minimum: int
    maximum: int
    default: int | None = None
    #: what the error message calls its holder ("The message ttl must be ...")
    owner: str = "message"
    #: whether null is allowed too (and means: not set)
    nullable: bool = False


def _flag(name: str, description: str) -> Param:
    return Param(name, "boolean", description, default=False)


def _limit(description: str, high: int, default: int) -> Param:
    return Param("limit", "integer", description, 1, high, default)


@dataclass(frozen=True, slots=True)
class Rules:
    """Every bound a client's input is held to, under one Settings."""

    queue_marker: Param
    queue_limit: Param
    detailed: Param
    with_count: Param
    message_marker: Param
    message_limit: Param
    wait: Param
    start: Param
    echo: Param
    include_claimed: Param
    include_delayed: Param
    ids: Param
    pop: Param
    claim_id: Param
    release_claim_id: Param
    claim_limit: Param
    claim_wait: Param
    subscription_limit: Param
    subscription_marker: Param
    message_ttl: Field
    message_delay: Field
    claim_ttl: Field
    claim_grace: Field
    release_delay: Field
    #: queue metadata's reserved integers, in the order they are checked
    metadata: tuple[Field, ...]
    messages_per_post: int
    post_size: int

    @classmethod
    def of(cls, s: Settings) -> Rules:
        claim_limit = min(ZAQAR_DEFAULT_CLAIM_LIMIT, s.max_messages_per_claim_or_pop)
        return cls(
            queue_marker=Param(
                "marker",
                "string",
                "List the queues after this name.",
                pattern=QUEUE_MARKER_PATTERN,
            ),
            queue_limit=_limit(
                "Queues per page.", s.max_queues_per_page, s.default_queues_per_page
            ),
            detailed=_flag("detailed", "Include each queue's metadata."),
            with_count=_flag("with_count", "Include the number of queues of the project."),
            message_marker=Param(
                "marker",
                "string",
                "Opaque position from a `next` link: the page starts after it. A marker this "
                "service did not give out is 400, and so is one past the queue's last message "
                "(title `Unknown marker`): taken, it would hide what is posted next.",
                pattern=MARKER_PATTERN,
            ),
            message_limit=_limit(
                "Messages per page.", s.max_messages_per_page, s.default_messages_per_page
            ),
            wait=Param(
                "wait",
                "number",
                "Long poll: seconds (decimals allowed) to hold the request while its answer "
                "would be empty, answering as soon as there is something (0: answer at once). "
                "Written as JSON writes a number, unsigned (`2`, `2.5`, `25e-1`); other "
                "spellings (`1_0`, `+1`, other scripts' digits) are 400.",
                0,
                MAX_WAIT,
                0,
            ),
            start=Param(
                "from",
                "string",
                "`tail`: start after the queue's last message, so that a stream or a long "
                "poll gives only messages posted from now on; a plain list answers an empty "
                "page whose next link carries the queue's last marker, to poll from. No other "
                "value, and not with marker (400); Last-Event-ID wins over it.",
                enum=("tail",),
            ),
            echo=_flag("echo", "Include this client's own messages."),
            include_claimed=_flag("include_claimed", "Include claimed messages."),
            include_delayed=_flag(
                "include_delayed", "Include messages whose delay has not passed."
            ),
            ids=Param(
                "ids",
                "array",
                f"Up to {s.max_messages_per_page} message ids, comma-separated.",
                1,
                s.max_messages_per_page,
                items_pattern=ID_PATTERN,
            ),
            pop=Param(
                "pop",
                "integer",
                "Remove and return up to this many free messages, atomically.",
                1,
                s.max_messages_per_claim_or_pop,
                1,
            ),
            claim_id=Param(
                "claim_id",
                "string",
                "The claim that holds the message; a claim that does not hold it is 400.",
            ),
            release_claim_id=Param(
                "claim_id",
                "string",
                "The claim that holds the message. A claim that does not hold it now "
                "(expired, released, another claim's) is 400 and changes nothing.",
                required=True,
            ),
            claim_limit=_limit(
                "Most messages to claim.", s.max_messages_per_claim_or_pop, claim_limit
            ),
            claim_wait=Param(
                "wait",
                "number",
                "Seconds (decimals allowed) to wait for something claimable when "
                "nothing is now: the claim is made as soon as a message can be "
                "claimed, else 204 after the wait, or at once when the service "
                "begins to stop (0: answer at once).",
                0,
                MAX_WAIT,
                0,
            ),
            subscription_limit=Param(
                "limit",
                "integer",
                "",
                1,
                s.max_subscriptions_per_page,
                DEFAULT_SUBSCRIPTIONS_PER_PAGE,
            ),
            subscription_marker=Param("marker", "string", "The last id of the previous page."),
            message_ttl=Field("ttl", s.min_message_ttl, s.max_message_ttl, s.default_message_ttl),
            message_delay=Field("delay", 0, s.max_message_delay, 0),
            claim_ttl=Field("ttl", s.min_claim_ttl, s.max_claim_ttl, s.default_claim_ttl, "claim"),
            claim_grace=Field(
                "grace", s.min_claim_grace, s.max_claim_grace, s.default_claim_grace, "claim"
            ),
            release_delay=Field("delay", 0, s.max_message_delay, 0, "release"),
            metadata=(
                Field("_default_message_ttl", s.min_message_ttl, s.max_message_ttl),
                Field(
                    "_dead_letter_queue_messages_ttl",
                    s.min_message_ttl,
                    s.max_message_ttl,
                    nullable=True,
                ),
                Field("_default_message_delay", 0, s.max_message_delay),
                Field("_max_messages_post_size", 1, s.max_messages_post_size),
                Field("_max_claim_count", 1, MAX_CLAIM_COUNT, nullable=True),
                Field("_max_messages", 1, MAX_QUOTA, nullable=True),
            ),
            messages_per_post=s.max_messages_per_post,
            post_size=s.max_messages_post_size,
        )

    def query(self, method: str, path: str) -> tuple[Param, ...]:
        """The query parameters the route reads, in the document's order; a
        topic route's are its queue route's."""
        path = path.replace(TOPIC, QUEUE).replace("/v2/topics", QUEUES)
        listing = (
            self.message_marker,
            self.message_limit,
            self.wait,
            self.start,
            self.echo,
            self.include_claimed,
            self.include_delayed,
            self.ids,
        )
        table: dict[tuple[str, str], tuple[Param, ...]] = {
            ("GET", QUEUES): (self.queue_marker, self.queue_limit, self.detailed, self.with_count),
            ("GET", QUEUE + "/messages"): listing,
            ("DELETE", QUEUE + "/messages"): (self.ids, self.pop),
            ("DELETE", QUEUE + "/messages/{message_id}"): (self.claim_id,),
            ("POST", QUEUE + "/messages/{message_id}/release"): (self.release_claim_id,),
            ("POST", QUEUE + "/claims"): (self.claim_limit, self.claim_wait),
            ("GET", QUEUE + "/subscriptions"): (self.subscription_limit, self.subscription_marker),
        }
        return table.get((method, path), ())


_MADE: list[tuple[Settings, Rules]] = []
_KEPT = 4


def rules(settings: Settings) -> Rules:
    """The rules under settings: made once, then found by identity (a
    service has one Settings; hashing one costs more than the check)."""
    for held, made in _MADE:
        if held is settings:
            return made
    made = Rules.of(settings)
    _MADE[:] = [(settings, made), *_MADE[: _KEPT - 1]]
    return made
