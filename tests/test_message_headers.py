"""Message headers (issue 32, point 5; docs/consumers.md#message-headers):
an object of strings posted with a message and returned wherever the
message is: list, get, get-many, claim, pop, a stream's events, a dead
letter, a webhook notification (and its traceparent/tracestate as HTTP
headers of the request). Every test runs on each driver (the ``http``
fixture); a webhook goes to a real local receiver.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from feedsvc.api.openapi import openapi_document
from feedsvc.api.routes import ACTIONS
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.message_headers import MAX_HEADERS, MAX_HEADERS_SIZE
from feedsvc.storage import record
from tests.test_api import (
    Client,
    Headers,
    error,
    follow,
    list_page,
    messages_path,
    ok_json,
    other_client,
    post,
)
from tests.test_delivery import Receiver, delivery_settings, service, subscribe
from tests.test_live import next_event, open_stream

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SENT = {"Trace-Kind": "order", "traceparent": TRACEPARENT, "x.y_z-1": ""}
STORED = {"trace-kind": "order", "traceparent": TRACEPARENT, "x.y_z-1": ""}


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A real webhook receiver on 127.0.0.1 (as tests/test_delivery.py's)."""
    found = Receiver()
    app = web.Application()
    app.router.add_post("/hook", found.handle)
    async with TestServer(app, host="127.0.0.1") as server:
        found.url = str(server.make_url("/hook"))
        yield found


async def claim(http: Client, headers: Headers, queue: str, limit: int = 1) -> tuple[str, Any]:
    """(claim id, claimed messages) of a claim that must succeed."""
    url = f"/v2/queues/{queue}/claims?limit={limit}"
    resp = await http.post(url, json={"ttl": 60}, headers=headers)
    doc = await ok_json(resp, 201)
    return resp.headers["Location"].rsplit("/", 1)[1], doc["messages"]


async def listed(http: Client, headers: Headers, queue: str, query: str = "") -> list[Any]:
    pages, _ = await follow(http, f"{messages_path(queue)}?limit=20{query}", headers)
    return [m for page in pages for m in page]


async def test_headers_come_back_wherever_the_message_is(http: Client, headers: Headers) -> None:
    q = "hq"
    ids = await post(
        http, headers, q, [{"body": 1, "headers": SENT}, {"body": 2}, {"body": 3, "headers": {}}]
    )
    reader = other_client(headers)
    # a list: names lower-cased; a message without headers (or with none) has no field
    shown = await listed(http, reader, q)
    assert [m.get("headers") for m in shown] == [STORED, None, None]
    assert "headers" not in shown[1]
    assert "headers" not in shown[2]
    # get one, get many
    one = await ok_json(await http.get(f"{messages_path(q)}/{ids[0]}", headers=reader))
    assert one["headers"] == STORED
    plain = await ok_json(await http.get(f"{messages_path(q)}/{ids[1]}", headers=reader))
    assert "headers" not in plain
    many = await ok_json(
        await http.get(f"{messages_path(q)}?ids={ids[0]},{ids[1]}", headers=reader)
    )
    assert {m["id"]: m.get("headers") for m in many["messages"]} == {ids[0]: STORED, ids[1]: None}
    # a claim carries them (and keeps them in the record: listed again)
    _, claimed = await claim(http, headers, q, limit=2)
    assert [m.get("headers") for m in claimed] == [STORED, None]
    again = await listed(http, reader, q, "&include_claimed=true")
    assert [m.get("headers") for m in again] == [STORED, None, None]
    # pop takes what is free: the third; then, after the claim is gone, the first
    popped = await ok_json(await http.delete(f"{messages_path(q)}?pop=1", headers=headers))
    assert [(m["body"], m.get("headers")) for m in popped["messages"]] == [(3, None)]
    q2 = "hq2"
    await post(http, headers, q2, [{"body": "p", "headers": SENT}])
    popped = await ok_json(await http.delete(f"{messages_path(q2)}?pop=1", headers=headers))
    assert [(m["body"], m["headers"]) for m in popped["messages"]] == [("p", STORED)]


