"""Subscription handlers: ``/v2/queues/{queue}/subscriptions`` (and the same
under ``/v2/topics/{topic}``), as Zaqar's
``transport/wsgi/v2_0/subscriptions.py`` answers them.

* ``POST`` creates (201 ``{"subscription_id"}``; the queue is created if
  missing). A subscriber the queue already has: 409 if it confirmed, else the
  confirmation request is sent again and the answer is 201 with its id, as
  Zaqar's; the subscription is left as it was (the request's ttl and options
  are not applied) and, beyond Zaqar, ``X-Subscription-Existing: true`` says so.
* ``GET`` lists by id (``marker``, ``limit``; a ``next`` link whenever the
  page is not empty), ``GET .../{id}``, ``PATCH .../{id}`` (subscriber, ttl,
  options: 204), ``DELETE .../{id}`` (204, also when missing),
  ``PUT .../{id}/confirm`` with ``{"confirmed": bool}`` (204).

Beyond Zaqar, a subscription shows its delivery state under ``delivery``.
With ``--require-confirmation`` the confirmation request (Zaqar's
SubscriptionConfirmation notification, with a pre-signed ``PUT`` of the
confirm path) is stored with the subscription and sent by the delivery
workers before anything else; ``confirmed: false`` sends Zaqar's
UnsubscribeConfirmation the same way.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any
from urllib.parse import urlencode

import orjson
from aiohttp import web

from feedsvc.api import spec
from feedsvc.api import subscription_rules as rules
from feedsvc.api import validation as v
from feedsvc.api.feeds import Feed
from feedsvc.api.handlers import json_response, read_body
from feedsvc.api.signed_urls import DATE_FORMAT, signature
from feedsvc.appkeys import CLOCK, DELIVERIES, SETTINGS
from feedsvc.errors import BadRequest, SubscriptionExists, SubscriptionNotFound
from feedsvc.storage.base import Subscription

# Ids are UUIDs made by the service; anything else cannot exist (and never
# reaches a key name).
#: On a 201 to a POST of a subscriber the queue already has (unconfirmed).
EXISTING_HEADER = "X-Subscription-Existing"
SUBSCRIPTION_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


async def _document(request: web.Request) -> Any:
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        return v.json_document(raw)
    except BadRequest:
        raise rules.unparsable() from None


def _kick(request: web.Request) -> None:
    """Have this process's delivery worker look now (not at its next sweep)."""
    deliverer = request.app.get(DELIVERIES)
    if deliverer is not None:
        deliverer.kick()


def _subscription_id(request: web.Request) -> str:
    sid = request.match_info["subscription_id"]
    if not SUBSCRIPTION_ID.match(sid):
        raise SubscriptionNotFound(sid)
    return sid


def subscription_json(sub: Subscription, now: int) -> dict[str, Any]:
    d = sub.delivery
    return {
        "id": sub.id,
        "source": sub.source,
        "subscriber": sub.subscriber,
        "ttl": sub.ttl,
        "age": sub.age(now),
        "options": sub.options,
        "confirmed": sub.confirmed,
        "delivery": {
            "delivered": d.delivered,
            "failures": d.failures,
            "retrying": d.attempts,
            "last_error": d.last_error,
        },
    }


