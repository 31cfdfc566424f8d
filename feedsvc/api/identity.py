"""The one place a request's bearer token and its scope are checked.

Run by ``feedsvc.api.middleware`` on every request once any token source is
set (``Authenticator.on``), after a pre-signed URL was checked: the route's
action comes from the table built with the routes (``routes.ACTIONS``), the
name from the route's ``{queue}`` or ``{topic}`` (``feeds.name_of``: the
feed's own; see ``feedsvc.api.feeds`` for why this check runs before the
feed is resolved). A route whose action is None is open; a request whose
pre-signed URL was verified is served for what the URL allows; any other
needs a bearer token (401) -- with ``--keystone-url`` a Keystone
``X-Auth-Token``, which wins over ``Authorization`` -- whose scopes allow
the action on that name (403), before its handler runs, so a refused
request changes nothing.

The token may instead come as ``access_token`` in the query string (RFC 6750
section 2.3), for what a browser's ``EventSource`` cannot do otherwise
(send a header): only on a GET or HEAD of a ``read`` route (403 elsewhere,
before the token is looked at), never together with an Authorization
header (400, as RFC 6750 says a client uses one method), and never written
to a log (``feedsvc.api.query_secrets``). docs/security.md says why that
much and no more. The admin routes are left to ``feedsvc.api.admin``, which
also takes the admin token. ``validation.caller`` then takes the project from
``request[IDENTITY]``.
"""

from __future__ import annotations

from aiohttp import web

from feedsvc.api.feeds import name_of
from feedsvc.api.validation import IDENTITY, SIGNED_PROJECT
from feedsvc.appkeys import AUTHENTICATOR, ROUTE_ACTIONS
from feedsvc.auth.access import ADMIN, Identity
from feedsvc.auth.keystone import KeystoneUnauthorized
from feedsvc.errors import BadRequest, Forbidden, InsufficientScope, Unauthorized

#: A route's action when its request names a claim: deleting a claimed
#: message (``?claim_id=``) is the consumer's, a claim action.
WITH_CLAIM_ID = {"delete": "claim"}
#: The query parameter a bearer token may come in (RFC 6750 section 2.3).
ACCESS_TOKEN = "access_token"
#: The methods and the route action a token in the query is accepted for.
QUERY_TOKEN_METHODS = ("GET", "HEAD")
QUERY_TOKEN_ACTION = "read"


def query_token(request: web.Request, action: str) -> str | None:
    """The ``access_token`` of the query string, if it has one and the
    request may use it (403 if not: a write, or a route that is no read)."""
    if not request.query_string or ACCESS_TOKEN not in request.query:
        return None
    if "Authorization" in request.headers:
        raise BadRequest(
            "Send the bearer token once: in the Authorization header or as access_token "
            "in the query string, not both."
        )
    if request.method not in QUERY_TOKEN_METHODS or action != QUERY_TOKEN_ACTION:
        raise Forbidden(
            "access_token in the query string is accepted for reads only (GET and HEAD "
            "of a read route); send 'Authorization: Bearer <token>'."
        )
    token = request.query[ACCESS_TOKEN].strip()
    if not token:
        raise Unauthorized("The access_token in the query string is empty.", "invalid_token")
    return token


def bearer_token(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("A valid 'Authorization: Bearer <token>' header is required.")
    return token


def action_of(request: web.Request) -> str | None:
    """What the request's route does (None: open to all, or no route)."""
    action = request.app[ROUTE_ACTIONS].get(request.match_info.route)
    if action is not None and "claim_id" in request.query:
        action = WITH_CLAIM_ID.get(action, action)
    return action


async def authorize(request: web.Request) -> None:
    """Sets ``request[IDENTITY]``; Unauthorized or InsufficientScope if the
    route needs a token the request lacks."""
    request[IDENTITY] = None
    action = action_of(request)
    if action is None or action == ADMIN or request[SIGNED_PROJECT]:
        return  # the admin API checks its own credential (feedsvc.api.admin)
    authenticator = request.app[AUTHENTICATOR]
    keystone = authenticator.keystone
    token = request.headers.get("X-Auth-Token")
    identity: Identity
    if keystone is not None and token is not None:
        identity = await authenticator.identify_keystone(token)
    elif (
        keystone is not None
        and "Authorization" not in request.headers
        and "access_token" not in request.query
    ):
        raise KeystoneUnauthorized("An 'X-Auth-Token' header (a Keystone token) is required.",
                                   keystone.uri)  # fmt: skip
    else:
        identity = await authenticator.identify(
            query_token(request, action) or bearer_token(request)
        )
    name = name_of(request)  # the name the feed will be resolved with (feeds.resolve)
    if not identity.allows(action, name):
        raise InsufficientScope(action, name)
    request[IDENTITY] = identity
