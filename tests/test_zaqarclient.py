"""The real python-zaqarclient against a live ``feedsvc serve``.

One service process per driver is started for this module on a free port,
against the session's redis-server; every test talks to it through the
synchronous client (requests) in a project of its own, so the tests are
plain sync functions. The client's wire habits (dashless Client-IDs, next
hrefs followed verbatim, GET-then-PATCH metadata updates removing every
reserved key, repeated ``ids``) are what is being checked.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pytest
from zaqarclient.queues import client as zaqar
from zaqarclient.queues.v2 import message as zaqar_message
from zaqarclient.transport import errors as zaqar_errors

from feedsvc.embedded_redis.server import RedisServer, pick_free_port
from feedsvc.testing import ServiceProcess
from tests.conftest import PROCESS_DRIVERS

pytestmark = pytest.mark.process  # feedsvc serve, for python-zaqarclient to talk to

# A bound on items taken from a stream: a listing that loops shows up as a
# failed assertion instead of a hang.
MAX_ITEMS = 200
SIGNED_URL_KEY = "zaqarclient-" + uuid.uuid4().hex
RESERVED_KEYS = {
    "_max_messages_post_size",
    "_default_message_ttl",
    "_default_message_delay",
    "_dead_letter_queue",
    "_dead_letter_queue_messages_ttl",
    "_max_claim_count",
}


@pytest.fixture(scope="module", params=PROCESS_DRIVERS)
def service(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """The base URL of a running ``feedsvc serve`` using one driver."""
    driver = str(request.param)
    log = tmp_path_factory.mktemp(f"serve-{driver}") / "serve.log"
    flags = ("--redis-url", redis_server.url, "--driver", driver, "--min-message-ttl", "1",
             "--signed-url-key", SIGNED_URL_KEY)  # fmt: skip
    with ServiceProcess(*flags, log_path=log) as svc:
        assert f"driver {driver}" in svc.log_text()
        yield svc.url
        code = svc.stop(signal.SIGTERM)
    assert code == 0, svc.log_text()


def make_client(url: str, project: str) -> Any:
    conf = {
        "auth_opts": {"backend": "noauth", "options": {"os_project_id": project}},
        "client_uuid": uuid.uuid4().hex,
    }
    return zaqar.Client(url, version=2, conf=conf)


@pytest.fixture
def project() -> str:
    return "zq-" + uuid.uuid4().hex


@pytest.fixture
def cli(service: str, project: str) -> Any:
    return make_client(service, project)


@pytest.fixture
def reader(service: str, project: str) -> Any:
    """Another client of the same project (so echo=false shows cli's messages)."""
    return make_client(service, project)


def ids_of(post_result: Any) -> list[str]:
    hrefs: list[str] = post_result["resources"]
    return [href.rsplit("/", 1)[1] for href in hrefs]


def take(iterable: Any) -> list[Any]:
    return list(islice(iterable, MAX_ITEMS))


def queue_names(cli: Any, **params: Any) -> list[str]:
    listing, _ = cli.queues(**params)
    return [q.name for q in take(listing.stream())]


# -- service ---------------------------------------------------------------------------------


def test_ping(cli: Any) -> None:
    assert cli.ping() is True


def test_ping_of_a_dead_service_is_false(project: str) -> None:
    port = pick_free_port()
    assert make_client(f"http://127.0.0.1:{port}", project).ping() is False


def test_client_id_is_sent_dashless(cli: Any) -> None:
    # The client's own id spelling must be what the echo filter compares.
    assert re.fullmatch(r"[0-9a-f]{32}", cli.client_uuid)
    q = cli.queue("echo")
    q.post([{"body": "mine"}])
    assert take(q.messages()) == []
    assert [m.body for m in take(q.messages(echo=True))] == ["mine"]


def test_signed_url_client(cli: Any, service: str) -> None:
    # The client's own way: a signed URL made by one client, handed to
    # another that holds nothing else (backend "signed-url").
    url = cli.queue("shared").signed_url(
        paths=["messages", "claims"], methods=["GET", "POST", "DELETE"], ttl_seconds=600
    )
    assert url["paths"] == ["/v2/queues/shared/claims", "/v2/queues/shared/messages"]
    options = {k: url[k] for k in ("signature", "expires", "methods", "paths")}
    conf = {
        "auth_opts": {
            "backend": "signed-url",
            "options": {**options, "os_project_id": url["project"]},
        },
        "client_uuid": uuid.uuid4().hex,
    }
    guest = zaqar.Client(service, version=2, conf=conf).queue("shared")
    guest.post([{"body": n} for n in range(3)])
    assert [m.body for m in take(guest.messages(echo=True))] == [0, 1, 2]
    claim = guest.claim(ttl=60, grace=60, limit=2)
    claimed = list(claim)
    claimed[0].delete()  # DELETE .../messages/{id}?claim_id=...
    claim.delete()
    assert [m.body for m in take(cli.queue("shared").messages(echo=True))] == [1, 2]
    # what it was not signed for
    with pytest.raises(zaqar_errors.ResourceNotFound):
        guest.stats  # noqa: B018 (a property that sends a request)
    elsewhere = zaqar.Client(service, version=2, conf=conf).queue("other")
    with pytest.raises(zaqar_errors.ResourceNotFound):
        elsewhere.post([{"body": "x"}])
    assert queue_names(cli) == ["shared"]


# -- queues ----------------------------------------------------------------------------------


def test_queue_create_list_stats_delete(cli: Any) -> None:
    lazy = cli.queue("lazy")  # sends nothing
    assert queue_names(cli) == []
    created = cli.queue("forced", force_create=True)
    assert queue_names(cli) == ["forced"]
    lazy.post({"body": "first", "ttl": 300})
    assert queue_names(cli) == ["forced", "lazy"]
    listing, count = cli.queues(with_count=True)
    assert count == 2
    assert sorted(q.name for q in take(listing)) == ["forced", "lazy"]
    stats = lazy.stats
    assert stats["messages"]["total"] == 1
    assert stats["messages"]["free"] == 1
    assert stats["messages"]["claimed"] == 0
    assert created.stats["messages"]["total"] == 0
    created.delete()
    assert queue_names(cli) == ["lazy"]
    listing, count = cli.queues(with_count=True)
    assert count == 1
    lazy.delete()
    assert queue_names(cli) == []


def test_queue_metadata_get_and_update(cli: Any) -> None:
    q = cli.queue("meta", force_create=True)
    shown = q.metadata()
    assert set(shown) >= RESERVED_KEYS
    assert shown["_default_message_ttl"] == 3600
    # The client GETs, then PATCHes: add for new keys, remove for every key
    # it was shown, the reserved defaults included.
    updated = q.metadata(new_meta={"a": 1, "nested": {"x": [1, 2]}})
    assert updated["a"] == 1
    assert updated["nested"] == {"x": [1, 2]}
    assert set(updated) >= RESERVED_KEYS
    assert q.metadata(force_reload=True) == updated
    # Replacing: "a" goes, "b" comes, a reserved setting changes and is honoured.
    updated = q.metadata(new_meta={"b": "two", "_default_message_ttl": 120})
    assert "a" not in updated
    assert "nested" not in updated
    assert updated["b"] == "two"
    assert updated["_default_message_ttl"] == 120
    again = cli.queue("meta").metadata(force_reload=True)
    assert again == updated
    [mid] = ids_of(q.post({"body": "x"}))
    assert q.message(mid).ttl == 120
    # An empty dict clears the user metadata; defaults are shown again.
    cleared = q.metadata(new_meta={})
    assert {k for k in cleared if not k.startswith("_")} == set()
    assert cleared["_default_message_ttl"] == 3600


def test_metadata_of_missing_queue_cannot_be_updated(cli: Any) -> None:
    q = cli.queue("ghost")
    with pytest.raises(zaqar_errors.ResourceNotFound):
        q.metadata(new_meta={"a": 1})
    assert queue_names(cli) == []


def test_queue_stream_lists_each_queue_once(cli: Any) -> None:
    names = ["q-3", "a", "m_1", "Z", "b-2"]
    for name in names:
        cli.queue(name, force_create=True)
    listing, _ = cli.queues(limit=2)
    first = take(listing)
    assert [q.name for q in first] == sorted(names)[:2]
    assert queue_names(cli, limit=2) == sorted(names)
    assert queue_names(cli, limit=1) == sorted(names)
    assert queue_names(cli, limit=20) == sorted(names)


def test_queue_stream_of_a_single_queue_ends(cli: Any) -> None:
    # Zaqar's redis driver loops forever here (marker == first queue).
    cli.queue("only", force_create=True)
    for limit in (1, 2):
        assert queue_names(cli, limit=limit) == ["only"]


def test_queue_stream_after_a_claim_on_a_dead_lettering_queue(cli: Any, project: str) -> None:
    # The client cannot set a reserved key that is shown as null (it adds
    # it, then removes every key it was shown), so create the queue raw.
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "b-dlq"}
    put = urllib.request.Request(
        f"{cli.api_url}/v2/queues/work",
        data=json.dumps(metadata).encode(),
        method="PUT",
        headers={
            "Client-ID": cli.client_uuid,
            "X-Project-ID": project,
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(put, timeout=10) as response:
        assert response.status == 201
    work = cli.queue("work")
    assert work.metadata()["_max_claim_count"] == 1
    cli.queue("a", force_create=True)
    cli.queue("c", force_create=True)
    work.post({"body": "m"})
    claim = work.claim(ttl=60, grace=60, limit=1)
    assert [m.body for m in take(claim)] == ["m"]
    # Nothing has been dead-lettered yet; every queue is streamed, once.
    names = queue_names(cli, limit=1)
    assert {"a", "c", "work"} <= set(names), names
    assert len(names) == len(set(names))
    assert names == queue_names(cli, limit=20)
    # Release and claim again: the message moves to the dead-letter queue.
    claim.delete()
    assert work.claim(ttl=60, grace=60).id is None
    assert queue_names(cli, limit=1) == ["a", "b-dlq", "c", "work"]
    dead = take(cli.queue("b-dlq").messages(echo=True).stream())
    assert [m.body for m in dead] == ["m"]


def test_detailed_queue_listing(cli: Any) -> None:
    cli.queue("d1", force_create=True).metadata(new_meta={"k": "v"})
    listing, _ = cli.queues(detailed=True, limit=1)
    queues = take(listing.stream())
    assert [q.name for q in queues] == ["d1"]
    assert queues[0].metadata()["k"] == "v"


# -- messages --------------------------------------------------------------------------------


def test_post_and_stream_every_message_once(cli: Any, reader: Any) -> None:
    q = cli.queue("feed")
    bodies = [{"n": i} for i in range(25)]
    ids = ids_of(q.post([{"body": b, "ttl": 600} for b in bodies]))
    assert len(ids) == 25
    # Without stream() only the first page (10 by default).
    first = take(q.messages(echo=True))
    assert [m.id for m in first] == ids[:10]
    assert all(m.ttl == 600 for m in first)
    streamed = take(q.messages(echo=True).stream())
    assert [m.id for m in streamed] == ids
    assert [m.body for m in streamed] == bodies
    streamed = take(q.messages(echo=True, limit=7).stream())
    assert [m.id for m in streamed] == ids
    # Another client sees them without echo; the poster does not.
    streamed = take(reader.queue("feed").messages().stream())
    assert [m.id for m in streamed] == ids
    assert take(q.messages().stream()) == []


def test_stream_after_more_posts(cli: Any, reader: Any) -> None:
    q = cli.queue("more")
    ids = ids_of(q.post([{"body": i} for i in range(3)]))
    listing = reader.queue("more").messages(limit=2).stream()
    seen = [m.id for m in take(listing)]
    assert seen == ids
    ids += ids_of(q.post([{"body": i} for i in range(3, 5)]))
    assert [m.id for m in take(reader.queue("more").messages(limit=2).stream())] == ids


def test_get_messages_by_id(cli: Any) -> None:
    q = cli.queue("byid")
    a, b, c = ids_of(q.post([{"body": "A"}, {"body": "B"}, {"body": "C"}]))
    got = take(q.messages(a, c))
    assert [m.id for m in got] == [a, c]
    assert [m.body for m in got] == ["A", "C"]
    one = q.message(b)
    assert one.id == b
    assert one.body == "B"
    assert one.claim_id is None
    with pytest.raises(zaqar_errors.ResourceNotFound):
        q.message("0" * 24)


def test_delete_messages(cli: Any) -> None:
    q = cli.queue("del")
    ids = ids_of(q.post([{"body": i} for i in range(4)]))
    q.delete_messages(ids[0], ids[2])
    assert [m.id for m in take(q.messages(echo=True).stream())] == [ids[1], ids[3]]
    q.message(ids[1]).delete()
    assert [m.id for m in take(q.messages(echo=True).stream())] == [ids[3]]
    assert q.stats["messages"]["total"] == 1


def test_pop(cli: Any) -> None:
    q = cli.queue("pop")
    ids = ids_of(q.post([{"body": i} for i in range(3)]))
    popped = take(q.pop(1))
    assert [m.id for m in popped] == ids[:1]
    assert [m.body for m in popped] == [0]
    popped = take(q.pop(5))
    assert [m.body for m in popped] == [1, 2]
    assert take(q.pop(1)) == []
    assert q.stats["messages"]["total"] == 0


# -- claims --------------------------------------------------------------------------------------


def test_claim_lifecycle(cli: Any, reader: Any) -> None:
    q = cli.queue("work")
    ids = ids_of(q.post([{"body": f"job{i}"} for i in range(3)]))
    claim = q.claim(ttl=60, grace=60, limit=2)
    assert claim.id
    claimed = take(claim)
    assert [m.id for m in claimed] == ids[:2]
    assert [m.body for m in claimed] == ["job0", "job1"]
    assert all(m.claim_id == claim.id for m in claimed)
    # Claimed messages are hidden from other readers.
    assert [m.id for m in take(reader.queue("work").messages().stream())] == ids[2:]
    stats = q.stats["messages"]
    assert (stats["claimed"], stats["free"], stats["total"]) == (2, 1, 3)
    # A claimed message cannot be deleted without its claim...
    unclaimed_ref = zaqar_message.Message(
        q, ttl=60, age=0, body=None, id=ids[0], href=f"/v2/queues/work/messages/{ids[0]}"
    )
    assert unclaimed_ref.claim_id is None
    with pytest.raises(zaqar_errors.ForbiddenError):
        unclaimed_ref.delete()
    # ...but can with it, as read back by id too.
    assert q.message(ids[0]).claim_id == claim.id
    assert q.message(ids[1]).claim_id == claim.id
    claimed[0].delete()
    with pytest.raises(zaqar_errors.ResourceNotFound):
        q.message(ids[0])
    # Renew, then read the claim back.
    claim.update(ttl=120)
    fetched = q.claim(id=claim.id)
    assert fetched.ttl == 120
    assert fetched.age >= 0
    assert [m.id for m in take(fetched)] == ids[1:2]
    # Nothing else to claim but the third message; then nothing at all.
    other = q.claim(ttl=60, grace=60, limit=20)
    assert [m.id for m in take(other)] == ids[2:]
    empty = q.claim(ttl=60, grace=60, limit=20)
    assert empty.id is None
    assert take(empty) == []
    # Release: the message is visible and claimable again.
    claim.delete()
    with pytest.raises(zaqar_errors.ResourceNotFound):
        q.claim(id=claim.id).ttl  # noqa: B018
    assert [m.id for m in take(reader.queue("work").messages().stream())] == ids[1:2]
    again = q.claim(ttl=60, grace=60, limit=5)
    assert [m.id for m in take(again)] == ids[1:2]
    stats = q.stats["messages"]
    assert (stats["claimed"], stats["free"], stats["total"]) == (2, 0, 2)


def test_claim_of_empty_queue(cli: Any) -> None:
    q = cli.queue("nothing", force_create=True)
    claim = q.claim(ttl=60, grace=60)
    assert claim.id is None
    assert take(claim) == []


def test_pop_never_takes_claimed_messages(cli: Any) -> None:
    q = cli.queue("pc")
    ids = ids_of(q.post([{"body": i} for i in range(3)]))
    claim = q.claim(ttl=60, grace=60, limit=1)
    assert [m.id for m in take(claim)] == ids[:1]
    assert [m.id for m in take(q.pop(20))] == ids[1:]
    assert [m.id for m in take(q.claim(id=claim.id))] == ids[:1]


def test_purge(cli: Any) -> None:
    q = cli.queue("purge", force_create=True)
    q.metadata(new_meta={"keep": True})
    q.post([{"body": i} for i in range(3)])
    claim = q.claim(ttl=60, grace=60, limit=1)
    assert claim.id
    q.purge()
    stats = q.stats["messages"]
    assert (stats["claimed"], stats["free"], stats["total"]) == (0, 0, 0)
    assert take(q.messages(echo=True, include_claimed=True).stream()) == []
    assert q.metadata(force_reload=True)["keep"] is True
    assert queue_names(cli) == ["purge"]
    with pytest.raises(zaqar_errors.ResourceNotFound):
        q.claim(id=claim.id).ttl  # noqa: B018
