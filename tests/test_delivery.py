"""Delivery of subscriptions to real local receivers: an aiohttp server on
127.0.0.1 for webhooks, aiosmtpd for mail. Per driver, on one server and on
the Redis Cluster. Back-off delays are crossed by moving the ManualClock.

Waiting for a receiver to get something has a generous bound (a hang fails
the test); no assertion depends on how long anything took.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import Message as Mail
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiosmtpd.smtp import SMTP, Envelope, Session

from feedsvc.app import create_app
from feedsvc.appkeys import STORE
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.delivery.retry import DEFAULTS
from feedsvc.delivery.runner import DeliveryCounters, Runner
from feedsvc.delivery.senders import Senders
from feedsvc.storage.base import Parent
from feedsvc.storage.deliveries import RedisDeliveries
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.subscriptions import PURGE_STEP
from tests.conftest import direct_client

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
Q = "/v2/queues/news"
PATIENCE = 30.0


def delivery_settings(settings: Settings, **changes: Any) -> Settings:
    base = settings.replace(
        subscriber_allow="127.0.0.0/8",
        delivery_lease=3.0,
        delivery_timeout=1.0,
        delivery_sweep=0.2,
    )
    return base.replace(**changes)


@dataclass
class Receiver:
    """A webhook receiver: records what it gets; answers status(request number)."""

    url: str = ""
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    answer: Callable[[bytes], int] = lambda _body: 200
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.got.append((dict(request.headers), body))
        self.arrived.set()
        return web.Response(status=self.answer(body))

    def bodies(self) -> list[dict[str, Any]]:
        return [orjson.loads(b) for _, b in self.got]

    async def until(self, count: int) -> None:
        async with asyncio.timeout(PATIENCE):
            while len(self.got) < count:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()

    async def hook(request: web.Request) -> web.Response:
        return await found.handle(request)  # (a test may swap found.handle)

    app.router.add_post("/hook", hook)
    async with TestServer(app, host="127.0.0.1") as server:
        found.url = str(server.make_url("/hook"))
        yield found


@asynccontextmanager
async def service(settings: Settings, clock: ManualClock) -> AsyncIterator[Client]:
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


async def subscribe(http: Client, headers: Headers, subscriber: str, **extra: Any) -> str:
    body = {"subscriber": subscriber, "ttl": 3600, **extra}
    resp = await http.post(Q + "/subscriptions", json=body, headers=headers)
    assert resp.status == 201, await resp.text()
    sid: str = (await resp.json())["subscription_id"]
    return sid


async def post(http: Client, headers: Headers, *bodies: Any) -> list[str]:
    resp = await http.post(
        Q + "/messages",
        json={"messages": [{"body": b, "ttl": 300} for b in bodies]},
        headers=headers,
    )
    assert resp.status == 201, await resp.text()
    return [h.rsplit("/", 1)[1] for h in (await resp.json())["resources"]]


async def details(http: Client, headers: Headers, sid: str) -> dict[str, Any]:
    resp = await http.get(f"{Q}/subscriptions/{sid}", headers=headers)
    assert resp.status == 200
    doc: dict[str, Any] = await resp.json()
    return doc


def counted(metrics: str, outcome: str, scheme: str) -> float:
    """The deliveries_total sample of outcome and scheme in a /metrics page (0 if none)."""
    line = f'feedsvc_deliveries_total{{outcome="{outcome}",scheme="{scheme}"}} '
    found = [float(x[len(line) :]) for x in metrics.splitlines() if x.startswith(line)]
    return found[0] if found else 0.0


async def until_settled(http: Client, headers: Headers, sid: str, key: str, value: int) -> None:
    async with asyncio.timeout(PATIENCE):
        while (await details(http, headers, sid))["delivery"][key] != value:  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # (the state is in Redis: nothing to wait on here)


async def test_webhook_gets_each_message_in_order_as_zaqar_sends_it(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    async with service(delivery_settings(settings), clock) as http:
        await post(http, headers, "before")  # posted before the subscription: not sent
        sid = await subscribe(
            http, headers, receiver.url, options={"post_headers": {"X-Hook-Key": "s3cret"}}
        )
        ids = []
        for i in range(5):
            ids += await post(http, headers, {"n": i})
        await receiver.until(5)
        await until_settled(http, headers, sid, "delivered", 5)
    assert receiver.bodies() == [
        {"body": {"n": i}, "ttl": 300, "queue_name": "news", "Message_Type": "Notification"}
        for i in range(5)
    ]
    for (got, _), message_id in zip(receiver.got, ids, strict=True):
        assert got["Content-Type"] == "application/json"
        assert got["X-Hook-Key"] == "s3cret"
        assert got["X-Message-ID"] == message_id


async def test_post_data_template(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    template = '{"wrapped": "$zaqar_message$", "from": "feedsvc"}'
    async with service(delivery_settings(settings), clock) as http:
        await subscribe(http, headers, receiver.url, options={"post_data": template})
        await post(http, headers, 7)
        await receiver.until(1)
    [doc] = receiver.bodies()
    assert doc == {
        "wrapped": {"body": 7, "ttl": 300, "queue_name": "news", "Message_Type": "Notification"},
        "from": "feedsvc",
    }


async def test_server_errors_are_retried_then_delivery_moves_on(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    failures = {"n": 0}

    def flaky(body: bytes) -> int:
        if orjson.loads(body)["body"] == "a" and failures["n"] < 2:
            failures["n"] += 1
            return 503
        return 200

    receiver.answer = flaky
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, "a", "b")
        await receiver.until(4)
        await until_settled(http, headers, sid, "delivered", 2)
        doc = await details(http, headers, sid)
    assert [b["body"] for b in receiver.bodies()] == ["a", "a", "a", "b"]
    assert doc["delivery"]["failures"] == 0
    assert doc["delivery"]["last_error"] == "HTTP 503"


async def test_retry_policy_backs_off_then_gives_up_and_counts_it(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    receiver.answer = lambda body: 500 if orjson.loads(body)["body"] == "bad" else 200
    policy = {
        "retries_with_no_delay": 1,
        "minimum_delay_retries": 0,
        "maximum_delay_retries": 0,
        "minimum_delay": 0,
        "maximum_delay": 10,
    }  # schedule: 0 s, then the linear back-off 0 s, 5 s; then give up
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url, options={"_retry_policy": policy})
        await post(http, headers, "bad", "good")
        await receiver.until(3)
        await until_settled(http, headers, sid, "retrying", 3)
        assert len(receiver.got) == 3  # waiting for the 5 s back-off: clock stands still
        clock.advance(5)
        await receiver.until(5)
        await until_settled(http, headers, sid, "delivered", 1)
        doc = await details(http, headers, sid)
        metrics = await (await http.get("/metrics")).text()
    assert [b["body"] for b in receiver.bodies()] == ["bad"] * 4 + ["good"]
    assert doc["delivery"] == {
        "delivered": 1,
        "failures": 1,
        "retrying": 0,
        "last_error": "HTTP 500",
    }
    assert f'subscription="{sid}"}} 1.0' in metrics
    assert 'feedsvc_deliveries_total{outcome="given_up",scheme="http"} 1.0' in metrics


@pytest.mark.slow
async def test_queue_policy_applies_when_the_subscription_has_none(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    receiver.answer = lambda body: 502
    policy = {"retries_with_no_delay": 0, "minimum_delay_retries": 0, "maximum_delay_retries": 0,
              "minimum_delay": 20, "maximum_delay": 30}  # fmt: skip
    async with service(delivery_settings(settings), clock) as http:
        resp = await http.put(Q, json={"_retry_policy": policy}, headers=headers)
        assert resp.status == 201
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, 1)
        await receiver.until(1)
        for _ in range(2):  # linear back-off 20 s, 25 s
            await until_settled(http, headers, sid, "retrying", len(receiver.got))
            clock.advance(30)
            await receiver.until(len(receiver.got) + 1)
        await until_settled(http, headers, sid, "failures", 1)
    assert len(receiver.got) == 3


async def test_client_errors_are_final(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    receiver.answer = lambda body: 404 if orjson.loads(body)["body"] == 1 else 200
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, 1, 2)
        await until_settled(http, headers, sid, "delivered", 1)
        doc = await details(http, headers, sid)
    assert [b["body"] for b in receiver.bodies()] == [1, 2]
    assert doc["delivery"]["failures"] == 1
    assert doc["delivery"]["last_error"] == "HTTP 404 (final: not retried)"


@pytest.mark.parametrize("status", [408, 425, 429])
async def test_client_errors_that_say_later_are_retried(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver, status: int
) -> None:
    answers = iter([status])
    receiver.answer = lambda body: next(answers, 200)
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, 1)
        await until_settled(http, headers, sid, "delivered", 1)
        doc = await details(http, headers, sid)
    assert [b["body"] for b in receiver.bodies()] == [1, 1]
    assert doc["delivery"]["failures"] == 0


async def stored_subscription(
    http: Client, headers: Headers, subscriber: str, options: dict[str, Any] | None = None
) -> str:
    """A subscription written to the store directly, as one stored before the
    API's rules (issue 28) could be: the API would refuse it now."""
    assert (await http.put(Q, headers=headers)).status in (201, 204)
    parent = Parent("queue", headers["X-Project-ID"], "news")
    made = await http.app[STORE].subscriptions.create(parent, subscriber, 3600, options or {})
    return made.id