def confirmation(
    request: web.Request, feed: Feed, sid: str, ttl: int, unsubscribe: bool = False
) -> bytes | None:
    """Zaqar's confirmation notification (None: confirmation is off)."""
    settings = request.app[SETTINGS]
    if not settings.require_confirmation or settings.signed_url_key is None:
        return None
    parent = feed.parent
    path = f"{feed.path}/subscriptions/{sid}/confirm"
    now = dt.datetime.fromtimestamp(request.app[CLOCK].now_ms() / 1000, dt.UTC)
    expires = (now + dt.timedelta(seconds=ttl)).strftime(DATE_FORMAT)
    if unsubscribe:
        kind = "UnsubscribeConfirmation"
        text = (
            f"You have unsubscribed successfully to the {parent.kind}: {parent.name}, "
            "you can resubscribe it by using confirmed=True."
        )
    else:
        kind = "SubscriptionConfirmation"
        text = f"You have chosen to subscribe to the {parent.kind}: {parent.name}"
    return orjson.dumps(
        {
            "WSGISubscribeURL": f"{request.scheme}://{request.host}{path}",
            "Message_Type": kind,
            "Message": text,
            "URL-Signature": signature(
                settings.signed_url_key, [path], ["PUT"], parent.project, expires
            ),
            "URL-Methods": "PUT",
            "URL-Paths": path,
            "X-Project-ID": parent.project,
            "URL-Expires": expires,
            "SubscribeBody": {"confirmed": True},
            "UnsubscribeBody": {"confirmed": False},
        }
    )


async def create_subscription(request: web.Request, feed: Feed) -> web.Response:
    parent = feed.parent
    settings = request.app[SETTINGS]
    subscriber, ttl, options = rules.posting(await _document(request), settings)
    store = feed.store
    if await store.get_queue_metadata(parent.project, parent.name) is None:
        await store.create_queue(parent.project, parent.name, {})
    made = await store.subscriptions.create(parent, subscriber, ttl, options)
    if not made.created and made.confirmed:
        raise SubscriptionExists()
    control = confirmation(request, feed, made.id, ttl)
    if control is not None:
        await store.subscriptions.request_confirmation(parent, made.id, control)
    _kick(request)
    response = json_response({"subscription_id": made.id}, status=201)
    response.headers["Location"] = request.path
    if not made.created:
        # Zaqar's 201 and id, which its clients expect; this says that the
        # subscription was there already and the request's ttl and options
        # were not applied (PATCH changes them)
        response.headers[EXISTING_HEADER] = "true"
    return response


async def list_subscriptions(request: web.Request, feed: Feed) -> web.Response:
    bounds = spec.rules(request.app[SETTINGS])
    query = request.query
    limit = v.integer(query, bounds.subscription_limit)
    marker = v.text(query, bounds.subscription_marker)
    found = await feed.store.subscriptions.list(feed.parent, marker, limit)
    now = request.app[CLOCK].now_ms()
    links = []
    if found:
        params = {"marker": found[-1].id}
        if bounds.subscription_limit.name in query:
            params["limit"] = str(limit)
        links.append({"rel": "next", "href": f"{request.path}?{urlencode(params)}"})
    return json_response(
        {"subscriptions": [subscription_json(s, now) for s in found], "links": links}
    )


async def get_subscription(request: web.Request, feed: Feed) -> web.Response:
    sub = await feed.store.subscriptions.get(feed.parent, _subscription_id(request))
    return json_response(subscription_json(sub, request.app[CLOCK].now_ms()))


async def patch_subscription(request: web.Request, feed: Feed) -> web.Response:
    subscriber, ttl, options = rules.patching(await _document(request), request.app[SETTINGS])
    await feed.store.subscriptions.update(
        feed.parent, _subscription_id(request), subscriber, ttl, options
    )
    response = web.Response(status=204)
    response.headers["Location"] = request.path
    return response


async def delete_subscription(request: web.Request, feed: Feed) -> web.Response:
    sid = request.match_info["subscription_id"]
    if SUBSCRIPTION_ID.match(sid):
        await feed.store.subscriptions.delete(feed.parent, sid)
    return web.Response(status=204)


async def confirm_subscription(request: web.Request, feed: Feed) -> web.Response:
    confirmed = rules.confirming(await _document(request))
    sid = _subscription_id(request)
    control = None
    if not confirmed:
        ttl = request.app[SETTINGS].default_subscription_ttl
        control = confirmation(request, feed, sid, ttl, unsubscribe=True)
    await feed.store.subscriptions.confirm(feed.parent, sid, confirmed, control)
    _kick(request)
    response = web.Response(status=204)
    response.headers["Location"] = request.path
    return response
