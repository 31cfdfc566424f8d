"""Topics in the OpenAPI document: the queue operations so far (subscriptions
included) on /v2/topics, without claims or share, as in Zaqar."""

from __future__ import annotations

from typing import Any

from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document
from feedsvc.config import Settings

# What topic operations show instead of a queue's: topics have their own
# names, their own list key, and only three reserved settings (no claims).
TOPIC_REFS = {
    "#/components/parameters/Queue": "#/components/parameters/Topic",
    "#/components/schemas/QueueMetadataShown": "#/components/schemas/TopicMetadataShown",
    "#/components/schemas/QueueList": "#/components/schemas/TopicList",
}
TOPIC_RESERVED = ("_max_messages_post_size", "_default_message_ttl", "_default_message_delay")


def _as_topic(node: Any) -> Any:
    """A queue operation's description, made a topic's."""
    if isinstance(node, dict):
        out = {k: _as_topic(value) for k, value in node.items()}
        if isinstance(out.get("$ref"), str):
            out["$ref"] = TOPIC_REFS.get(out["$ref"], out["$ref"])
        operation_id = out.get("operationId")
        if isinstance(operation_id, str):
            topical = operation_id.replace("Queue", "Topic")
            out["operationId"] = topical if topical != operation_id else operation_id + "InTopic"
        for text in ("summary", "description"):
            if isinstance(out.get(text), str):
                out[text] = out[text].replace("queue", "topic").replace("Queue", "Topic")
        return out
    if isinstance(node, list):
        return [_as_topic(item) for item in node]
    return node


def add(document: Document, s: Settings) -> None:
    """/v2/topics: the queue operations on topics, without claims (or share)."""
    components = document["components"]
    topic = dict(components["parameters"]["Queue"])
    topic |= {"name": "topic", "description": topic["description"].replace("Queue", "Topic")}
    components["parameters"]["Topic"] = topic
    components["schemas"]["TopicMetadataShown"] = {
        "allOf": [shared.schema("QueueMetadata")],
        "required": list(TOPIC_RESERVED),
    }
    components["schemas"]["TopicList"] = _as_topic(components["schemas"]["QueueList"])
    listed = components["schemas"]["TopicList"]
    listed["properties"]["topics"] = listed["properties"].pop("queues")
    listed["required"] = ["topics" if r == "queues" else r for r in listed["required"]]
    for path, item in list(document["paths"].items()):
        if path == "/v2/queues" or (
            path.startswith("/v2/queues/{queue}")
            and "/claims" not in path
            and not path.endswith("/release")  # a claim's too
        ):
            topical = path.replace("/v2/queues/{queue}", "/v2/topics/{topic}")
            document["paths"][topical.replace("/v2/queues", "/v2/topics")] = _as_topic(item)
