"""Encrypted queues (``_enable_encrypt_messages``): bodies sealed at rest in
Redis, opened on every read, on both drivers, one server and a Cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.errors import EncryptionUnavailable
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.sealing import MAGIC
from tests.conftest import direct_client, make_settings, opened_store
from tests.stored import body_span, stored_body

KEY = "correct horse battery staple, twice"
OTHER_KEY = "another key of at least sixteen characters"
WRITER = str(uuid.uuid4())
READER = str(uuid.uuid4())
SECRET = {"card": "4111 1111 1111 1111", "note": "não é público"}
ENCRYPTED = {"_enable_encrypt_messages": True}

StoreMaker = Callable[[str | None], AbstractAsyncContextManager[FeedStore]]


@pytest.fixture
def stores(redis_url: str, driver: str, clock: ManualClock) -> StoreMaker:
    """Open a store of the driver under test with the given key (None: none)."""

    @asynccontextmanager
    async def opened(key: str | None) -> AsyncIterator[FeedStore]:
        settings = make_settings(redis_url, driver=driver, message_encryption_key=key)
        async with opened_store(settings, clock) as feed:
            yield feed

    return opened


async def raw_body(redis_url: str, project: str, queue: str, message_id: str) -> bytes:
    """The body in a message's record, as Redis holds it."""
    client = direct_client(redis_url)
    try:
        return await stored_body(client, QueueKeys.of(project, queue), message_id)
    finally:
        await client.aclose()


def body(value: Any) -> NewMessage:
    return NewMessage(orjson.dumps(value), 300)


