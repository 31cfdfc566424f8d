"""POST, GET and DELETE /v2/queues/{q}/redrive: the HTTP contract of a
dead-letter queue's redrive, moved on by the app's own redriver."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.handlers import iso8601_from_ms
from feedsvc.app import create_app
from feedsvc.appkeys import REDRIVER
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from tests.conftest import make_settings
from tests.test_api import ISO_UTC, closed_port

Client = TestClient[web.Request, web.Application]
DLQ = "/v2/queues/dlq"


async def dead_letters(http: Client, headers: dict[str, str], n: int) -> list[str]:
    """n messages moved from q to dlq by claims over q's _max_claim_count."""
    meta = {"_max_claim_count": 1, "_dead_letter_queue": "dlq", "_default_message_ttl": 900}
    assert (await http.put("/v2/queues/q", json=meta, headers=headers)).status == 201
    messages = [{"body": {"n": i}, "ttl": 300} for i in range(n)]
    posted = await http.post("/v2/queues/q/messages", json={"messages": messages}, headers=headers)
    ids = [href.rsplit("/", 1)[1] for href in (await posted.json())["resources"]]
    claim = await http.post("/v2/queues/q/claims?limit=20", json={"ttl": 60}, headers=headers)
    assert claim.status == 201
    await http.delete(claim.headers["Location"], headers=headers)
    again = await http.post("/v2/queues/q/claims?limit=20", json={"ttl": 60}, headers=headers)
    assert again.status == 204  # all moved to dlq
    assert await listed(http, headers, "dlq") == ids
    return ids


async def listed(http: Client, headers: dict[str, str], queue: str) -> list[str]:
    page = await http.get(f"/v2/queues/{queue}/messages?echo=true&limit=20", headers=headers)
    return [m["id"] for m in (await page.json())["messages"]]


async def moved_back(
    http: Client, headers: dict[str, str], queue: str, ids: list[str], layout: str
) -> list[str]:
    """The queue holds these dead letters again, in order, and nothing else
    (dead_letters' bodies {"n": i}): under their ids in the older layout,
    under new ones in segments (an id there is its position: docs/design.md).
    Their ids there."""
    page = await http.get(f"/v2/queues/{queue}/messages?echo=true&limit=20", headers=headers)
    messages = (await page.json())["messages"]
    assert [m["body"] for m in messages] == [{"n": i} for i in range(len(ids))]
    if layout == "records":
        assert [m["id"] for m in messages] == ids
    else:
        assert not {m["id"] for m in messages} & set(ids)
    return [m["id"] for m in messages]


async def progress_when(
    http: Client, headers: dict[str, str], done: Any, path: str = DLQ + "/redrive"
) -> dict[str, Any]:
    """The redrive's progress once done(progress) holds (the redriver ticks
    in the background)."""
    while True:
        response = await http.get(path, headers=headers)
        assert response.status == 200
        progress: dict[str, Any] = await response.json()
        if done(progress):
            return progress
        await asyncio.sleep(0.05)


async def test_a_redrive_moves_the_dead_letters_back_and_reports_it(
    http: Client, headers: dict[str, str], storage_layout: str
) -> None:
    ids = await dead_letters(http, headers, 3)
    started = await http.post(DLQ + "/redrive", json={"max_per_second": 50}, headers=headers)
    assert started.status == 202
    assert started.headers["Location"] == DLQ + "/redrive"
    body = await started.json()
    assert {k: body[k] for k in ("state", "moved", "remaining", "max_per_second", "to")} == {
        "state": "running",
        "moved": 0,
        "remaining": 3,
        "max_per_second": 50,
        "to": None,
    }
    assert body["started_at"].endswith("Z") and body["updated_at"] >= body["started_at"]
    done = await progress_when(http, headers, lambda p: p["state"] == "done")
    assert (done["moved"], done["skipped"], done["remaining"]) == (3, 0, 0)
    first = (await moved_back(http, headers, "q", ids, storage_layout))[0]
    assert await listed(http, headers, "dlq") == []
    back = await http.get(f"/v2/queues/q/messages/{first}", headers=headers)
    message = await back.json()
    assert (message["body"], message["ttl"]) == ({"n": 0}, 900)


