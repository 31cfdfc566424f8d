"""The claims' routes in the OpenAPI document: claim (and wait for
something claimable), get, renew, release; and the release of one message's
body (``messages``)."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings

CLAIMS = "/v2/queues/{queue}/claims"


def _schemas(s: Settings) -> dict[str, Schema]:
    rules = spec.rules(s)
    return {
        "ClaimOptions": {
            "type": "object",
            "properties": {
                "ttl": shared.field(rules.claim_ttl),
                "grace": shared.field(rules.claim_grace),
            },
        },
        "ReleaseOptions": {
            "type": "object",
            "properties": {
                "delay": {
                    **shared.field(rules.release_delay),
                    "description": "Seconds before the message can be claimed again (0: at once).",
                },
            },
        },
        "ClaimedMessages": shared.obj(
            {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": shared.schema("Message"),
                }
            },
            ["messages"],
        ),
        "Claim": shared.obj(
            {
                "age": shared.integer(0),
                "ttl": shared.integer(1),
                "messages": {"type": "array", "items": shared.schema("Message")},
                "href": {"type": "string"},
            },
            ["age", "ttl", "messages", "href"],
        ),
    }


def _paths(document: Document, s: Settings) -> dict[str, Schema]:
    claims = CLAIMS
    claim = shared.common("Queue", "ClaimId")
    return {
        claims: {
            "post": shared.operation(
                "claimMessages",
                "Claim free messages",
                {
                    "201": shared.response(
                        "Claimed.", shared.schema("ClaimedMessages"), headers=shared.LOCATION
                    ),
                    "204": shared.response("Nothing to claim."),
                    **shared.errors(),
                },
                parameters=[*shared.common("Queue"), *shared.query(document, s, "POST", claims)],
                body=shared.json_body("ClaimOptions", required=False),
            )
        },
        claims + "/{claim_id}": {
            "get": shared.operation(
                "getClaim",
                "A live claim and the messages it holds",
                shared.ok("The claim.", "Claim", "404"),
                parameters=claim,
            ),
            "patch": shared.operation(
                "renewClaim",
                "Restart the claim's ttl from now",
                {"204": shared.done(), **shared.errors("404")},
                parameters=claim,
                body=shared.json_body("ClaimOptions", required=True),
            ),
            "delete": shared.operation(
                "releaseClaim",
                "Release the claim's messages",
                {"204": shared.done(), **shared.errors()},
                parameters=claim,
            ),
        },
    }


def add(document: Document, s: Settings) -> None:
    document["components"]["schemas"] |= _schemas(s)
    document["paths"] |= _paths(document, s)