async def test_bodies_are_sealed_in_redis_and_opened_on_every_read(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        await store.create_queue(project, "vault", dict(ENCRYPTED))
        posted = [body(SECRET), body("plain text"), body([1, 2, 3])]
        ids = await store.post_messages(project, "vault", WRITER, posted)
        for message_id in ids:
            raw = await raw_body(redis_url, project, "vault", message_id)
            assert raw.startswith(MAGIC)
            for plain in (b"4111", b"plain text", b"[1,2,3]", "não".encode()):
                assert plain not in raw
        expected = [m.body for m in posted]
        page = await store.list_messages(project, "vault", ListQuery(READER, limit=10))
        assert [m.body for m in page.messages] == expected
        got = await store.get_messages(project, "vault", ids)
        assert [m.body for m in got] == expected
        claim = await store.claim_messages(project, "vault", 60, 60, 2)
        assert claim is not None
        assert [m.body for m in claim.messages] == expected[:2]
        again = await store.get_claim(project, "vault", claim.id)
        assert [m.body for m in again.messages] == expected[:2]
        popped = await store.pop_messages(project, "vault", 5)
        assert [m.body for m in popped] == expected[2:]


async def test_an_encrypted_topic_seals_its_bodies(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        topics = store.topics()
        await topics.create_queue(project, "t", dict(ENCRYPTED))
        [message_id] = await topics.post_messages(project, "t", WRITER, [body(SECRET)])
        client = direct_client(redis_url)
        try:
            raw = await stored_body(client, QueueKeys.of(project, "t", "topic"), message_id)
        finally:
            await client.aclose()
        assert raw.startswith(MAGIC)
        assert b"4111" not in raw
        got = await topics.get_messages(project, "t", [message_id])
        assert [m.body for m in got] == [orjson.dumps(SECRET)]


async def test_a_dead_lettered_message_stays_sealed_and_readable(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    """Dead-lettering copies the stored body as it is: still sealed in the
    dead-letter queue (plain itself), still opened on a read."""
    async with stores(KEY) as store:
        settings = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
        await store.create_queue(project, "q", ENCRYPTED | settings)
        [message_id] = await store.post_messages(project, "q", WRITER, [body(SECRET)])
        claim = await store.claim_messages(project, "q", 60, 60, 5)
        assert claim is not None
        await store.release_claim(project, "q", claim.id)
        assert await store.claim_messages(project, "q", 60, 60, 5) is None
        raw = await raw_body(redis_url, project, "dlq", message_id)
        assert raw.startswith(MAGIC)
        dead = await store.list_messages(project, "dlq", ListQuery(READER))
        assert [(m.id, m.body) for m in dead.messages] == [(message_id, orjson.dumps(SECRET))]


async def test_a_plain_queue_stores_bodies_as_they_are(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        [message_id] = await store.post_messages(project, "open", WRITER, [body(SECRET)])
        assert await raw_body(redis_url, project, "open", message_id) == orjson.dumps(SECRET)


async def test_switching_encryption_changes_only_later_posts(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        [plain] = await store.post_messages(project, "q", WRITER, [body("before")])
        await store.update_queue_metadata(project, "q", lambda m: m | ENCRYPTED)
        [sealed] = await store.post_messages(project, "q", WRITER, [body("during")])
        await store.update_queue_metadata(project, "q", lambda m: m | {ENCRYPTED_NAME: False})
        [after] = await store.post_messages(project, "q", WRITER, [body("after")])
        assert await raw_body(redis_url, project, "q", plain) == b'"before"'
        assert (await raw_body(redis_url, project, "q", sealed)).startswith(MAGIC)
        assert await raw_body(redis_url, project, "q", after) == b'"after"'
        page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        assert [m.body for m in page.messages] == [b'"before"', b'"during"', b'"after"']


ENCRYPTED_NAME = "_enable_encrypt_messages"


async def test_encryption_turned_on_by_another_process_is_honoured_at_once(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    """This process learned the queue was plain; another makes it encrypted.
    The next post here (its memory still fresh: the clock stands still) must
    not index a plain body: the write itself checks, and it is sealed."""
    async with stores(KEY) as here, stores(KEY) as there:
        await here.post_messages(project, "q", WRITER, [body("plain")])
        await there.update_queue_metadata(project, "q", lambda m: m | ENCRYPTED)
        [message_id] = await here.post_messages(project, "q", WRITER, [body(SECRET)])
        raw = await raw_body(redis_url, project, "q", message_id)
        assert raw.startswith(MAGIC)
        assert b"4111" not in raw
        got = await there.get_messages(project, "q", [message_id])
        assert [m.body for m in got] == [orjson.dumps(SECRET)]
        # nothing else was left behind by the refused first attempt
        stats = await here.queue_stats(project, "q")
        assert stats.total == 2


async def test_without_the_key_nothing_is_posted_or_read(stores: StoreMaker, project: str) -> None:
    async with stores(KEY) as keyed:
        await keyed.create_queue(project, "q", dict(ENCRYPTED))
        [message_id] = await keyed.post_messages(project, "q", WRITER, [body(SECRET)])
    async with stores(None) as keyless:
        with pytest.raises(EncryptionUnavailable, match="no --message-encryption-key"):
            await keyless.post_messages(project, "q", WRITER, [body("more")])
        with pytest.raises(EncryptionUnavailable, match=message_id):
            await keyless.get_messages(project, "q", [message_id])
        with pytest.raises(EncryptionUnavailable):
            await keyless.list_messages(project, "q", ListQuery(READER))
        assert (await keyless.queue_stats(project, "q")).total == 1
    async with stores(OTHER_KEY) as wrong:
        with pytest.raises(EncryptionUnavailable, match="another --message-encryption-key"):
            await wrong.get_messages(project, "q", [message_id])
    async with stores(KEY) as keyed:
        got = await keyed.get_messages(project, "q", [message_id])
        assert [m.body for m in got] == [orjson.dumps(SECRET)]


async def test_a_body_altered_in_redis_is_refused(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        await store.create_queue(project, "q", dict(ENCRYPTED))
        [message_id] = await store.post_messages(project, "q", WRITER, [body(SECRET)])
        await alter(redis_url, project, "q", message_id)
        with pytest.raises(EncryptionUnavailable, match="altered"):
            await store.get_messages(project, "q", [message_id])


# -- over HTTP -------------------------------------------------------------------


@asynccontextmanager
async def service(
    redis_url: str, driver: str, clock: ManualClock, key: str | None
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    settings = make_settings(redis_url, driver=driver, message_encryption_key=key)
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


async def test_http_round_trip_of_an_encrypted_queue(
    redis_url: str, driver: str, clock: ManualClock, headers: dict[str, str], project: str
) -> None:
    async with service(redis_url, driver, clock, KEY) as http:
        resp = await http.put("/v2/queues/vault", json=ENCRYPTED, headers=headers)
        assert resp.status == 201, await resp.text()
        shown = await (await http.get("/v2/queues/vault", headers=headers)).json()
        assert shown["_enable_encrypt_messages"] is True
        resp = await http.post(
            "/v2/queues/vault/messages", json={"messages": [{"body": SECRET}]}, headers=headers
        )
        assert resp.status == 201, await resp.text()
        [href] = (await resp.json())["resources"]
        message_id = href.rsplit("/", 1)[1]
        assert b"4111" not in await raw_body(redis_url, project, "vault", message_id)
        got = await (await http.get(href, headers=headers)).json()
        assert got["body"] == SECRET
        page = await (await http.get("/v2/queues/vault/messages?echo=true", headers=headers)).json()
        assert [m["body"] for m in page["messages"]] == [SECRET]
    async with service(redis_url, driver, clock, None) as keyless:
        resp = await keyless.get(href, headers=headers)
        assert resp.status == 500
        doc = await resp.json()
        assert doc["title"] == "Message encryption unavailable"
        assert "--message-encryption-key" in doc["description"]


@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}])
async def test_the_flag_must_be_boolean(
    http: TestClient[web.Request, web.Application], headers: dict[str, str], value: Any
) -> None:
    resp = await http.put("/v2/queues/q", json={"_enable_encrypt_messages": value}, headers=headers)
    assert resp.status == 400
    assert "_enable_encrypt_messages must be boolean" in (await resp.json())["description"]


async def test_without_a_key_no_queue_can_be_made_encrypted(
    http: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    resp = await http.put("/v2/queues/q", json=ENCRYPTED, headers=headers)
    assert resp.status == 400
    assert "no message encryption key" in (await resp.json())["description"]
    assert (await (await http.get("/v2/queues", headers=headers)).json())["queues"] == []
    # a plain queue, and one that says false, are fine; GET shows the default
    resp = await http.put("/v2/queues/q", json={"_enable_encrypt_messages": False}, headers=headers)
    assert resp.status == 201
    shown = await (await http.get("/v2/queues/q", headers=headers)).json()
    assert shown["_enable_encrypt_messages"] is False
    patch = [{"op": "replace", "path": "/metadata/_enable_encrypt_messages", "value": True}]
    patch_headers = {
        **headers,
        "Content-Type": "application/openstack-messaging-v2.0-json-patch",
    }
    resp = await http.patch("/v2/queues/q", json=patch, headers=patch_headers)
    assert resp.status == 400
    shown = await (await http.get("/v2/queues/q", headers=headers)).json()
    assert shown["_enable_encrypt_messages"] is False


async def test_a_rotated_key_opens_what_the_old_one_sealed(
    redis_url: str, driver: str, clock: ManualClock, project: str
) -> None:
    """docs/security.md's rotation: the new key seals, the old one (named in
    --message-encryption-old-keys) still opens the bodies sealed before;
    once it is dropped, those are refused again, and what the new key
    sealed stays readable."""

    @asynccontextmanager
    async def opened(key: str, old: str | None = None) -> AsyncIterator[FeedStore]:
        settings = make_settings(
            redis_url, driver=driver, message_encryption_key=key, message_encryption_old_keys=old
        )
        async with opened_store(settings, clock) as feed:
            yield feed

    old_key, new_key = OTHER_KEY, "a new key after the rotation"
    async with opened(old_key) as before:
        await before.create_queue(project, "q", dict(ENCRYPTED))
        [old_id] = await before.post_messages(project, "q", WRITER, [body("sealed by the old key")])
    async with opened(new_key, old=old_key) as rotated:
        [new_id] = await rotated.post_messages(project, "q", WRITER, [body("sealed by the new")])
        got = await rotated.get_messages(project, "q", [old_id, new_id])
        assert [orjson.loads(m.body) for m in got] == ["sealed by the old key", "sealed by the new"]
    async with opened(new_key) as after:
        with pytest.raises(EncryptionUnavailable):
            await after.get_messages(project, "q", [old_id])
        [m] = await after.get_messages(project, "q", [new_id])
        assert orjson.loads(m.body) == "sealed by the new"
    async with opened(old_key) as old_only:  # the old key never learned the new one
        with pytest.raises(EncryptionUnavailable):
            await old_only.get_messages(project, "q", [new_id])


# -- a message that cannot be decrypted never costs another ------------------


async def alter(redis_url: str, project: str, queue: str, message_id: str) -> None:
    """Flip the last bit of a stored body (the body ends the record)."""
    client = direct_client(redis_url)
    try:
        key, _, end = await body_span(client, QueueKeys.of(project, queue), message_id)
        last = await client.getrange(key, end, end)
        assert isinstance(last, bytes)
        await client.setrange(key, end, bytes([last[0] ^ 1]))
    finally:
        await client.aclose()


async def good_bad_good(store: FeedStore, redis_url: str, project: str, queue: str) -> list[str]:
    """Three messages posted to an encrypted queue, the middle one altered in Redis."""
    await store.create_queue(project, queue, dict(ENCRYPTED))
    ids = await store.post_messages(project, queue, WRITER, [body(n) for n in ("a", "b", "c")])
    await alter(redis_url, project, queue, ids[1])
    return ids


async def test_pop_never_deletes_what_it_cannot_decrypt(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        a, bad, c = await good_bad_good(store, redis_url, project, "q")
        popped = await store.pop_messages(project, "q", 3)
        assert [(m.id, orjson.loads(m.body)) for m in popped] == [(a, "a"), (c, "c")]
        assert await store.pop_messages(project, "q", 3) == []
        stats = await store.queue_stats(project, "q")
        assert (stats.total, stats.free) == (1, 1)  # the unreadable one is still there
        assert (await raw_body(redis_url, project, "q", bad)).startswith(MAGIC)
        assert store.counters.unreadable_skipped >= 1


async def test_claim_never_hides_what_it_cannot_decrypt(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    async with stores(KEY) as store:
        a, _, c = await good_bad_good(store, redis_url, project, "q")
        claim = await store.claim_messages(project, "q", 60, 60, 3)
        assert claim is not None
        assert [(m.id, orjson.loads(m.body)) for m in claim.messages] == [(a, "a"), (c, "c")]
        again = await store.get_claim(project, "q", claim.id)
        assert [(m.id, m.body) for m in again.messages] == [(a, b'"a"'), (c, b'"c"')]
        stats = await store.queue_stats(project, "q")
        assert (stats.total, stats.claimed, stats.free) == (3, 2, 1)
        assert await store.claim_messages(project, "q", 60, 60, 3) is None  # not claimed either
        stats = await store.queue_stats(project, "q")
        assert (stats.total, stats.claimed, stats.free) == (3, 2, 1)


async def test_a_reader_is_never_stuck_behind_an_unreadable_message(
    stores: StoreMaker, redis_url: str, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Skipped, said in a log line and counted: never silently."""
    async with stores(KEY) as store:
        a, bad, c = await good_bad_good(store, redis_url, project, "q")
        page = await store.list_messages(project, "q", ListQuery(READER, limit=1))
        assert [m.id for m in page.messages] == [a]
        page = await store.list_messages(
            project, "q", ListQuery(READER, marker=page.next_marker, limit=1)
        )
        # the page that held only the unreadable one is empty but moves on
        assert page.messages == []
        assert page.next_marker is not None
        page = await store.list_messages(
            project, "q", ListQuery(READER, marker=page.next_marker, limit=1)
        )
        assert [m.id for m in page.messages] == [c]
        whole = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        assert [m.id for m in whole.messages] == [a, c]
        assert store.counters.unreadable_skipped >= 2
    assert any(bad in r.getMessage() and "cannot be decrypted" in r.getMessage()
               for r in caplog.records)  # fmt: skip


async def test_with_another_key_pop_and_claim_take_nothing(
    stores: StoreMaker, project: str
) -> None:
    """A botched rotation: nothing is taken, nothing is lost; the right key
    gets every message afterwards."""
    async with stores(KEY) as keyed:
        await keyed.create_queue(project, "q", dict(ENCRYPTED))
        ids = await keyed.post_messages(project, "q", WRITER, [body(n) for n in ("a", "b")])
    async with stores(OTHER_KEY) as wrong:
        assert await wrong.pop_messages(project, "q", 5) == []
        assert await wrong.claim_messages(project, "q", 60, 60, 5) is None
        assert (await wrong.list_messages(project, "q", ListQuery(READER))).messages == []
    async with stores(None) as keyless:
        with pytest.raises(EncryptionUnavailable, match="no --message-encryption-key"):
            await keyless.pop_messages(project, "q", 5)
        with pytest.raises(EncryptionUnavailable, match="no --message-encryption-key"):
            await keyless.claim_messages(project, "q", 60, 60, 5)
    async with stores(KEY) as keyed:
        stats = await keyed.queue_stats(project, "q")
        assert (stats.total, stats.free) == (2, 2)
        assert [m.id for m in await keyed.pop_messages(project, "q", 5)] == ids


@pytest.mark.slow
async def test_delivery_skips_an_unreadable_message_after_the_retry_policy(
    redis_url: str, driver: str, clock: ManualClock, headers: dict[str, str], project: str
) -> None:
    got: list[Any] = []
    app = web.Application()

    async def hook(request: web.Request) -> web.Response:
        got.append(orjson.loads(await request.read())["body"])
        return web.Response()

    app.router.add_post("/hook", hook)
    policy = {"retries_with_no_delay": 1, "minimum_delay_retries": 0,
              "maximum_delay_retries": 0, "minimum_delay": 0, "maximum_delay": 10}  # fmt: skip
    base = make_settings(
        redis_url,
        driver=driver,
        message_encryption_key=KEY,
        subscriber_allow="127.0.0.0/8",
        delivery_lease=3.0,
        delivery_timeout=1.0,
        delivery_sweep=0.2,
    )
    async with TestServer(app, host="127.0.0.1") as receiver:
        async with TestClient(TestServer(create_app(base.replace(deliver=False), clock))) as api:
            assert (await api.put("/v2/queues/q", json=ENCRYPTED, headers=headers)).status == 201
            resp = await api.post(
                "/v2/queues/q/subscriptions",
                json={"subscriber": str(receiver.make_url("/hook")), "ttl": 3600,
                      "options": {"_retry_policy": policy}},
                headers=headers,
            )  # fmt: skip
            assert resp.status == 201, await resp.text()
            sid = (await resp.json())["subscription_id"]

            async def post(text: str) -> None:
                resp = await api.post(
                    "/v2/queues/q/messages", json={"messages": [{"body": text}]}, headers=headers
                )
                assert resp.status == 201

            await post("a")
            async with stores_of(redis_url, driver, clock, OTHER_KEY) as other:
                await other.post_messages(project, "q", WRITER, [body("sealed by another key")])
            await post("c")
        async with TestClient(TestServer(create_app(base, clock))) as http:
            path = f"/v2/queues/q/subscriptions/{sid}"
            async with asyncio.timeout(30):
                while True:
                    doc = await (await http.get(path, headers=headers)).json()
                    if doc["delivery"]["failures"] == 1 and doc["delivery"]["delivered"] == 2:
                        break
                    clock.advance(5)  # across the retry policy's back-off
                    await asyncio.sleep(0.05)
    assert got == ["a", "c"]
    assert "cannot be decrypted" in doc["delivery"]["last_error"]


@asynccontextmanager
async def stores_of(
    redis_url: str, driver: str, clock: ManualClock, key: str | None
) -> AsyncIterator[FeedStore]:
    feed = make_store(make_settings(redis_url, driver=driver, message_encryption_key=key), clock)
    await feed.open()
    try:
        yield feed
    finally:
        await feed.close()


@pytest.mark.slow
async def test_a_live_follower_passes_over_an_unreadable_message(
    redis_url: str, driver: str, clock: ManualClock, headers: dict[str, str], project: str
) -> None:
    """The shared tail reads a page holding only an unreadable message: an
    empty page that moves on; the next message still reaches the long poll."""
    async with service(redis_url, driver, clock, KEY) as http:
        assert (await http.put("/v2/queues/q", json=ENCRYPTED, headers=headers)).status == 201
        polls = [
            asyncio.create_task(
                http.get("/v2/queues/q/messages?wait=20&echo=true", headers=headers)
            )
        ]
        async with stores_of(redis_url, driver, clock, OTHER_KEY) as other:
            # let the poll catch up and join the tail first (were it later, its
            # own backlog read would meet the message: passed over just the same)
            await asyncio.sleep(0.2)
            await other.post_messages(project, "q", WRITER, [body("sealed by another key")])
            await asyncio.sleep(0.2)
        resp = await http.post(
            "/v2/queues/q/messages", json={"messages": [{"body": "readable"}]}, headers=headers
        )
        assert resp.status == 201
        async with asyncio.timeout(30):
            answer = await polls[0]
        assert answer.status == 200, await answer.text()
        assert [m["body"] for m in (await answer.json())["messages"]] == ["readable"]
        metrics = await (await http.get("/metrics")).text()
        [count] = [line for line in metrics.splitlines() if line.startswith("feedsvc_unreadable_")]
        assert count.startswith("feedsvc_unreadable_skipped_total ")
        assert float(count.split()[1]) >= 1


async def test_over_http_pop_and_claim_pass_over_an_unreadable_message(
    redis_url: str, driver: str, clock: ManualClock, headers: dict[str, str], project: str
) -> None:
    """The issue's case: pop over [good, bad, good] was a 500 that deleted all
    three; now it returns the good two and the bad one stays (a claim the same)."""
    async with service(redis_url, driver, clock, KEY) as http:
        for queue in ("popped", "claimed"):
            assert (
                await http.put(f"/v2/queues/{queue}", json=ENCRYPTED, headers=headers)
            ).status == 201
            resp = await http.post(
                f"/v2/queues/{queue}/messages",
                json={"messages": [{"body": n} for n in ("a", "b", "c")]},
                headers=headers,
            )
            assert resp.status == 201
            ids = [h.rsplit("/", 1)[1] for h in (await resp.json())["resources"]]
            await alter(redis_url, project, queue, ids[1])
        resp = await http.delete("/v2/queues/popped/messages?pop=3", headers=headers)
        assert resp.status == 200, await resp.text()
        assert [m["body"] for m in (await resp.json())["messages"]] == ["a", "c"]
        resp = await http.post("/v2/queues/claimed/claims?limit=3", json={}, headers=headers)
        assert resp.status == 201, await resp.text()
        assert [m["body"] for m in (await resp.json())["messages"]] == ["a", "c"]
        for queue, claimed in (("popped", 0), ("claimed", 2)):
            stats = await (await http.get(f"/v2/queues/{queue}/stats", headers=headers)).json()
            assert stats["messages"]["total"] == (1 if queue == "popped" else 3)
            assert stats["messages"]["claimed"] == claimed
