"""The claims' routes in the OpenAPI document: claim (and wait for
something claimable), get, renew, release; and the release of one message's
body (``messages``)."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api.openapi.shared import (
    JSON,
    LOCATION,
    Document,
    Schema,
    common,
    done,
    errors,
    field,
    integer,
    obj,
    operation,
    query,
    response,
    schema,
)
from feedsvc.config import Settings

CLAIMS = "/v2/queues/{queue}/claims"


def _schemas(s: Settings) -> dict[str, Schema]:
    rules = spec.rules(s)
    return {
        "ClaimOptions": {
            "type": "object",
            "properties": {
                "ttl": field(rules.claim_ttl),
                "grace": field(rules.claim_grace),
            },
        },
        "ReleaseOptions": {
            "type": "object",
            "properties": {
                "delay": {
                    **field(rules.release_delay),
                    "description": "Seconds before the message can be claimed again (0: at once).",
                },
            },
        },
        "ClaimedMessages": obj(
            {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": schema("Message"),
                }
            },
            ["messages"],
        ),
        "Claim": obj(
            {
                "age": integer(0),
                "ttl": integer(1),
                "messages": {"type": "array", "items": schema("Message")},
                "href": {"type": "string"},
            },
            ["age", "ttl", "messages", "href"],
        ),
    }


def _paths(document: Document, s: Settings) -> dict[str, Schema]:
    claims = CLAIMS
    return {
        claims: {
            "post": operation(
                "claimMessages",
                "Claim free messages",
                {
                    "201": response("Claimed.", schema("ClaimedMessages"), headers=LOCATION),
                    "204": response("Nothing to claim."),
                    **errors(),
                },
                parameters=[*common("Queue"), *query(document, s, "POST", claims)],
                body={
                    "required": False,
                    "content": {JSON: {"schema": schema("ClaimOptions")}},
                },
            )
        },
        claims + "/{claim_id}": {
            "get": operation(
                "getClaim",
                "A live claim and the messages it holds",
                {"200": response("The claim.", schema("Claim")), **errors("404")},
                parameters=common("Queue", "ClaimId"),
            ),
            "patch": operation(
                "renewClaim",
                "Restart the claim's ttl from now",
                {"204": done(), **errors("404")},
                parameters=common("Queue", "ClaimId"),
                body={
                    "required": True,
                    "content": {JSON: {"schema": schema("ClaimOptions")}},
                },
            ),
            "delete": operation(
                "releaseClaim",
                "Release the claim's messages",
                {"204": done(), **errors()},
                parameters=common("Queue", "ClaimId"),
            ),
        },
    }


def add(document: Document, s: Settings) -> None:
    document["components"]["schemas"] |= _schemas(s)
    document["paths"] |= _paths(document, s)
