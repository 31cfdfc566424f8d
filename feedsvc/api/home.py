"""The JSON-home document of ``GET /v2/``: Zaqar v2's, for the routes served.

Built from one compact table so that it lists exactly the templates the
router answers (a test checks the two agree).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

Q = "/v2/queues/{queue_name}"

# rel name -> (href template, allowed methods)
TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "queues": ("/v2/queues{?marker,limit,detailed,with_count}", ["GET"]),
    "queue": (Q, ["GET", "PUT", "DELETE", "PATCH"]),
    "queue_stats": (Q + "/stats", ["GET"]),
    "queue_purge": (Q + "/purge", ["POST"]),
    "messages": (
        Q + "/messages{?marker,limit,echo,include_claimed,include_delayed}",
        ["GET"],
    ),
    "post_messages": (Q + "/messages", ["POST"]),
    "messages_get": (Q + "/messages{?ids}", ["GET"]),
    "messages_delete": (Q + "/messages{?ids,pop}", ["DELETE"]),
    "message_get": (Q + "/messages/{message_id}", ["GET"]),
    "message_delete": (Q + "/messages/{message_id}{?claim_id}", ["DELETE"]),
    "claim": (Q + "/claims/{claim_id}", ["GET"]),
    "post_claim": (Q + "/claims{?limit}", ["POST"]),
    "patch_claim": (Q + "/claims/{claim_id}", ["PATCH"]),
    "delete_claim": (Q + "/claims/{claim_id}", ["DELETE"]),
    "ping": ("/v2/ping", ["GET", "HEAD"]),
    "health": ("/v2/health", ["GET"]),
}

_PARAMS = {"limit": "param/{rel}_limit"}


def _resource(rel: str, template: str, allow: list[str]) -> dict[str, Any]:
    names = re.findall(r"\{([a-z_]+)\}", template)
    names += [n for group in re.findall(r"\{\?([a-z_,]+)\}", template) for n in group.split(",")]
    kind = "queues" if rel == "queues" else "messages"
    variables = {n: _PARAMS.get(n, "param/{name}").format(rel=kind, name=n) for n in names}
    resource: dict[str, Any] = {
        "href-template" if variables else "href": template,
        "hints": {"allow": allow, "formats": {"application/json": {}}},
    }
    if variables:
        resource["href-vars"] = variables
    if "POST" in allow or "PUT" in allow:
        resource["hints"]["accept-post"] = ["application/json"]
    return resource


def home_document() -> dict[str, Any]:
    return {
        "resources": {
            f"rel/{rel}": _resource(rel, template, allow)
            for rel, (template, allow) in TEMPLATES.items()
        }
    }


HOME_DOCUMENT = orjson.dumps(home_document())