async def test_a_client_s_own_messages_with_headers_stay_hidden_without_echo(
    http: Client, headers: Headers
) -> None:
    """The headers ride on the author's line of the record: the echo filter
    must still know the author (list.lua, the watch driver's list)."""
    await post(http, headers, "echo", [{"body": "mine", "headers": SENT}])
    assert await listed(http, headers, "echo") == []
    [mine] = await listed(http, headers, "echo", "&echo=true")
    assert mine["headers"] == STORED
    [seen] = await listed(http, other_client(headers), "echo")
    assert seen["body"] == "mine"


async def test_a_dead_letter_keeps_its_headers(http: Client, headers: Headers) -> None:
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "dlh"}
    assert (await http.put("/v2/queues/wh", json=metadata, headers=headers)).status == 201
    await post(http, headers, "wh", [{"body": "a", "ttl": 600, "headers": SENT}])
    claim_id, _ = await claim(http, headers, "wh")
    assert (await http.delete(f"/v2/queues/wh/claims/{claim_id}", headers=headers)).status == 204
    # the next claim moves it to the dead-letter queue, headers and all
    assert (
        await http.post("/v2/queues/wh/claims", json={"ttl": 60}, headers=headers)
    ).status == 204
    [dead] = await listed(http, headers, "dlh", "&echo=true")
    assert (dead["body"], dead["headers"]) == ("a", STORED)


async def test_topics_take_headers_the_same_way(http: Client, headers: Headers) -> None:
    url = "/v2/topics/ht/messages"
    resp = await http.post(url, json={"messages": [{"body": 1, "headers": SENT}]}, headers=headers)
    await ok_json(resp, 201)
    doc = await list_page(http, url + "?echo=true", headers)
    assert [m["headers"] for m in doc["messages"]] == [STORED]


