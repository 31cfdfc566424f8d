"""The locustfile's own options: the flags (each also read from a
``LOCUST_*`` variable, and listed by the web UI under "Custom parameters")
and :class:`Options`, what a user reads of them. loadtest/README.md
describes each one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from locust.env import Environment


def add_options(parser: Any) -> None:
    def option(name: str, kind: type, default: Any, help: str) -> None:
        env = "LOCUST_" + name.upper().replace("-", "_")
        parser.add_argument(f"--{name}", type=kind, default=default, env_var=env, help=help)

    option("queues", int, 4, "number of queues producers post to")
    parser.add_argument(
        "--hot",
        action="store_true",
        default=False,
        env_var="LOCUST_HOT",
        help="hot-queue mode: every producer posts to the first queue",
    )
    option("queue-prefix", str, "lt", "queue names are <prefix>0, <prefix>1, ...")
    option("project", str, "loadtest", "X-Project-ID of every request")
    option("producer-weight", int, 4, "weight of the Producer class")
    option("observer-weight", int, 1, "weight of the Observer class")
    option("consumer-weight", int, 1, "weight of the Consumer class")
    option("long-poller-weight", int, 1, "weight of the LongPoller class")
    option("streamer-weight", int, 1, "weight of the Streamer class")
    option("observers", int, 0, "exact number of observers (0: by weight)")
    option("long-pollers", int, 0, "exact number of long pollers (0: by weight)")
    option("streamers", int, 0, "exact number of SSE streamers (0: by weight)")
    option("long-poll-wait", float, 20.0, "long pollers' wait=, seconds (0..20)")
    option("batch", int, 1, "a producer posts 1..BATCH messages per request")
    option("message-size", int, 100, "padding in each message body, bytes")
    option("ttl", int, 3600, "message ttl, seconds")
    option("page-size", int, 20, "observer page size (list limit, 1..20)")
    option("claim-limit", int, 10, "consumer claim limit (1..20)")
    option("poll-interval", float, 0.2, "observer wait at the end of a queue, seconds")
    option("producer-wait", float, 0.0, "producer wait between posts, seconds")
    option("timings-dir", str, "", "write per-request timings here at test stop")
    option("groups", int, 0, "groups per queue a producer's messages go to (0: none)")
    option("release-ratio", float, 0.0, "share of claimed messages consumers release (0..1)")
    option("release-delay", int, 0, "delay of a consumer's release, seconds")


@dataclass(frozen=True)
class Options:
    """The custom options, read once per user from Locust's parsed options."""

    queues: list[str]
    hot: bool
    project: str
    batch: int
    pad: str
    ttl: int
    page_size: int
    claim_limit: int
    poll_interval: float
    producer_wait: float
    long_poll_wait: float
    groups: int
    release_ratio: float
    release_delay: int

    @classmethod
    def of(cls, environment: Environment) -> Options:
        o = environment.parsed_options
        assert o is not None, "run through the locust command"
        count = 1 if o.hot else max(1, o.queues)
        return cls(
            queues=[f"{o.queue_prefix}{i}" for i in range(count)],
            hot=o.hot,
            project=o.project,
            batch=max(1, o.batch),
            pad="x" * max(0, o.message_size),
            ttl=o.ttl,
            page_size=o.page_size,
            claim_limit=o.claim_limit,
            poll_interval=o.poll_interval,
            producer_wait=o.producer_wait,
            long_poll_wait=o.long_poll_wait,
            groups=max(0, o.groups),
            release_ratio=min(1.0, max(0.0, o.release_ratio)),
            release_delay=max(0, o.release_delay),
        )
