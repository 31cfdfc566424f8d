"""Redrive of a dead-letter queue (a feedsvc extension; docs/consumers.md):
``POST``, ``GET`` and ``DELETE /v2/queues/{q}/redrive``.

The route's action is ``manage`` on the dead-letter queue; a redrive
``to`` a named queue also needs ``post`` on that queue (checked here, the
one route whose body names a second queue: ``feedsvc.api.identity`` checks
the path's name only).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from feedsvc.api import validation as v
from feedsvc.api.feeds import Feed
from feedsvc.api.handlers import iso8601_from_ms, json_response, read_body
from feedsvc.appkeys import REDRIVER
from feedsvc.errors import BadRequest, InsufficientScope, NotFound
from feedsvc.storage.base import MAX_REDRIVE_RATE as MAX_RATE
from feedsvc.storage.base import Redrive

_FIELDS = frozenset(("max_per_second", "to"))


def redrive_options(raw: bytes, dlq: str) -> tuple[int, str | None]:
    """(max_per_second, to) of ``{"max_per_second": N, "to": "queue"}``."""
    document = v.json_document(raw)
    if not isinstance(document, dict):
        raise BadRequest("A redrive body must be a JSON object.")
    unknown = sorted(set(document) - _FIELDS)
    if unknown:
        raise BadRequest(f"Unknown field {unknown[0]!r}: a redrive takes max_per_second and to.")
    rate = document.get("max_per_second")
    if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= MAX_RATE:
        raise BadRequest(f"max_per_second must be an integer from 1 to {MAX_RATE}.")
    to = document.get("to")
    if to is not None:
        if not isinstance(to, str) or not v.QUEUE_NAME.match(to):
            raise BadRequest("to must be a queue name.")
        if to == dlq:
            raise BadRequest("to must name another queue than the dead-letter queue.")
    return rate, to


def redrive_json(redrive: Redrive) -> dict[str, Any]:
    return {
        "state": redrive.state,
        "moved": redrive.moved,
        "skipped": redrive.skipped,
        "remaining": redrive.remaining,
        "max_per_second": redrive.max_per_second,
        "to": redrive.to,
        "started_at": iso8601_from_ms(redrive.started_at),
        "updated_at": iso8601_from_ms(redrive.updated_at),
    }


def _no_redrive(queue: str) -> NotFound:
    return NotFound(f"Queue {queue} has no redrive.")


async def start_redrive(request: web.Request, feed: Feed) -> web.Response:
    """Start moving the queue's dead letters back: 202 with its progress."""
    project, queue = feed.project, feed.name
    rate, to = redrive_options(await read_body(request), queue)
    identity = request[v.IDENTITY]
    if to is not None and identity is not None and not identity.allows("post", to):
        raise InsufficientScope("post", to)
    redrive = await feed.store.redrives.start(project, queue, rate, to)
    request.app[REDRIVER].kick()
    response = json_response(redrive_json(redrive), status=202)
    response.headers["Location"] = request.path
    return response


async def get_redrive(request: web.Request, feed: Feed) -> web.Response:
    redrive = await feed.store.redrives.get(feed.project, feed.name)
    if redrive is None:
        raise _no_redrive(feed.name)
    return json_response(redrive_json(redrive))


async def cancel_redrive(request: web.Request, feed: Feed) -> web.Response:
    """Stop a running redrive (what moved stays moved): 200 with its progress."""
    redrive = await feed.store.redrives.cancel(feed.project, feed.name)
    if redrive is None:
        raise _no_redrive(feed.name)
    return json_response(redrive_json(redrive))
