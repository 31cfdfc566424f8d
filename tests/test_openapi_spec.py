"""The OpenAPI document and the service it describes cannot drift apart.

Both are built from ``feedsvc.api.spec``; these tests hold the running app to
the document, so that a route, a query parameter or a limit that is in one
and not the other fails here:

* every route the app answers is an operation of the document, and back;
* every query parameter a handler reads is declared for its operation, and
  every one declared is read (the reads are recorded as the handlers run);
* every bound the document states (query parameters, body fields, metadata)
  is the one the service enforces, with the default settings and with
  others: the value at the bound is taken, one past it is a 400 that names
  it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler
from multidict import MultiMapping

from feedsvc.api.openapi import openapi_document
from feedsvc.api.routes import ACTIONS, ROUTES
from feedsvc.app import create_app
from feedsvc.config import Settings
from tests.conftest import make_settings
from tests.test_openapi import operations, resolve

Client = TestClient[web.Request, web.Application]
#: Routes the app answers that are not part of the API the document describes.
UNDESCRIBED = ("/metrics", "/console", "/bench/")
#: Query parameters a middleware reads on every route, before any handler
#: (described on the operations, read by no handler): none yet.
#: Query parameters read before the handler (middleware): a pre-signed URL's
#: parts in the query (signed_urls.mark_signed) and access_token
#: (identity.authorize), both for an EventSource, which sends no headers.
READ_BY_MIDDLEWARE: set[str] = {
    "URL-Signature",
    "URL-Expires",
    "URL-Methods",
    "URL-Paths",
    "X-Project-ID",
    "access_token",
}
ID = "0" * 24


def non_default(redis_url: str) -> Settings:
    """Every limit the document states moved off its default."""
    return make_settings(
        redis_url,
        max_messages_per_page=7,
        default_messages_per_page=5,
        max_message_ttl=600,
        default_message_ttl=300,
        max_message_delay=30,
        max_messages_per_claim_or_pop=4,
        max_queues_per_page=3,
        default_queues_per_page=2,
        max_subscriptions_per_page=5,
        max_messages_per_post=3,
        max_messages_post_size=100_000,
        min_claim_ttl=61,
        max_claim_ttl=99,
        default_claim_ttl=70,
        min_claim_grace=5,
        max_claim_grace=50,
        default_claim_grace=6,
    )


@pytest.fixture(params=["default", "non-default"])
def limits(request: pytest.FixtureRequest, redis_url: str) -> Settings:
    if request.param == "default":
        return make_settings(redis_url)
    return non_default(redis_url)


def query_of(document: dict[str, Any], operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The operation's query parameters by name."""
    params = (resolve(document, p) for p in operation["parameters"])
    return {p["name"]: p for p in params if p["in"] == "query"}


def filled(path: str) -> str:
    """A path with its parameters filled in (fresh queue and topic names)."""
    return path.format(
        queue="spec-" + uuid.uuid4().hex[:12],
        topic="spec-" + uuid.uuid4().hex[:12],
        message_id=ID,
        claim_id=ID,
        subscription_id=str(uuid.uuid4()),
        project="spec-project",
    )


def caller(project: str | None = None) -> dict[str, str]:
    """A new client's headers, in project (else a new one)."""
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project or "spec-" + uuid.uuid4().hex}


FEED = re.compile(r"^/v2/(queues|topics)/[^/]+")


# -- routes -----------------------------------------------------------------------------


@pytest.mark.parametrize("auth", [False, True], ids=["open", "tokens"])
def test_every_route_of_the_app_is_an_operation_and_back(redis_url: str, auth: bool) -> None:
    changes: dict[str, Any] = {"auth_token": "spec-secret=spec"} if auth else {}
    settings = non_default(redis_url).replace(**changes)
    app = create_app(settings)
    answered = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
        and route.method != "HEAD"  # every GET answers HEAD too
        and not route.resource.canonical.startswith(UNDESCRIBED)
    }
    document = openapi_document(settings, ACTIONS)
    described = {(method, path) for method, path, _ in operations(document)}
    assert answered - described == set(), "routed, not described"
    assert described - answered == set(), "described, not routed"
    assert answered == {(method, path) for method, path, _, _ in ROUTES}


