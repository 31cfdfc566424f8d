"""A request's feed is resolved once, by the kind its route was added with
(``feedsvc.api.feeds``), and live following waits through one owner of
"take the token, then read, then wait" (``feedsvc.services.live.Rounds``)."""

from __future__ import annotations

import uuid

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, make_mocked_request

from feedsvc.api.feeds import QUEUES, TOPICS, Kind, kind_of, resolve
from feedsvc.api.routes import add_routes
from feedsvc.api.validation import IDENTITY, SIGNED_PROJECT
from feedsvc.appkeys import STORE
from feedsvc.drain_signal import DrainSignal
from feedsvc.services.live import Rounds
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage

Client = TestClient[web.Request, web.Application]
#: The paths of each kind: the list, and everything below one feed.
PREFIXES = {
    QUEUES: ("/v2/queues", "/v2/queues/{queue}"),
    TOPICS: ("/v2/topics", "/v2/topics/{topic}"),
}


def misbound_routes(app: web.Application) -> list[str]:
    """Every route of a queue or a topic whose handler is not bound to the
    kind its path names (``feeds.on_feed``/``on_feeds``), and every other
    route that is bound to one."""
    wrong = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        named: Kind | None = None
        for kind, (listed, one) in PREFIXES.items():
            if path in (listed, one) or path.startswith(one + "/"):
                named = kind
        if "{queue}" in path or "{topic}" in path:
            assert named is not None, path  # a feed's name outside its kind's paths
        if kind_of(route.handler) is not named:
            wrong.append(f"{route.method} {path}")
    return wrong


def test_every_route_of_a_queue_or_topic_resolves_its_feed_by_its_kind() -> None:
    app = web.Application()
    add_routes(app, bench_routes=True)
    assert misbound_routes(app) == []
    bound = {kind_of(r.handler) for r in app.router.routes()}
    assert {QUEUES, TOPICS} <= bound


def test_a_route_added_without_its_kind_is_found() -> None:
    async def forgotten(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    add_routes(app)
    app.router.add_get("/v2/topics/{topic}/forgotten", forgotten)
    assert sorted(misbound_routes(app)) == [
        "GET /v2/topics/{topic}/forgotten",
        "HEAD /v2/topics/{topic}/forgotten",
    ]


def feed_request(app: web.Application, path: str, **match: str) -> web.Request:
    request = make_mocked_request(
        "GET",
        path,
        headers={"Client-ID": str(uuid.uuid4()), "X-Project-ID": "p"},
        match_info=match,
        app=app,
    )
    request[SIGNED_PROJECT] = ""  # what the middleware sets before any handler
    request[IDENTITY] = None
    return request


async def test_a_topic_route_resolves_the_topic_store(http: Client) -> None:
    app = http.app
    [route] = [
        r
        for r in app.router.routes()
        if r.method == "POST"
        and r.resource
        and r.resource.canonical == "/v2/topics/{topic}/messages"
    ]
    kind = kind_of(route.handler)
    assert kind is TOPICS
    feed = resolve(feed_request(app, "/v2/topics/news/messages", topic="news"), kind)
    store = app[STORE]
    assert feed.store is store.topics() and feed.store is not store
    assert (feed.project, feed.name, feed.path) == ("p", "news", "/v2/topics/news")
    assert feed.parent.kind == "topic"
    queue = resolve(feed_request(app, "/v2/queues/news/messages", queue="news"), QUEUES)
    assert queue.store is store and queue.path == "/v2/queues/news"
    # and through the route itself: the message lands in the topic, not the queue
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "p-" + uuid.uuid4().hex}
    document = {"messages": [{"body": "to the topic"}]}
    resp = await http.post("/v2/topics/news/messages", json=document, headers=headers)
    assert resp.status == 201, await resp.text()
    [href] = (await resp.json())["resources"]
    assert href.startswith("/v2/topics/news/messages/")
    everything = ListQuery("reader", limit=10, echo=True)
    project = headers["X-Project-ID"]
    in_topic = await store.topics().list_messages(project, "news", everything)
    in_queue = await store.list_messages(project, "news", everything)
    assert [m.body for m in in_topic.messages] == [b'"to the topic"']
    assert in_queue.messages == []


# -- Rounds ---------------------------------------------------------------------


async def test_rounds_end_at_the_deadline_with_or_without_a_last_read(
    store: FeedStore, project: str
) -> None:
    async with store.follow(project, "r") as follow:
        assert [n async for n in Rounds(follow, 0)] == [0]  # one read, no wait
        assert [n async for n in Rounds(follow, 0, read_at_deadline=False)] == []


async def test_rounds_stop_after_the_read_once_the_process_drains(
    store: FeedStore, project: str
) -> None:
    draining = DrainSignal()
    draining.set()
    async with store.follow(project, "r") as follow:
        assert [n async for n in Rounds(follow, 3600, draining)] == [0]


async def test_a_wake_up_between_the_read_and_the_wait_is_not_lost(
    store: FeedStore, project: str
) -> None:
    """The post's wake-up arrives after the round's token was taken and
    before the wait: the wait ends at once (were it lost, the round would
    wait its hour and the test time out)."""
    async with store.follow(project, "w") as follow:
        rounds = Rounds(follow, 3600)
        async for n in rounds:
            if n == 1:
                break
            woken = follow.token()
            await store.post_messages(project, "w", "writer", [NewMessage(orjson.dumps("x"), 300)])
            await woken.wait()  # the notification came, before the round's wait
        page = await store.list_messages(project, "w", ListQuery("reader", limit=10))
        assert len(page.messages) == 1


async def test_a_timer_asked_for_is_set_only_when_the_rounds_go_on(
    store: FeedStore, project: str
) -> None:
    async with store.follow(project, "d") as follow:
        rounds = Rounds(follow, 0)
        async for _ in rounds:
            rounds.due(1)  # long past: were it set, it would wake the follow
        woken = follow.token()
        assert not woken.is_set()
        rounds = Rounds(follow)
        async for n in rounds:
            if n == 1:
                break
            rounds.due(1)  # set before the wait: it ends the wait
        assert woken.is_set()
