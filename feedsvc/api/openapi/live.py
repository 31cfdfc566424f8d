"""Live following in the OpenAPI document: the long poll's and the event
stream's parameters, the stream's answer, and the 503 of a process that
follows too many already (``feedsvc.api.streams``)."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings

EVENT_STREAM = "text/event-stream"


def message_list_or_stream(s: Settings) -> Schema:
    """200 of the message list: a JSON page, or (Accept: text/event-stream) a stream."""
    ok = shared.response("Messages.", shared.schema("MessageList"))
    ok["content"][EVENT_STREAM] = {
        "schema": {
            "type": "string",
            "description": "Server-Sent Events, UTF-8, one event per message, oldest first: "
            "`id: <marker>`, `event: message`, `data: <the message as a list page shows it "
            "(schema Message), one line of JSON>`, then a blank line. The stream starts "
            "after Last-Event-ID, else after marker, else at the head of the queue: the "
            "backlog first, then each message as it is posted, never an expired one or "
            "(without include_claimed) a claimed one; echo filters as on the list. It "
            f"opens with `retry: {s.stream_retry}` (milliseconds before a reconnect), "
            f"sends a `: heartbeat` comment after {s.stream_heartbeat:g} s without events, "
            "sends `event: end` with `data: {}` and closes if the queue is deleted, and "
            f"closes after about {s.stream_lifetime:g} s (+-10 %), at once when the "
            "service begins to stop, or when the client reads too slowly; reconnecting "
            "with the last id as Last-Event-ID loses and repeats nothing. If messages "
            "after the position it resumed from are gone unseen (expired, deleted), an "
            '`event: gap` with `data: {"missed": N, "first": "<marker>"}` comes just '
            "before the event whose id is that marker (messages filtered out are no "
            "gap). Redis "
            "trouble or too many followers before the stream starts are a JSON 503.",
            "example": "retry: 2000\n\nid: 1784124000000000001\nevent: message\n"
            'data: {"id":"...","href":"...","ttl":3600,"age":0,"body":"hi"}\n\n',
        }
    }
    ok["headers"]["Cache-Control"] = {
        "required": False,
        "description": "no-cache on an event stream.",
        "schema": {"type": "string"},
    }
    ok["headers"]["X-Gap"] = {
        "required": False,
        "description": "A list page or long poll after a marker: `missed=N; first=<marker>`, "
        "N messages between the marker and the page's next marker are gone unseen "
        "(expired, deleted; messages filtered out are no gap), and the marker of the "
        "page's first message, if it has one. Absent when nothing was missed.",
        "schema": {"type": "string", "pattern": "^missed=[0-9]+(; first=[0-9]+)?$"},
    }
    return ok


def add(document: Document, s: Settings) -> None:
    rules = spec.rules(s)
    components = document["components"]
    components["parameters"] |= {
        "Wait": shared.parameter(rules.wait),
        "From": shared.parameter(rules.start),
        "LastEventId": {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "Event stream only (Accept: text/event-stream): start after this "
            "event id, i.e. the marker of the last message received (what EventSource sends "
            "when it reconnects); it takes precedence over marker. An id this service did "
            "not give out is 400, one past the queue's last message too. Ignored by a "
            "plain list.",
            "schema": {"type": "string", "pattern": spec.MARKER_PATTERN},
        },
    }
    components["responses"]["UnavailableOrTooManyFollowers"] = shared.response(
        "Redis is unreachable, timed out, or too contended (or, for a write, out of "
        "memory or may evict data); or, for a long poll "
        "(wait > 0) or an event stream, this process already serves "
        f"--max-followers ({s.max_followers}) of them: try again later.",
        shared.schema("Error"),
        headers=shared.RETRY_AFTER,
    )