# -- the query parameters each handler reads --------------------------------------------


class ReadsRecorded:
    """A request's query that notes every name a handler asks for."""

    def __init__(self, query: MultiMapping[str], reads: set[str]) -> None:
        self._query = query
        self._reads = reads

    def get(self, name: str, default: Any = None) -> Any:
        self._reads.add(name)
        return self._query.get(name, default)

    def getall(self, name: str, *default: Any) -> Any:
        self._reads.add(name)
        return self._query.getall(name, *default)

    def getone(self, name: str, *default: Any) -> Any:
        self._reads.add(name)
        return self._query.getone(name, *default)

    def __getitem__(self, name: str) -> str:
        self._reads.add(name)
        return self._query[name]

    def __contains__(self, name: object) -> bool:
        self._reads.add(str(name))
        return name in self._query

    def __iter__(self) -> Iterator[str]:
        self._reads.add("*")  # a handler that reads them all declares none
        return iter(self._query)

    def __len__(self) -> int:
        self._reads.add("*")
        return len(self._query)


def recording(reads: set[str]) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        # the handler's request.query is the recorder (aiohttp keeps a
        # request's computed properties in its _cache)
        request._cache["query"] = ReadsRecorded(request.query, reads)
        return await handler(request)

    return record


def example(param: dict[str, Any]) -> str:
    """A value for a declared query parameter that its reader takes."""
    schema = param["schema"]
    if "enum" in schema:
        return str(schema["enum"][0])
    kind = schema["type"]
    if kind == "boolean":
        return "false"
    if kind in ("integer", "number"):
        return str(schema.get("default", schema.get("minimum", 1)))
    if kind == "array" or param["name"] == "claim_id":
        return ID
    if schema.get("pattern", "").startswith("^[0-9]"):
        return "1"
    return "a"


async def test_each_handler_reads_exactly_the_query_parameters_described(
    redis_url: str,
) -> None:
    settings = make_settings(redis_url)
    document = openapi_document(settings, ACTIONS)
    reads: set[str] = set()
    app = create_app(settings)
    app.middlewares.append(recording(reads))
    wrong = []
    async with TestClient(TestServer(app)) as http:
        for method, path, operation in operations(document):
            declared = {
                name: param
                for name, param in query_of(document, operation).items()
                if name not in READ_BY_MIDDLEWARE
            }
            given = {name: example(param) for name, param in declared.items()}
            reads.clear()
            # once with none of them (the reads every request makes), once
            # with all of them (the reads that depend on what is given)
            for query in ({}, given):
                async with http.request(
                    method, filled(path), params=query, headers=caller()
                ) as resp:
                    assert resp.status < 500, (method, path, query, await resp.text())
            if reads != set(declared):
                wrong.append(
                    f"{method} {path}: read and not described {sorted(reads - set(declared))}, "
                    f"described and not read {sorted(set(declared) - reads)}"
                )
    assert not wrong, "\n".join(wrong)


# -- the limits -------------------------------------------------------------------------


async def judge(resp: Any, where: str, name: str, said: str) -> None:
    """A value past a bound ("out") is a 400 that names the parameter or
    field; one at the bound ("in") is not a 400."""
    if where == "out":
        assert resp.status == 400, said
        assert name in (await resp.json())["description"], said
    else:
        assert resp.status != 400, said + " " + await resp.text()


async def post_one(http: Client, path: str, project: str) -> None:
    """A message another client posted to the path's queue or topic, so that
    lists, long polls and claims there have something to answer at once."""
    feed = FEED.match(path)
    if feed is None:
        return
    resp = await http.post(
        f"{feed[0]}/messages", json={"messages": [{"body": 1}]}, headers=caller(project)
    )
    assert resp.status == 201, await resp.text()