def too_big() -> dict[str, str]:
    # under MAX_HEADERS headers, over MAX_HEADERS_SIZE bytes
    return {f"h{i}": "v" * (MAX_HEADERS_SIZE // 8) for i in range(10)}


BAD_HEADERS: list[tuple[str, Any]] = [
    ("not an object", ["traceparent"]),
    ("a string", "a: b"),
    ("null", None),
    ("a number value", {"n": 1}),
    ("a null value", {"n": None}),
    ("an object value", {"n": {"x": "y"}}),
    ("an empty name", {"": "v"}),
    ("a name with a space", {"a b": "v"}),
    ("a name with a colon", {"a:b": "v"}),
    ("a name starting with a dot", {".a": "v"}),
    ("a name too long", {"a" * 65: "v"}),
    ("a non-ASCII name", {"é": "v"}),
    ("a line break in a value", {"x": "a\r\nInjected: 1"}),
    ("a tab in a value", {"x": "a\tb"}),
    ("a name given twice", {"Kind": "a", "kind": "b"}),
    ("too many", {f"h{i}": "v" for i in range(MAX_HEADERS + 1)}),
    ("too big", too_big()),
    ("a bad traceparent", {"traceparent": "not-a-trace"}),
    ("an all-zero trace id", {"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}),
    ("an upper-case traceparent", {"traceparent": TRACEPARENT.upper()}),
    ("a tracestate too long", {"tracestate": "a=" + "b" * 600}),
]


@pytest.mark.parametrize(("case", "value"), BAD_HEADERS, ids=[c for c, _ in BAD_HEADERS])
async def test_bad_headers_are_400_and_nothing_of_the_batch_is_stored(
    http: Client, headers: Headers, case: str, value: Any
) -> None:
    q = "bad-" + uuid.uuid4().hex[:8]
    batch = {"messages": [{"body": "good"}, {"body": "bad", "headers": value}]}
    doc = await error(await http.post(messages_path(q), json=batch, headers=headers), 400)
    assert "headers" in doc["description"], (case, doc)
    assert await listed(http, headers, q, "&echo=true") == []


async def test_the_limits_themselves_are_accepted(http: Client, headers: Headers) -> None:
    most = {f"H{i}": "v" for i in range(MAX_HEADERS)}
    longest = {"a" * 64: "x" * (MAX_HEADERS_SIZE - 64 - 7)}  # {"<64>":"<...>"} = 4096 bytes
    assert len(orjson.dumps(longest)) == MAX_HEADERS_SIZE
    await post(
        http, headers, "edge", [{"body": 1, "headers": most}, {"body": 2, "headers": longest}]
    )
    shown = await listed(http, headers, "edge", "&echo=true")
    assert [m["headers"] for m in shown] == [{k.lower(): v for k, v in most.items()}, longest]


async def test_a_stream_event_carries_the_headers(http: Client, headers: Headers) -> None:
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)  # retry
        await post(http, other_client(headers), "q", [{"body": "s", "headers": SENT}])
        event = orjson.loads((await next_event(stream))["data"])
    finally:
        stream.close()
    assert (event["body"], event["headers"]) == ("s", STORED)


async def test_a_stream_hides_its_own_client_s_messages_with_headers(
    http: Client, headers: Headers
) -> None:
    """A stream's tail filters echo by each message's author, which the
    headers follow on the record's line (record.list_reply splits them)."""
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)  # retry
        await post(http, headers, "q", [{"body": "mine", "headers": SENT}])
        await post(http, other_client(headers), "q", [{"body": "theirs", "headers": SENT}])
        event = orjson.loads((await next_event(stream))["data"])
    finally:
        stream.close()
    assert (event["body"], event["headers"]) == ("theirs", STORED)


async def test_a_webhook_gets_the_headers_and_the_trace_context_as_http_headers(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    sent = {**SENT, "tracestate": "vendor=abc"}
    async with service(delivery_settings(settings), clock) as http:
        await subscribe(http, headers, receiver.url)
        resp = await http.post(
            "/v2/queues/news/messages",
            json={"messages": [{"body": "w", "ttl": 300, "headers": sent}, {"body": "plain"}]},
            headers=headers,
        )
        assert resp.status == 201, await resp.text()
        await receiver.until(2)
    [(first, _), (second, _)] = receiver.got
    assert receiver.bodies() == [
        {
            "body": "w",
            "ttl": 300,
            "queue_name": "news",
            "Message_Type": "Notification",
            "headers": {**STORED, "tracestate": "vendor=abc"},
        },
        {"body": "plain", "ttl": 3600, "queue_name": "news", "Message_Type": "Notification"},
    ]
    assert first["traceparent"] == TRACEPARENT
    assert first["tracestate"] == "vendor=abc"
    assert "trace-kind" not in {k.lower() for k in first}  # only the trace context
    assert "traceparent" not in {k.lower() for k in second}


def test_the_record_keeps_author_and_headers_apart() -> None:
    author = str(uuid.uuid4())
    stored = orjson.dumps(STORED)
    header = record.posted(author, 60, 1_000, 7, 0, 0, stored)
    raw = header.record(b'{"b":1}')
    assert record.Header.decode(raw) == header
    row = record.Row.read("id", raw, [None] * len(record.ROW))
    assert row is not None
    assert (row.author.decode(), row.headers, row.body) == (author, stored, b'{"b":1}')
    assert row.message(0).headers == stored
    # no headers: the record is exactly what it was before headers existed
    plain = record.posted(author, 60, 1_000, 7, 0)
    assert plain.record(b"1") == plain.fixed() + author.encode() + b"\n1"
    assert record.Row.read("id", plain.record(b"1"), []).message(0).headers is None  # type: ignore[union-attr]


def test_the_openapi_document_describes_the_headers() -> None:
    document = openapi_document(Settings(), ACTIONS)
    schemas = document["components"]["schemas"]
    posted, stored = schemas["MessageHeaders"], schemas["StoredMessageHeaders"]
    assert posted["maxProperties"] == MAX_HEADERS
    assert str(MAX_HEADERS_SIZE) in posted["description"]
    assert stored["propertyNames"]["pattern"] == "^[a-z0-9][a-z0-9._-]{0,63}$"
    ref = "#/components/schemas/"
    assert schemas["NewMessage"]["properties"]["headers"] == {"$ref": ref + "MessageHeaders"}
    assert schemas["Message"]["properties"]["headers"] == {"$ref": ref + "StoredMessageHeaders"}
    popped = schemas["PoppedMessages"]["properties"]["messages"]["items"]
    assert popped["properties"]["headers"] == {"$ref": ref + "StoredMessageHeaders"}
    for path in ("/v2/queues/{queue}/messages", "/v2/topics/{topic}/messages"):
        post = document["paths"][path]["post"]
        assert "traceparent" in {p.get("name") for p in post["parameters"]}, path