async def test_a_redrives_times_are_the_apis_zaqar_times_to_the_second(
    http: Client, headers: dict[str, str], clock: ManualClock
) -> None:
    """started_at and updated_at are written by the one function that writes
    the API's times (as a queue's stats write a message's "created"), UTC to
    the second as Zaqar writes message and claim times: no fraction."""
    await dead_letters(http, headers, 1)
    clock.advance(0.25 if clock.now_ms() % 1000 == 0 else 0)  # a time with a fraction
    started = await http.post(DLQ + "/redrive", json={"max_per_second": 10}, headers=headers)
    body = await started.json()
    done = await progress_when(http, headers, lambda p: p["state"] == "done")
    # the service's clock stands still: every time it wrote is this one
    now = iso8601_from_ms(clock.now_ms())
    assert ISO_UTC.match(now), now
    assert (body["started_at"], body["updated_at"]) == (now, now)
    assert (done["started_at"], done["updated_at"]) == (now, now)


def test_the_apis_times_are_utc_to_the_second_cut_not_rounded() -> None:
    assert iso8601_from_ms(0) == "1970-01-01T00:00:00Z"
    assert iso8601_from_ms(1_700_000_000_999) == "2023-11-14T22:13:20Z"


async def test_the_rate_bounds_what_the_redriver_moves(
    http: Client, headers: dict[str, str], clock: ManualClock
) -> None:
    await dead_letters(http, headers, 5)
    started = await http.post(DLQ + "/redrive", json={"max_per_second": 2}, headers=headers)
    assert started.status == 202
    await progress_when(http, headers, lambda p: p["moved"] == 2)
    # the service's clock stands still: nothing more is due
    assert await http.app[REDRIVER].tick() == 0
    assert (await (await http.get(DLQ + "/redrive", headers=headers)).json())["moved"] == 2
    clock.advance(1)
    progress = await progress_when(http, headers, lambda p: p["moved"] == 4)
    assert progress["remaining"] == 1
    assert await http.app[REDRIVER].tick() == 0


async def test_a_second_redrive_while_one_runs_is_409_and_cancel_stops_it(
    http: Client, headers: dict[str, str], storage_layout: str
) -> None:
    ids = await dead_letters(http, headers, 3)
    assert (
        await http.post(DLQ + "/redrive", json={"max_per_second": 1}, headers=headers)
    ).status == 202
    await progress_when(http, headers, lambda p: p["moved"] == 1)
    again = await http.post(DLQ + "/redrive", json={"max_per_second": 9}, headers=headers)
    assert again.status == 409
    assert "running" in (await again.json())["description"]
    cancelled = await http.delete(DLQ + "/redrive", headers=headers)
    assert cancelled.status == 200
    body = await cancelled.json()
    assert (body["state"], body["moved"], body["remaining"], body["max_per_second"]) == (
        "cancelled",
        1,
        2,
        1,
    )
    assert not await http.app[REDRIVER].tick()  # none runs
    await moved_back(http, headers, "q", ids[:1], storage_layout)
    assert await listed(http, headers, "dlq") == ids[1:]
    # a cancelled one may be followed by another
    assert (
        await http.post(DLQ + "/redrive", json={"max_per_second": 9}, headers=headers)
    ).status == 202


async def test_a_redrive_to_another_queue(http: Client, headers: dict[str, str]) -> None:
    ids = await dead_letters(http, headers, 2)
    body = {"max_per_second": 10, "to": "retry"}
    started = await http.post(DLQ + "/redrive", json=body, headers=headers)
    assert (await started.json())["to"] == "retry"
    await progress_when(http, headers, lambda p: p["state"] == "done")
    assert await listed(http, headers, "retry") == ids


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"{}",
        b'{"max_per_second": 0}',
        b'{"max_per_second": 1001}',
        b'{"max_per_second": 2.5}',
        b'{"max_per_second": true}',
        b'{"max_per_second": "5"}',
        b'{"max_per_second": 5, "rate": 1}',
        b'{"max_per_second": 5, "to": "no/such name"}',
        b'{"max_per_second": 5, "to": 7}',
        b'{"max_per_second": 5, "to": "dlq"}',
    ],
)
async def test_a_bad_redrive_is_400_and_starts_nothing(
    http: Client, headers: dict[str, str], body: bytes
) -> None:
    await http.put("/v2/queues/dlq", headers=headers)
    sent = {**headers, "Content-Type": "application/json"}
    response = await http.post(DLQ + "/redrive", data=body, headers=sent)
    assert response.status == 400
    assert set(await response.json()) == {"title", "description"}
    assert (await http.get(DLQ + "/redrive", headers=headers)).status == 404