def bounds(schema: dict[str, Any]) -> Iterator[tuple[str, int | float]]:
    """("in", a value at each bound) and ("out", one past it)."""
    if schema["type"] == "array":  # no ids at all is no list: not a bound to check
        low, high = None, schema["maxItems"]
    else:
        low, high = schema.get("minimum"), schema.get("maximum")
    if high is not None:
        yield "in", high
        yield "out", high + 1
    if low is not None:
        yield "in", low
        yield "out", low - 1


def spelled(schema: dict[str, Any], value: int | float) -> str:
    if schema["type"] == "array":
        return ",".join([ID] * int(value))
    return str(value)


async def test_query_limits_in_the_document_are_enforced(limits: Settings) -> None:
    document = openapi_document(limits, ACTIONS)
    project = "spec-" + uuid.uuid4().hex
    checked = 0
    async with TestClient(TestServer(create_app(limits))) as http:
        for method, path, operation in operations(document):
            for name, param in query_of(document, operation).items():
                schema = param["schema"]
                if schema["type"] not in ("integer", "number", "array"):
                    continue
                for where, value in bounds(schema):
                    if where == "out" and value < 0 and schema["type"] != "number":
                        continue  # "-1" is not ASCII digits: refused, but not by its bound
                    url = filled(path)
                    await post_one(http, url, project)
                    query = {name: spelled(schema, value)}
                    resp = await http.request(method, url, params=query, headers=caller(project))
                    said = f"{method} {path} {name}={query[name][:40]}: {resp.status}"
                    await judge(resp, where, name, said)
                    checked += 1
    # on queues and topics: limit of the list, messages (x2), subscriptions
    # (x2), pop, wait (x2), ids (x4, their maximum only); on claims: limit,
    # wait. Each at both ends, in and out.
    assert checked >= 56


async def claimed(http: Client, queue: str, headers: dict[str, str]) -> str:
    """The href (with ?claim_id=) of a message of a new claim on queue."""
    resp = await http.post(f"{queue}/messages", json={"messages": [{"body": 1}]}, headers=headers)
    assert resp.status == 201
    resp = await http.post(f"{queue}/claims", json={}, headers=headers)
    assert resp.status == 201, await resp.text()
    href: str = (await resp.json())["messages"][0]["href"]
    return href


#: Operations with an integer-bounded JSON body: its schema, and the body
#: that sets one field of it.
BODIES: list[tuple[str, str, str, Any]] = [
    ("POST", "/v2/queues/{queue}/messages", "NewMessage",
     lambda name, value: {"messages": [{"body": 1, name: value}]}),
    ("POST", "/v2/queues/{queue}/claims", "ClaimOptions", lambda name, value: {name: value}),
    ("PATCH", "/v2/queues/{queue}/claims/{claim_id}", "ClaimOptions",
     lambda name, value: {name: value}),
    ("POST", "/v2/queues/{queue}/messages/{message_id}/release", "ReleaseOptions",
     lambda name, value: {name: value}),
    ("PUT", "/v2/queues/{queue}", "QueueMetadata", lambda name, value: {name: value}),
]  # fmt: skip


async def test_body_limits_in_the_document_are_enforced(limits: Settings) -> None:
    document = openapi_document(limits, ACTIONS)
    schemas = document["components"]["schemas"]
    checked = 0
    # a post of 1,000 messages answers a Location of 1,000 ids
    async with TestClient(TestServer(create_app(limits)), max_field_size=1 << 16) as http:
        for method, path, name, body in BODIES:
            operation = document["paths"][path][method.lower()]
            taken = resolve(
                document, operation["requestBody"]["content"]["application/json"]["schema"]
            )
            if "messages" in taken["properties"]:  # a post: its messages
                taken = resolve(document, taken["properties"]["messages"]["items"])
            assert taken is schemas[name], (method, path)
            for field, schema in schemas[name]["properties"].items():
                if "maximum" not in schema:
                    continue
                for where, value in bounds({**schema, "type": "integer"}):
                    url = filled(path)
                    headers = caller()
                    if "{claim_id}" in path or "{message_id}" in path:
                        feed = FEED.match(url)
                        assert feed is not None
                        href = await claimed(http, feed[0], headers)
                        message, _, claim = href.partition("?claim_id=")
                        url = f"{message}/release?claim_id={claim}"
                        if "{claim_id}" in path:
                            url = f"{feed[0]}/claims/{claim}"
                    resp = await http.request(method, url, json=body(field, value), headers=headers)
                    said = f"{method} {path} {field}={value}: {resp.status}"
                    await judge(resp, where, field, said)
                    checked += 1
        # the messages of one post
        most = schemas["NewMessages"]["properties"]["messages"]["maxItems"]
        assert most == limits.max_messages_per_post
        for count, status in ((most, 201), (most + 1, 400)):
            resp = await http.post(
                filled("/v2/queues/{queue}/messages"),
                json={"messages": [{"body": n} for n in range(count)]},
                headers=caller(),
            )
            assert resp.status == status, (count, await resp.text())
    assert checked >= 40