async def test_framing_headers_stored_before_the_rules_are_not_sent(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    framing = {"Content-Length": "5", "Transfer-Encoding": "chunked", "Host": "evil.example",
               "Connection": "close", "X-Kept": "yes", "content-type": "text/plain"}  # fmt: skip
    async with service(delivery_settings(settings), clock) as http:
        sid = await stored_subscription(http, headers, receiver.url, {"post_headers": framing})
        await post(http, headers, "whole", "next")
        await receiver.until(2)
        await until_settled(http, headers, sid, "delivered", 2)
    assert [b["body"] for b in receiver.bodies()] == ["whole", "next"]
    for got, body in receiver.got:
        assert got["Host"] == receiver.url.split("/")[2]
        assert got["Content-Length"] == str(len(body))
        assert "Transfer-Encoding" not in got
        assert got["X-Kept"] == "yes"
        assert got["Content-Type"] == "text/plain"  # one Content-Type: the subscription's


@pytest.mark.parametrize("port", ["99999", "abc", "0"])
async def test_a_webhook_that_cannot_be_reached_fails_at_once(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver, port: str
) -> None:
    bad = receiver.url.replace(receiver.url.split("/")[2], f"127.0.0.1:{port}")
    async with service(delivery_settings(settings), clock) as http:
        sid = await stored_subscription(http, headers, bad)
        await post(http, headers, 1)
        # the clock stands still: a retry after a back-off would never come
        await until_settled(http, headers, sid, "failures", 1)
        doc = await details(http, headers, sid)
    assert doc["delivery"]["retrying"] == 0
    assert "(final: not retried)" in doc["delivery"]["last_error"]


async def test_private_addresses_are_refused_when_delivering(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    # a name is accepted at creation; it resolves to loopback, which is not allowed
    hook = receiver.url.replace("127.0.0.1", "localhost")
    async with service(delivery_settings(settings, subscriber_allow=None), clock) as http:
        sid = await subscribe(http, headers, hook)
        await post(http, headers, 1)
        await until_settled(http, headers, sid, "failures", 1)
        doc = await details(http, headers, sid)
    assert receiver.got == []
    assert "not public" in doc["delivery"]["last_error"]


async def test_two_workers_share_a_subscription_without_double_delivery(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    tuned = delivery_settings(settings)
    async with service(tuned, clock) as one, service(tuned, clock) as two:
        sid = await subscribe(one, headers, receiver.url)
        for i in range(20):
            await post(one if i % 2 else two, headers, i)
        await until_settled(one, headers, sid, "delivered", 20)
    assert [b["body"] for b in receiver.bodies()] == list(range(20))


async def test_confirmation_is_required_when_configured(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    tuned = delivery_settings(settings, require_confirmation=True, signed_url_key="k3y")
    async with service(tuned, clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await receiver.until(1)
        await post(http, headers, "unconfirmed")
        [request] = receiver.bodies()
        assert request["Message_Type"] == "SubscriptionConfirmation"
        assert request["queue_name"] == "news"
        path = f"{Q}/subscriptions/{sid}/confirm"
        assert (request["URL-Paths"], request["URL-Methods"]) == (path, "PUT")
        # the signed URL confirms without any other credentials than its own
        signed = {
            "Client-ID": str(uuid.uuid4()),
            "X-Project-ID": request["X-Project-ID"],
            "URL-Signature": request["URL-Signature"],
            "URL-Expires": request["URL-Expires"],
            "URL-Methods": request["URL-Methods"],
            "URL-Paths": request["URL-Paths"],
        }
        resp = await http.put(path, json=request["SubscribeBody"], headers=signed)
        assert resp.status == 204
        await post(http, headers, "confirmed")
        await receiver.until(2)
        await until_settled(http, headers, sid, "delivered", 1)
    assert [b.get("body") for b in receiver.bodies()] == [None, "confirmed"]


@dataclass
class Mailbox:
    mails: list[tuple[str, list[str], Mail]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        content = envelope.content if isinstance(envelope.content, bytes) else b""
        self.mails.append(
            (str(envelope.mail_from), list(envelope.rcpt_tos), message_from_bytes(content))
        )
        self.arrived.set()
        return "250 OK"


@pytest.fixture
async def smtp() -> AsyncIterator[tuple[str, Mailbox]]:
    box = Mailbox()
    server = await asyncio.get_running_loop().create_server(
        lambda: SMTP(box, hostname="localhost"), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", box
    finally:
        server.close()
        await server.wait_closed()


async def test_mailto_is_sent_through_the_smtp_server(
    settings: Settings, clock: ManualClock, headers: Headers, smtp: tuple[str, Mailbox]
) -> None:
    address, box = smtp
    tuned = delivery_settings(settings, smtp_server=address, smtp_sender="feeds@example.org")
    async with service(tuned, clock) as http:
        sid = await subscribe(
            http, headers, "mailto:ops@example.com?subject=News", options={"from": "n@example.org"}
        )
        await post(http, headers, {"alert": 1})
        async with asyncio.timeout(PATIENCE):
            while not box.mails:
                box.arrived.clear()
                await box.arrived.wait()
        await until_settled(http, headers, sid, "delivered", 1)
    [(sender, recipients, mail)] = box.mails
    assert (sender, recipients) == ("feeds@example.org", ["ops@example.com"])
    assert (mail["To"], mail["From"], mail["Subject"]) == (
        "ops@example.com",
        "n@example.org",
        "News",
    )
    payload = mail.get_payload(decode=True)
    assert isinstance(payload, bytes)
    assert orjson.loads(payload) == {
        "body": {"alert": 1},
        "ttl": 300,
        "queue_name": "news",
        "Message_Type": "Notification",
    }


async def until_mailed(box: Mailbox, count: int) -> None:
    async with asyncio.timeout(PATIENCE):
        while len(box.mails) < count:
            box.arrived.clear()
            await box.arrived.wait()


async def test_mailto_with_several_addresses_mails_them_all(
    settings: Settings, clock: ManualClock, headers: Headers, smtp: tuple[str, Mailbox]
) -> None:
    address, box = smtp
    tuned = delivery_settings(settings, smtp_server=address, smtp_sender="feeds@example.org")
    async with service(tuned, clock) as http:
        sid = await subscribe(http, headers, "mailto:a@example.com,b@example.org")
        await post(http, headers, 1)
        await until_mailed(box, 1)
        await until_settled(http, headers, sid, "delivered", 1)
    [(_, recipients, mail)] = box.mails
    assert recipients == ["a@example.com", "b@example.org"]
    assert mail["To"] == "a@example.com, b@example.org"


async def test_a_mail_address_with_a_line_break_stored_before_the_rules_is_never_sent(
    settings: Settings, clock: ManualClock, headers: Headers, smtp: tuple[str, Mailbox]
) -> None:
    address, box = smtp
    tuned = delivery_settings(settings, smtp_server=address, smtp_sender="feeds@example.org")
    async with service(tuned, clock) as http:
        bad = await stored_subscription(http, headers, "mailto:a@example.com%0D%0ABcc:c@evil.org")
        good = await subscribe(http, headers, "mailto:ops@example.com")
        await post(http, headers, 1)
        await until_settled(http, headers, bad, "failures", 1)
        await until_settled(http, headers, good, "delivered", 1)
        doc = await details(http, headers, bad)
    assert [recipients for _, recipients, _ in box.mails] == [["ops@example.com"]]
    assert "(final: not retried)" in doc["delivery"]["last_error"]


async def test_mailto_without_smtp_server_is_a_counted_failure(
    settings: Settings, clock: ManualClock, headers: Headers
) -> None:
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, "mailto:ops@example.com")
        await post(http, headers, 1)
        await until_settled(http, headers, sid, "failures", 1)
        doc = await details(http, headers, sid)
    assert "smtp-server" in doc["delivery"]["last_error"]


async def test_an_unconfirmed_subscription_with_a_backlog_leaves_its_worker_idle(
    settings: Settings,
    clock: ManualClock,
    headers: Headers,
    receiver: Receiver,
) -> None:
    tuned = delivery_settings(settings, require_confirmation=True, signed_url_key="k3y")
    async with service(tuned, clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await receiver.until(1)  # the confirmation request
        await post(http, headers, 1, 2)
        parent = Parent("queue", headers["X-Project-ID"], "news")
        senders = Senders(tuned)
        runner = Runner(http.app[STORE], senders, tuned, clock, DeliveryCounters(), parent, sid)
        async with asyncio.timeout(PATIENCE):
            while not await runner.acquire():  # noqa: ASYNC110 (the app's worker lets go)
                await asyncio.sleep(0.02)
            await runner.run(lambda: None)  # returns: nothing to do until confirmed
        await senders.close()
    assert [b["Message_Type"] for b in receiver.bodies()] == ["SubscriptionConfirmation"]


@pytest.mark.slow
async def test_a_message_that_expires_while_retried_is_skipped(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    receiver.answer = lambda body: 503 if orjson.loads(body)["body"] == "short" else 200
    policy = {"retries_with_no_delay": 0, "minimum_delay_retries": 0, "maximum_delay_retries": 0,
              "minimum_delay": 100, "maximum_delay": 200}  # fmt: skip
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url, options={"_retry_policy": policy})
        resp = await http.post(
            Q + "/messages",
            json={"messages": [{"body": "short", "ttl": 60}, {"body": "long", "ttl": 3600}]},
            headers=headers,
        )
        assert resp.status == 201
        await receiver.until(1)
        await until_settled(http, headers, sid, "retrying", 1)
        clock.advance(101)  # the retry is due, and the message is gone
        await receiver.until(2)
        await until_settled(http, headers, sid, "delivered", 1)
        doc = await details(http, headers, sid)
    assert [b["body"] for b in receiver.bodies()] == ["short", "long"]
    assert doc["delivery"]["failures"] == 0


async def test_a_retry_after_delivered_messages_does_not_send_them_again(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    failed: list[str] = []

    def once(body: bytes) -> int:
        value = orjson.loads(body)["body"]
        if value == "b" and not failed:
            failed.append(value)
            return 503
        return 200

    receiver.answer = once
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, "a", "b", "c")  # one batch for the worker
        await until_settled(http, headers, sid, "delivered", 3)
    assert [b["body"] for b in receiver.bodies()] == ["a", "b", "b", "c"]


async def test_a_topic_has_subscriptions_of_its_own_delivered_like_a_queue(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    """/v2/topics/{name}/subscriptions: the topic's posts reach its
    subscriber (bodies of an encrypted topic opened first), and the queue of
    the same name neither shares the subscription nor wakes it."""
    topic = "/v2/topics/news"
    configured = delivery_settings(settings, message_encryption_key="k" * 32)
    async with service(configured, clock) as http:
        made = await http.put(topic, json={"_enable_encrypt_messages": True}, headers=headers)
        assert made.status == 201, await made.text()
        resp = await http.post(
            topic + "/subscriptions",
            json={"subscriber": receiver.url, "ttl": 3600},
            headers=headers,
        )
        assert resp.status == 201, await resp.text()
        sid = (await resp.json())["subscription_id"]
        listed = await (await http.get(topic + "/subscriptions", headers=headers)).json()
        assert [s["id"] for s in listed["subscriptions"]] == [sid]
        queue_listed = await (await http.get(Q + "/subscriptions", headers=headers)).json()
        assert queue_listed["subscriptions"] == []
        await post(http, headers, "to the queue")  # the queue "news": not the topic's
        for n in range(3):
            resp = await http.post(
                topic + "/messages",
                json={"messages": [{"body": {"n": n}, "ttl": 300}]},
                headers=headers,
            )
            assert resp.status == 201, await resp.text()
        await receiver.until(3)
        got = await (await http.get(f"{topic}/subscriptions/{sid}", headers=headers)).json()
        assert got["source"] == "news"
        gone = await http.delete(topic, headers=headers)  # its subscriptions go with it
        assert gone.status == 204
        missing = await http.get(f"{topic}/subscriptions/{sid}", headers=headers)
        assert missing.status == 404
    assert [b["body"] for b in receiver.bodies()] == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_a_stuck_receiver_does_not_hold_up_posting(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    """Delivery is decoupled from the POST path: while the receiver holds the
    first notification unanswered, posts to the queue are still answered,
    and once it lets go it gets the rest, in order."""
    release = asyncio.Event()
    holding = asyncio.Event()
    original = receiver.handle

    async def stuck(request: web.Request) -> web.Response:
        holding.set()
        await release.wait()
        return await original(request)

    receiver.handle = stuck  # type: ignore[method-assign]
    async with service(delivery_settings(settings, delivery_timeout=1.4), clock) as http:
        await subscribe(http, headers, receiver.url)
        await post(http, headers, 0)
        async with asyncio.timeout(PATIENCE):
            await holding.wait()  # the first notification is at the receiver, unanswered
        for n in range(1, 6):
            await post(http, headers, n)  # answered while delivery waits
        assert receiver.got == []
        release.set()
        await receiver.until(6)
    bodies = [b["body"] for b in receiver.bodies()]
    assert sorted(set(bodies)) == [0, 1, 2, 3, 4, 5]
    assert bodies == sorted(bodies), "out of post order"


@pytest.mark.slow
async def test_stopping_at_once_ends_the_worker_whatever_it_was_doing(
    settings: Settings, clock: ManualClock
) -> None:
    """The app stopped right after it started: the worker's first sweep is
    still under way (on a cluster, reading the slot table, where Python
    3.11's asyncio.wait_for in redis-py may swallow the cancellation). Its
    cleanup ends anyway (no sweep every --delivery-sweep for ever) and
    leaves no task of the worker's behind."""
    tuned = delivery_settings(settings, delivery_sweep=3600.0)
    for turns in range(40):  # stopped at each step of the sweep in turn
        async with service(tuned, clock):
            for _ in range(turns):
                await asyncio.sleep(0)
    names = [getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks()]
    lingering = [n for n in names if n.startswith(("Deliverer.", "Runner.", "ClusterServers."))]
    assert lingering == []


async def test_a_retry_policy_that_cannot_be_computed_is_a_recorded_failed_attempt(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    """A stored policy outside the rules (here a count that is no number,
    written straight into Redis as older data or a bug could leave it)
    neither wedges the subscription nor hides: the failed attempt is
    recorded, the default applies, and the metrics count it."""
    receiver.answer = lambda body: 500
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        record = QueueKeys.of(headers["X-Project-ID"], "news").subscriptions().record(sid)
        redis = direct_client(str(settings.redis_url))
        try:
            policy = {"_retry_policy": {"retries_with_no_delay": "lots"}}
            await redis.hset(record, "o", orjson.dumps(policy))
        finally:
            await redis.aclose()
        await post(http, headers, 1)
        # the default policy: the attempt and three immediate retries, then
        # a back-off the standing clock does not cross
        await until_settled(http, headers, sid, "retrying", 4)
        await receiver.until(4)
        doc = await details(http, headers, sid)
        metrics = await (await http.get("/metrics")).text()
    # the stored policy is read within the rules (delivery/retry.py stored():
    # a number that is none counts as the default), so delivery goes on
    assert "HTTP 500" in doc["delivery"]["last_error"]
    # (more than 4 only if a lease ran out under load and an attempt was repeated)
    assert counted(metrics, "attempt_failed", "http") >= 4


async def test_a_mail_that_cannot_be_built_is_a_recorded_failed_attempt(
    settings: Settings, clock: ManualClock, headers: Headers, smtp: tuple[str, Mailbox]
) -> None:
    """A mailto subscription whose ``from`` holds CR/LF (written straight
    into Redis: input checks refuse it, older data need not have been
    checked) makes the mail impossible to build. That is a failed attempt,
    recorded with its reason as final (retrying cannot help) and counted;
    the header is never sent."""
    address, box = smtp
    tuned = delivery_settings(settings, smtp_server=address, smtp_sender="feeds@example.org")
    async with service(tuned, clock) as http:
        sid = await subscribe(http, headers, "mailto:ops@example.com")
        record = QueueKeys.of(headers["X-Project-ID"], "news").subscriptions().record(sid)
        redis = direct_client(str(settings.redis_url))
        try:
            options = {"from": "n@example.org\r\nBcc: everyone@example.net"}
            await redis.hset(record, "o", orjson.dumps(options))
        finally:
            await redis.aclose()
        await post(http, headers, 1)
        # a mail that can never be built: a final failure, not retried
        await until_settled(http, headers, sid, "failures", 1)
        doc = await details(http, headers, sid)
        metrics = await (await http.get("/metrics")).text()
    assert box.mails == []
    assert "(final: not retried)" in doc["delivery"]["last_error"], doc
    assert counted(metrics, "given_up", "mailto") == 1


async def test_any_exception_in_a_send_is_a_recorded_failed_attempt(
    settings: Settings,
    clock: ManualClock,
    headers: Headers,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever a sender raises (a bug, an input nobody foresaw) is a failed
    attempt like an HTTP 500: recorded, retried, then given up on, and
    delivery moves on to the next message."""
    original = Senders.send

    async def fragile(
        self: Senders, sub: Any, data: bytes, message_id: str | None, trace: Any = None
    ) -> Any:
        if orjson.loads(data)["body"] == "bad":
            raise MemoryError("no room for this one")
        return await original(self, sub, data, message_id, trace)

    monkeypatch.setattr(Senders, "send", fragile)
    policy = {"retries_with_no_delay": 0, "minimum_delay_retries": 0,
              "maximum_delay_retries": 0, "minimum_delay": 0, "maximum_delay": 10}  # fmt: skip
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url, options={"_retry_policy": policy})
        await post(http, headers, "bad", "good")
        await until_settled(http, headers, sid, "retrying", 2)  # then a 5 s back-off
        clock.advance(5)
        await until_settled(http, headers, sid, "failures", 1)
        await receiver.until(1)
        await until_settled(http, headers, sid, "delivered", 1)
        doc = await details(http, headers, sid)
    assert [b["body"] for b in receiver.bodies()] == ["good"]
    assert "MemoryError" in doc["delivery"]["last_error"]


@pytest.mark.slow
async def test_a_failure_outside_any_attempt_is_recorded_and_tried_again_later(
    settings: Settings,
    clock: ManualClock,
    headers: Headers,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug anywhere in the delivery loop (here: reading the messages) is
    on the record as a failed attempt with its reason and counted, and the
    subscription is tried again after a back-off, not at every lease
    expiry in silence. Once the cause is gone, delivery goes on."""
    original = RedisDeliveries.messages_after
    broken = {"on": True}

    async def buggy(self: RedisDeliveries, *args: Any) -> Any:
        if broken["on"]:
            raise RuntimeError("a bug")
        return await original(self, *args)

    monkeypatch.setattr(RedisDeliveries, "messages_after", buggy)
    async with service(delivery_settings(settings), clock) as http:
        sid = await subscribe(http, headers, receiver.url)
        await post(http, headers, 1)
        await until_settled(http, headers, sid, "retrying", 1)
        doc = await details(http, headers, sid)
        metrics = await (await http.get("/metrics")).text()
        broken["on"] = False
        clock.advance(DEFAULTS["maximum_delay"])
        await receiver.until(1)
        await until_settled(http, headers, sid, "delivered", 1)
    assert doc["delivery"]["last_error"] == "RuntimeError: a bug"
    assert counted(metrics, "attempt_failed", "http") >= 1


@pytest.mark.slow
async def test_a_deleted_queue_s_subscriptions_deliver_nothing_more_and_are_swept(
    settings: Settings, clock: ManualClock, headers: Headers, receiver: Receiver
) -> None:
    """More subscriptions than a deletion removes in its request: once the
    DELETE is answered none of them is sent anything posted afterwards (a
    new subscriber of the queue made again is), and the workers' sweep
    removes what the request left, so no key of theirs stays."""
    count = PURGE_STEP + 300
    parent = Parent("queue", headers["X-Project-ID"], "news")
    async with service(delivery_settings(settings), clock) as http:
        subs = http.app[STORE].subscriptions
        made: list[str] = []
        for start in range(0, count, 50):
            batch = [
                subs.create(parent, f"{receiver.url}?n={i}", 3600, {})
                for i in range(start, min(start + 50, count))
            ]
            made += [m.id for m in await asyncio.gather(*batch)]
        assert (await http.delete(Q, headers=headers)).status == 204
        fresh = await subscribe(http, headers, receiver.url + "?fresh")
        await post(http, headers, "after")
        await until_settled(http, headers, fresh, "delivered", 1)
        keys = QueueKeys.of(headers["X-Project-ID"], "news").subscriptions()
        redis = direct_client(str(settings.redis_url))
        try:
            async with asyncio.timeout(PATIENCE):
                while await redis.exists(keys.buried):  # noqa: ASYNC110 (state in Redis)
                    await asyncio.sleep(0.05)
            left = sum([await redis.exists(keys.record(sid)) for sid in made])
        finally:
            await redis.aclose()
    assert left == 0
    # the fresh subscriber got "after" (settled above); no old one did
    assert [b["body"] for b in receiver.bodies()].count("after") == 1
