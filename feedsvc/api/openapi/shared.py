"""What every part of the OpenAPI document uses: the builders of schemas,
parameters, responses and operations, and the components all route groups
share (the error body, the caller's headers, the names and ids in paths,
the error responses).

A query parameter is never written here by hand: :func:`parameter` renders
a :class:`~feedsvc.api.spec.Param`, the object validation reads it with.
"""

from __future__ import annotations

from typing import Any

from feedsvc.api import spec
from feedsvc.api import validation as v
from feedsvc.api.spec import Field, Param
from feedsvc.config import Settings

Schema = dict[str, Any]
#: The document as it is built: parts add their paths and components to it.
Document = dict[str, Any]
JSON = "application/json"


#: A message body or a metadata value.
ANY_JSON: Schema = {
    "description": "Any JSON value, returned exactly as posted (integers of any size "
    f"too), nesting arrays and objects at most {v.MAX_JSON_DEPTH} levels deep."
}


def ref(kind: str, name: str) -> Schema:
    return {"$ref": f"#/components/{kind}/{name}"}


def schema(name: str) -> Schema:
    return ref("schemas", name)


def obj(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    """A JSON object with exactly these properties."""
    out: Schema = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        out["required"] = required
    return out


def integer(low: int | None = None, high: int | None = None, default: int | None = None) -> Schema:
    out: Schema = {"type": "integer"}
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    if default is not None:
        out["default"] = default
    return out


def field(rule: Field, with_default: bool = True) -> Schema:
    """The schema of a body's integer field."""
    if rule.nullable:
        return {"type": ["integer", "null"], "minimum": rule.minimum, "maximum": rule.maximum}
    return integer(rule.minimum, rule.maximum, rule.default if with_default else None)


_ALSO_ACCEPTED = ", ".join(f"{t}/{f}" for t, f in zip(spec.TRUE[1:], spec.FALSE[1:], strict=True))


def parameter(param: Param) -> Schema:
    """A query parameter, as the spec says validation reads it."""
    out: Schema = {"name": param.name, "in": param.in_, "required": param.required}
    kind: Schema = {"type": param.type}
    if param.type == "array":
        out |= {"style": "form", "explode": False}
        kind |= {"minItems": param.minimum, "maxItems": param.maximum}
        kind["items"] = {"type": "string", "pattern": param.items_pattern}
    enum = None if param.enum is None else list(param.enum)
    for key, value in (
        ("pattern", param.pattern),
        ("enum", enum),
        ("minimum", None if param.type == "array" else param.minimum),
        ("maximum", None if param.type == "array" else param.maximum),
        ("default", param.default),
    ):
        if value is not None:
            kind[key] = value
    out["schema"] = kind
    description = param.description
    if param.type == "boolean":
        description += f" Also accepted: {_ALSO_ACCEPTED}, in any case."
    if description:
        out["description"] = description
    return out


def query(document: Document, s: Settings, method: str, path: str) -> list[Schema]:
    """The query parameters the route reads (``spec.Rules.query``): each a
    reference to the component that describes it exactly, if there is one."""
    components = document["components"]["parameters"]
    out = []
    for param in spec.rules(s).query(method, path):
        described = parameter(param)
        name = next((n for n, c in components.items() if c == described), None)
        out.append(described if name is None else ref("parameters", name))
    return out


REQUEST_ID_HEADER: Schema = {
    "description": "Unique id of this request (also in the service log).",
    "required": True,
    "schema": {"type": "string", "pattern": "^req-"},
}
RETRY_AFTER_HEADER: Schema = {
    "description": "Seconds to wait before trying again.",
    "required": True,
    "schema": {"type": "integer", "minimum": 1},
}
RETRY_AFTER = {"Retry-After": RETRY_AFTER_HEADER}
LOCATION = {"Location": {"required": True, "schema": {"type": "string"}}}


def response(
    description: str,
    body: Schema | None = None,
    media_type: str = JSON,
    headers: dict[str, Schema] | None = None,
) -> Schema:
    out: Schema = {
        "description": description,
        "headers": {"X-Openstack-Request-Id": REQUEST_ID_HEADER, **(headers or {})},
    }
    if body is not None:
        out["content"] = {media_type: {"schema": body}}
    return out


def done(headers: dict[str, Schema] | None = None) -> Schema:
    """A 204."""
    return response("Done.", headers=headers)


def common(*extra: str) -> list[Schema]:
    """The caller's headers, then these components' parameters."""
    return [ref("parameters", name) for name in ("ClientId", "ProjectId", *extra)]


_ERRORS = {
    "400": "BadRequest",
    "403": "Forbidden",
    "404": "NotFound",
    "409": "Conflict",
    "415": "UnsupportedMediaType",
    "429": "TooManyRequests",
    "503": "Unavailable",
}


def errors(*statuses: str) -> dict[str, Schema]:
    """400, these, 429 (every route of a project counts against its rate,
    --project-rate) and 503."""
    statuses = ("400", *statuses, "429", "503")
    return {status: ref("responses", _ERRORS[status]) for status in statuses}


def ok(description: str, name: str, *statuses: str) -> dict[str, Schema]:
    """A 200 whose body is schema name, and the errors (these and every route's)."""
    return {"200": response(description, schema(name)), **errors(*statuses)}


def json_body(name: str, required: bool = True, description: str | None = None) -> Schema:
    out: Schema = {"required": required}
    if description is not None:
        out["description"] = description
    out["content"] = {JSON: {"schema": schema(name)}}
    return out


def operation(
    operation_id: str,
    summary: str,
    responses: dict[str, Schema],
    parameters: list[Schema] | None = None,
    body: Schema | None = None,
) -> Schema:
    out: Schema = {
        "operationId": operation_id,
        "summary": summary,
        "parameters": common() if parameters is None else parameters,
        "responses": responses,
    }
    if body is not None:
        out["requestBody"] = body
    return out


def _error(description: str, headers: dict[str, Schema] | None = None) -> Schema:
    return response(description, schema("Error"), headers=headers)


def _responses() -> dict[str, Schema]:
    return {
        "BadRequest": _error(
            "Malformed or out-of-range input: a missing or malformed Client-ID or "
            "X-Project-ID header, a bad queue name, parameter or body."
        ),
        "Forbidden": _error("The message is claimed and no claim_id was given."),
        "OverQuota": _error(
            "The post (or the queue's creation) would take the queue or its project over "
            "a quota; nothing of it is stored. The title names the quota: 'Quota "
            "exceeded: _max_messages' (the queue's live messages), 'Quota exceeded: "
            "max_messages' (the project's live messages across its queues and topics) "
            "or 'Quota exceeded: max_queues' (the project's queues and topics)."
        ),
        "NotFound": _error("No such resource (in this project and queue)."),
        "Conflict": _error("The json-patch replaces or removes a key that does not exist."),
        "UnsupportedMediaType": _error("The body is not of the media type this route takes."),
        "TooManyRequests": _error(
            "The project is over its request rate (--project-rate, or its own in the "
            "operator's limits): nothing was done; try again after Retry-After seconds.",
            headers=RETRY_AFTER,
        ),
        "Unavailable": _error(
            "Redis is unreachable, timed out, or too contended; or, for a write, Redis is "
            "out of memory (title 'Redis is out of memory') or may evict data (title "
            "'Redis may evict data': its maxmemory-policy is not noeviction): try again "
            "later.",
            headers=RETRY_AFTER,
        ),
    }


def _id(what: str) -> Schema:
    return {
        "name": f"{what}_id",
        "in": "path",
        "required": True,
        "description": f"A {what} id (24 lowercase hex digits); any other value is 404.",
        "schema": {"type": "string", "pattern": spec.ID_PATTERN},
    }


def _parameters(s: Settings) -> dict[str, Schema]:
    return {
        "ClientId": {
            "name": "Client-ID",
            "in": "header",
            "required": True,
            "description": "The client's UUID (with or without dashes); a client does not "
            "see its own messages in listings unless echo=true.",
            "schema": {"type": "string", "format": "uuid"},
        },
        "ProjectId": {
            "name": "X-Project-ID",
            "in": "header",
            "required": True,
            "description": "The project (tenant) every queue, message and claim belongs to; "
            f"1 to {spec.MAX_PROJECT_LENGTH} printable characters.",
            "schema": {"type": "string", "minLength": 1, "maxLength": spec.MAX_PROJECT_LENGTH},
        },
        "ProjectIdFromToken": {
            "name": "X-Project-ID",
            "in": "header",
            "required": False,
            "description": "Ignored here: with authentication on the project is the "
            "bearer token's.",
            "schema": {"type": "string"},
        },
        "IdempotencyKey": {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": "Repeating a POST with the same key (and Client-ID) within "
            f"{s.idempotency_window} s returns the first post's ids and posts nothing; "
            "1 to 255 printable characters.",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        },
        "Queue": {
            "name": "queue",
            "in": "path",
            "required": True,
            "description": "Queue name: ASCII letters, digits, '_', '.' and '-', 1 to "
            f"{spec.MAX_NAME_LENGTH}; not '.' or '..'.",
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": spec.MAX_NAME_LENGTH,
                "pattern": spec.NAME_PATTERN,
            },
        },
        "MessageId": _id("message"),
        "ClaimId": _id("claim"),
    }


def add(document: Document, s: Settings) -> None:
    """The components every route group uses."""
    components = document["components"]
    components["schemas"] |= {
        "Error": obj(
            {
                "title": {"type": "string", "minLength": 1},
                "description": {"type": "string", "minLength": 1},
            },
            ["title", "description"],
        ),
        "Link": obj(
            {"rel": {"type": "string", "enum": ["next"]}, "href": {"type": "string"}},
            ["rel", "href"],
        ),
    }
    components["parameters"] |= _parameters(s)
    components["responses"] |= _responses()