#: Each setting that bounds what a client sends, and where the document
#: says it: query parameters ("METHOD path name": maximum, default) ...
QUERY_BOUNDS: dict[str, tuple[str, str | None]] = {
    "GET /v2/queues limit": ("max_queues_per_page", "default_queues_per_page"),
    "GET /v2/queues/{queue}/messages limit": ("max_messages_per_page", "default_messages_per_page"),
    "GET /v2/queues/{queue}/messages ids": ("max_messages_per_page", None),
    "DELETE /v2/queues/{queue}/messages ids": ("max_messages_per_page", None),
    "DELETE /v2/queues/{queue}/messages pop": ("max_messages_per_claim_or_pop", None),
    "POST /v2/queues/{queue}/claims limit": ("max_messages_per_claim_or_pop", None),
    "GET /v2/queues/{queue}/subscriptions limit": ("max_subscriptions_per_page", None),
}
#: ... and body fields ("Schema.field": minimum, maximum, default; None: not a setting).
FIELD_BOUNDS: dict[str, tuple[str | None, str, str | None]] = {
    "NewMessage.ttl": ("min_message_ttl", "max_message_ttl", "default_message_ttl"),
    "NewMessage.delay": (None, "max_message_delay", None),
    "ReleaseOptions.delay": (None, "max_message_delay", None),
    "QueueMetadata._default_message_ttl": ("min_message_ttl", "max_message_ttl", None),
    "QueueMetadata._default_message_delay": (None, "max_message_delay", None),
    "QueueMetadata._max_messages_post_size": (None, "max_messages_post_size", None),
    "ClaimOptions.ttl": ("min_claim_ttl", "max_claim_ttl", "default_claim_ttl"),
    "ClaimOptions.grace": ("min_claim_grace", "max_claim_grace", "default_claim_grace"),
}


def described_bounds(document: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(setting, where, the value the document states there)."""
    for where, (most, default) in QUERY_BOUNDS.items():
        method, path, name = where.split()
        schema = query_of(document, document["paths"][path][method.lower()])[name]["schema"]
        yield most, where, schema["maxItems" if schema["type"] == "array" else "maximum"]
        if default is not None:
            yield default, where, schema["default"]
    schemas = document["components"]["schemas"]
    for where, settings in FIELD_BOUNDS.items():
        schema_name, _, field = where.partition(".")
        described = schemas[schema_name]["properties"][field]
        for setting, key in zip(settings, ("minimum", "maximum", "default"), strict=True):
            if setting is not None:
                yield setting, where, described[key]
    post = schemas["NewMessages"]["properties"]["messages"]["maxItems"]
    yield "max_messages_per_post", "NewMessages.messages", post


def test_the_documents_bounds_are_the_settings(limits: Settings) -> None:
    """What the two tests above find enforced is what the operator set."""
    document = openapi_document(limits, ACTIONS)
    described = list(described_bounds(document))
    wrong = [
        f"{where}: {setting}={getattr(limits, setting)}, described {value}"
        for setting, where, value in described
        if value != getattr(limits, setting)
    ]
    assert not wrong, wrong
    # and the non-default settings move every one of them
    moved = {setting for setting, _, _ in described}
    other = non_default("redis://unused")
    assert [s for s in sorted(moved) if getattr(other, s) == getattr(Settings(), s)] == []