async def test_no_redrive_of_a_queue_that_does_not_exist(
    http: Client, headers: dict[str, str]
) -> None:
    missing = await http.post(DLQ + "/redrive", json={"max_per_second": 1}, headers=headers)
    assert missing.status == 404
    assert (await http.get(DLQ + "/redrive", headers=headers)).status == 404
    assert (await http.delete(DLQ + "/redrive", headers=headers)).status == 404
    await http.put("/v2/queues/dlq", headers=headers)
    empty = await http.post(DLQ + "/redrive", json={"max_per_second": 1}, headers=headers)
    assert empty.status == 202 and (await empty.json())["remaining"] == 0
    done = await progress_when(http, headers, lambda p: p["state"] == "done")
    assert done["moved"] == 0


@pytest.fixture
def driver() -> str:
    """Scopes are checked before storage: one driver is enough."""
    return "lua"


@pytest.fixture
async def scoped(redis_url: str, tmp_path: Path, project: str) -> Any:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"dlq-only-token-000000 {project} manage:dlq read:*\n"
        f"dlq-and-retry-token-0 {project} manage:dlq read:* post:retry\n"
    )
    settings: Settings = make_settings(redis_url, driver="lua", auth_token_file=tokens)
    async with TestClient(TestServer(create_app(settings, ManualClock()))) as client:
        yield client


async def test_a_redrive_to_another_queue_needs_post_on_it(scoped: Client, client_id: str) -> None:
    async def as_(token: str) -> dict[str, str]:
        return {"Client-ID": client_id, "Authorization": f"Bearer {token}"}

    owner = await as_("dlq-only-token-000000")
    await scoped.put("/v2/queues/dlq", headers=owner)
    body = {"max_per_second": 1, "to": "retry"}
    refused = await scoped.post(DLQ + "/redrive", json=body, headers=owner)
    assert refused.status == 403
    assert "post on 'retry'" in (await refused.json())["description"]
    assert (await scoped.get(DLQ + "/redrive", headers=owner)).status == 404
    # back to their sources needs no more than manage on the dead-letter queue
    home = await scoped.post(DLQ + "/redrive", json={"max_per_second": 1}, headers=owner)
    assert home.status == 202
    await scoped.delete(DLQ + "/redrive", headers=owner)
    allowed = await scoped.post(
        DLQ + "/redrive", json=body, headers=await as_("dlq-and-retry-token-0")
    )
    assert allowed.status == 202


async def test_redis_down_is_503_with_retry_after(headers: dict[str, str]) -> None:
    settings = make_settings(
        f"redis://127.0.0.1:{closed_port()}",
        driver="lua",
        pool_timeout=0.5,
        redis_timeout=0.5,
        redis_connect_timeout=0.5,
    )
    async with TestClient(TestServer(create_app(settings))) as down:
        async with asyncio.timeout(60):  # a guard against a hang, not a speed requirement
            for method in ("POST", "GET", "DELETE"):
                body = {"max_per_second": 1} if method == "POST" else None
                response = await down.request(method, DLQ + "/redrive", json=body, headers=headers)
                assert response.status == 503, method
                assert int(response.headers["Retry-After"]) >= 1
                assert set(await response.json()) == {"title", "description"}
            # bad input is still a 400, before any Redis is needed
            bad = await down.post(DLQ + "/redrive", json={"max_per_second": 0}, headers=headers)
            assert bad.status == 400


async def test_a_redriven_message_keeps_its_headers(http: Client, headers: dict[str, str]) -> None:
    meta = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
    assert (await http.put("/v2/queues/q", json=meta, headers=headers)).status == 201
    sent = {"trace-id": "abc", "kind": "order"}
    posted = await http.post(
        "/v2/queues/q/messages",
        json={"messages": [{"body": 1, "headers": sent}, {"body": 2}]},
        headers=headers,
    )
    assert posted.status == 201
    for expected in (201, 204):  # the second claim finds both dead-lettered
        claim = await http.post("/v2/queues/q/claims", json={"ttl": 60}, headers=headers)
        assert claim.status == expected
        if expected == 201:
            await http.delete(claim.headers["Location"], headers=headers)
    assert (
        await http.post(DLQ + "/redrive", json={"max_per_second": 50}, headers=headers)
    ).status == 202
    await progress_when(http, headers, lambda p: p["state"] == "done")
    page = await http.get("/v2/queues/q/messages?echo=true", headers=headers)
    back = {m["body"]: m.get("headers") for m in (await page.json())["messages"]}
    assert back == {1: sent, 2: None}
