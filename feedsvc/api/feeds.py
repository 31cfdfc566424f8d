"""A request's feed, resolved once: who asks, in which project, of which
queue or topic, on which store, under which path.

As Zaqar's ``before_hooks`` (``_require_client_id``, ``extract_project_id``,
``_validate_queue_identification``) run once before any responder, a feed
route's handler is bound, where ``feedsvc.api.routes`` adds it, to the kind
of feed its path names (:data:`QUEUES` or :data:`TOPICS`): :func:`on_feed`
resolves the request's :class:`Feed` (the caller's project and client id,
then the name, checked in that order, as Zaqar does) and hands it to the
handler, which then never works out its kind, store or path itself. The
lists of feeds (``/v2/queues``, ``/v2/topics``) get the same with no name
(:class:`Feeds`, :func:`on_feeds`). A new route under a queue or a topic is
written as ``async def handler(request, feed)`` and added with its kind;
``tests/test_feeds.py`` fails for a route under ``{queue}`` or ``{topic}``
that is not.

The scope check (``feedsvc.api.identity``) runs earlier, in the middleware,
and stays there: the project a feed is resolved in is the bearer token's,
so the token must be known first, and the project rate
(``--project-rate``) that the middleware admits before any handler counts
that same project. Both read the feed's name with :func:`name_of`. A
project's quotas are checked where the write happens, in the same script
or transaction (``FeedStore.post_messages``), so that two posts racing
cannot both pass; the feed carries the project they are counted in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Handler

from feedsvc.api import validation as v
from feedsvc.appkeys import LIVE, STORE, TOPIC_LIVE
from feedsvc.services.live import LiveFeeds
from feedsvc.storage.base import FeedStore, Parent


@dataclass(frozen=True, slots=True)
class Kind:
    """Queues or topics: a topic is a feed like a queue, kept apart from
    the queues (``FeedStore.topics``), without claims or share."""

    #: "queue" or "topic": the route's parameter, the subscriptions' parent kind
    name: Literal["queue", "topic"]
    #: the path of the list, and the prefix of each feed's path
    path: str
    #: the key of the list in a list's answer
    plural: str

    def store(self, app: web.Application) -> FeedStore:
        return app[STORE].topics() if self.name == "topic" else app[STORE]

    def live(self, app: web.Application) -> LiveFeeds:
        """This process's live followers of this kind (``feedsvc.services.live``)."""
        return app[TOPIC_LIVE] if self.name == "topic" else app[LIVE]


QUEUES = Kind("queue", "/v2/queues", "queues")
TOPICS = Kind("topic", "/v2/topics", "topics")


# Feeds and Feed are made on every request: not frozen, since a frozen
# dataclass sets each field through object.__setattr__ (about three times
# the cost of a plain one's __init__ for six fields). Nothing assigns to them.
@dataclass(slots=True)
class Feeds:
    """The caller of a list of feeds: its project and client id, the kind
    listed and its store."""

    kind: Kind
    project: str
    client: str
    store: FeedStore


@dataclass(slots=True)
class Feed(Feeds):
    """The caller of one queue or topic, its name (checked) and its path as
    hrefs show it (``/v2/queues/<name>``)."""

    name: str
    path: str

    @property
    def parent(self) -> Parent:
        """What subscriptions hang off on this route: the queue, or the topic."""
        return Parent(self.kind.name, self.project, self.name)

    @property
    def is_topic(self) -> bool:
        return self.kind is TOPICS


def name_of(request: web.Request) -> str | None:
    """The queue's or topic's name as the route matched it, unchecked; None
    on a route that names neither. The scope check reads it too."""
    info = request.match_info
    return info.get("queue") or info.get("topic")


def _caller(request: web.Request, kind: Kind) -> tuple[str, str, FeedStore]:
    """(project, client id, store) of a request on kind: BadRequest (or
    Unauthorized) for a caller that cannot be served."""
    project, client = v.caller(request)
    return project, client, kind.store(request.app)


def feeds_of(request: web.Request, kind: Kind) -> Feeds:
    """The request's caller on a list of kind."""
    return Feeds(kind, *_caller(request, kind))


def resolve(request: web.Request, kind: Kind) -> Feed:
    """The request's feed on a route of kind: the caller first, then the
    name (BadRequest if it cannot be one), as Zaqar checks them."""
    project, client, store = _caller(request, kind)
    name = v.feed_name(name_of(request) or "", kind.name)
    return Feed(kind, project, client, store, name, f"{kind.path}/{name}")


FeedHandler = Callable[[web.Request, Feed], Awaitable[web.StreamResponse]]
FeedsHandler = Callable[[web.Request, Feeds], Awaitable[web.StreamResponse]]


def on_feed(kind: Kind, handler: FeedHandler) -> Handler:
    """The route handler that resolves the request's feed of kind and
    hands it to handler (what ``routes`` adds for every feed route)."""

    async def resolved(request: web.Request) -> web.StreamResponse:
        return await handler(request, resolve(request, kind))

    return _marked(resolved, kind, handler)


def on_feeds(kind: Kind, handler: FeedsHandler) -> Handler:
    """The same for a list of feeds of kind (no name)."""

    async def resolved(request: web.Request) -> web.StreamResponse:
        return await handler(request, feeds_of(request, kind))

    return _marked(resolved, kind, handler)


#: The attribute on_feed and on_feeds set on what they make: the kind bound.
KIND_ATTRIBUTE = "feed_kind"


def _marked(resolved: Handler, kind: Kind, handler: Callable[..., object]) -> Handler:
    resolved.__name__ = resolved.__qualname__ = getattr(handler, "__name__", "handler")
    resolved.__doc__ = handler.__doc__
    setattr(resolved, KIND_ATTRIBUTE, kind)
    return resolved


def kind_of(handler: Handler) -> Kind | None:
    """The kind a route's handler was bound to (None: not a feed route)."""
    kind = getattr(handler, KIND_ATTRIBUTE, None)
    return kind if isinstance(kind, Kind) else None
