"""The admin API: a project's quotas and limits, and its usage.

``/v2/admin/projects/{project}/limits`` (GET, PUT, DELETE) and
``/v2/admin/projects/{project}/usage`` (GET), for the operator, behind the
admin token (``--admin-token``, ``--admin-token-file`` or
``FEEDSVC_ADMIN_TOKEN``) sent as ``Authorization: Bearer <token>``, compared
in constant time, or also, once the admin token is set, a token from
``--auth-token-file`` or a JWT whose scope holds ``admin:PROJECT_GLOB``
(``feedsvc.auth.access``) matching the project. Without an admin token the routes
are 404: the service has no admin API (and posts pay no admission unless a
default quota is set). Any other caller, project tokens included, gets 403
(an unknown token 401 where tokens with scopes are checked). Under /v2 so
that one prefix routes the whole API (a proxy, the OpenAPI document), under
admin/ so that no queue or topic route can clash.
"""

from __future__ import annotations

import hmac
import math
from typing import Any

import orjson
from aiohttp import web

from feedsvc.api.handlers import json_response, read_body
from feedsvc.api.validation import MAX_PROJECT_LENGTH
from feedsvc.appkeys import ADMIN_TOKEN, AUTHENTICATOR, STORE
from feedsvc.auth.access import ADMIN
from feedsvc.config import MAX_QUOTA
from feedsvc.errors import BadRequest, Forbidden, InsufficientScope, NotFound
from feedsvc.storage.base import LIMIT_FIELDS, ProjectLimits

#: The largest rate (requests a second) and burst a project may be given.
MAX_RATE = 1_000_000
#: The smallest rate: lua/rate_limit.lua reads no override below it (as
#: --project-rate refuses one), so a smaller one would be stored and ignored.
MIN_RATE = 0.001


async def _admitted(request: web.Request) -> tuple[ProjectLimits, str]:
    """The quotas store and the project named in the path, for the admin only:
    the admin token, or a token (file or JWT) whose scope holds an
    ``admin:PROJECT_GLOB`` item matching the project."""
    secret = request.app[ADMIN_TOKEN]
    authenticator = request.app[AUTHENTICATOR]
    if secret is None:
        raise NotFound("This service has no admin API (the operator sets --admin-token).")
    project = request.match_info["project"]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Forbidden("The admin API needs 'Authorization: Bearer <admin token>'.")
    if not hmac.compare_digest(token.encode(), secret.encode()):
        if not authenticator.scoped:
            raise Forbidden("The admin API needs 'Authorization: Bearer <admin token>'.")
        identity = await authenticator.identify(token)  # Unauthorized if unknown
        if not identity.allows(ADMIN, project):
            raise InsufficientScope(ADMIN, project)
    if not 1 <= len(project) <= MAX_PROJECT_LENGTH:
        raise BadRequest(f"A project is 1 to {MAX_PROJECT_LENGTH} characters long.")
    return request.app[STORE].quotas, project


def _limit(name: str, value: Any) -> int | float | None:
    """A limit as PUT gives it, checked: None (back to the default) or a number in range."""
    if value is None:
        return None
    if name == "rate":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and math.isfinite(value) and MIN_RATE <= value <= MAX_RATE:
            rate: float = value
            return rate
        raise BadRequest(f"rate must be a number of requests a second, {MIN_RATE} to {MAX_RATE}.")
    high = MAX_RATE if name == "burst" else MAX_QUOTA
    low = 1 if name == "burst" else 0
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}.")
    return value


async def _limits_document(quotas: ProjectLimits, project: str) -> dict[str, Any]:
    own = await quotas.limits(project)
    defaults = quotas.defaults()
    effective = {name: own[name] if own[name] is not None else defaults[name] for name in defaults}
    return {"project": project, "limits": own, "defaults": defaults, "effective": effective}


async def get_project_limits(request: web.Request) -> web.Response:
    quotas, project = await _admitted(request)
    return json_response(await _limits_document(quotas, project))


async def put_project_limits(request: web.Request) -> web.Response:
    """Set the limits given (null: back to the service's default); the others stay."""
    quotas, project = await _admitted(request)
    try:
        body = orjson.loads(await read_body(request))
    except orjson.JSONDecodeError:
        raise BadRequest("The body must be a JSON object.") from None
    if not isinstance(body, dict) or not body:
        raise BadRequest(f"The body must be a JSON object of some of: {', '.join(LIMIT_FIELDS)}.")
    unknown = sorted(set(body) - set(LIMIT_FIELDS))
    if unknown:
        raise BadRequest(f"Unknown limits: {', '.join(unknown)}; known: {', '.join(LIMIT_FIELDS)}.")
    values = {name: _limit(name, value) for name, value in body.items()}
    await quotas.set_limits(project, values)
    return json_response(await _limits_document(quotas, project))


async def delete_project_limits(request: web.Request) -> web.Response:
    """Every limit of the project back to the service's default."""
    quotas, project = await _admitted(request)
    await quotas.reset(project)
    return web.Response(status=204)


async def get_project_usage(request: web.Request) -> web.Response:
    quotas, project = await _admitted(request)
    usage = await quotas.usage(project)
    document = await _limits_document(quotas, project)
    return json_response({"project": project, **usage, "limits": document["effective"]})
