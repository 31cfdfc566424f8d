"""Shared fixtures: one real redis-server per test session, stores and HTTP
clients for both drivers.

Every test works in a project of its own (a random X-Project-ID), so tests
never see each other's data and no flushing is needed.

Markers (pyproject.toml) let ``make test-fast`` leave out what needs more
than the session's one redis-server: ``cluster`` is set here for every test
on the Redis Cluster, ``process`` and ``slow`` in the test modules; and
``full_driver``, set here, leaves the watch-naive driver to the full run. Under a
``-m`` that excludes ``process``, a test that starts a process anyway fails
and says so (:class:`ProcessGuard`), so the fast loop stays what it claims.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web, web_app
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis, RedisCluster

from feedsvc.app import create_app
from feedsvc.clock import Clock, ManualClock
from feedsvc.config import DEFAULT_STORAGE_LAYOUT, STORAGE_LAYOUTS, Settings
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.base import FeedStore
from feedsvc.storage.drivers import make_store
from tests.cluster import LocalCluster

# The contract suites (the ``driver`` fixture) run every driver; the tests
# that start processes of their own (feedsvc serve, redis-servers) run the
# two that matter for the product, lua and watch: watch-naive exists for the
# load comparison and shares all but its POST path with watch, which the
# contract suites cover on it (they took some 40 % longer with it, the
# process tests would have grown as much again).
DRIVERS = ["lua", "watch", "watch-naive"]
PROCESS_DRIVERS = ["lua", "watch"]
# For the same reason the fast loop (make test-fast) leaves watch-naive's
# runs of the contract suites to the full run: a third of its tests, and the
# driver no client is meant to run (tests/test_watch_drivers.py, which
# names it, stays in the fast loop).
FULL_RUN_DRIVERS = ["watch-naive"]


class ProcessGuard:
    """Fails any process start in this interpreter while armed (an audit hook).

    Armed when the run deselects ``process`` tests; the session's redis-server
    is started with :meth:`allowed`.
    """

    EVENTS = frozenset(
        {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
         "os.system", "os.exec"}
    )  # fmt: skip
    armed = False

    @classmethod
    def audit(cls, event: str, args: tuple[object, ...]) -> None:
        if cls.armed and event in cls.EVENTS:
            raise RuntimeError(
                f"{event}{args[:2]!r}: this test starts a process, so it needs "
                "@pytest.mark.process (a run with -m 'not process' allows only the "
                "session's redis-server)"
            )

    @classmethod
    @contextlib.contextmanager
    def allowed(cls) -> Iterator[None]:
        armed, cls.armed = cls.armed, False
        try:
            yield
        finally:
            cls.armed = armed


def pytest_configure(config: pytest.Config) -> None:
    STORAGE_LAYOUT[0] = str(config.getoption("--storage-layout"))
    # Under pytest-xdist (make test) the controller runs no test and starts
    # the workers, processes of its own: the guard is armed in the workers.
    xdist_controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput"
    )
    if "not process" in str(config.getoption("markexpr", "")) and not xdist_controller:
        if hasattr(config, "workerinput"):
            platform.platform()  # a worker reports it, and it runs uname once (then cached)
        sys.addaudithook(ProcessGuard.audit)
        ProcessGuard.armed = True


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is there once the tests are collected (the imported modules, the
    collected tests: some 170,000 objects) lives as long as the run: frozen,
    full garbage collections leave it out instead of walking it again and
    again while a test's event loop waits (see pytest_runtest_teardown)."""
    gc.freeze()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """aiohttp memoizes every handler with its app's middlewares, keyed by
    the app, 1,024 at a time (``aiohttp.web_app._cached_build_middleware``,
    see tests/test_canaries.py): harmless for a service's one app, but the
    tests make an app per test, and the cache kept the last few hundred alive
    with their stores, Redis clients and metrics. A worker grew to 700,000
    objects, and a full garbage collection of them blocked the event loop a
    test shares with its app and Redis for up to 2.5 s: a 1 s connect timeout
    became a 503, a 1 s ttl in Redis ran out between two requests."""
    cached = getattr(web_app, "_cached_build_middleware", None)
    if cached is not None:
        cached.cache_clear()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendfsync="no")
    assert server.port != 6379
    with ProcessGuard.allowed():
        server.start()
    yield server
    server.stop()


# Suites that run against a real 3-primary Redis Cluster as well as a single
# server: the store contract and the HTTP API, for both drivers.
CLUSTER_SUITES = {
    "test_follow",
    "test_live",
    "test_store",
    "test_store_claims",
    "test_group_property",
    "test_group_upkeep",
    "test_store_redrive",
    "test_store_upgrade",
    "test_layout_upgrade",
    "test_api",
    "test_api_claims",
    "test_encryption",
    "test_topics",
    "test_api_subscriptions",
    "test_delivery",
    "test_queue_gauges",
    "test_quotas",
    "test_segments",
    "test_segments_combined",
}


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rpartition(".")[2]
    if "topology" in metafunc.fixturenames and module in CLUSTER_SUITES:
        metafunc.parametrize("topology", ["single", "cluster"], indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what needs the Redis Cluster ``cluster`` and what runs on a driver
    of FULL_RUN_DRIVERS ``full_driver``, so that ``make test-fast`` can leave
    them out; ``process`` and ``slow`` are set in the test modules. Leave out
    the process tests of the drivers not in PROCESS_DRIVERS."""
    skipped = [
        item
        for item in items
        if item.get_closest_marker("process") is not None
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("driver", "lua") not in PROCESS_DRIVERS  # type: ignore[attr-defined]
    ]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        left_out = set(skipped)
        items[:] = [item for item in items if item not in left_out]
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_cluster = callspec is not None and callspec.params.get("topology") == "cluster"
        if on_cluster or "redis_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
        if callspec is not None and callspec.params.get("driver") in FULL_RUN_DRIVERS:
            item.add_marker(pytest.mark.full_driver)


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> str:
    """'single' (one redis-server) or 'cluster' (see CLUSTER_SUITES)."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def redis_url(topology: str, request: pytest.FixtureRequest) -> str:
    if topology == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    return str(request.getfixturevalue("redis_server").url)


def direct_client(redis_url: str) -> Redis | RedisCluster:
    """A client for looking at Redis directly in tests, whatever the topology."""
    if redis_url.startswith("redis+cluster://"):
        return RedisCluster.from_url(redis_url.replace("+cluster", "", 1))
    return Redis.from_url(redis_url)


#: the layout of every test's settings unless it names one (--storage-layout)
STORAGE_LAYOUT = [DEFAULT_STORAGE_LAYOUT]


def make_settings(redis_url: str, **changes: object) -> Settings:
    """Settings for tests: ttl down to 1 s so expiry can be seen quickly; no
    segment sweep loop (tests share a Redis and its fs:sweep, each on a clock
    of its own: a loop on a clock ahead would review another test's queue
    early). The tests of the loop turn it on (``sweep_interval``)."""
    base = Settings(
        redis_url=redis_url,
        min_message_ttl=1,
        log_level="DEBUG",
        storage_layout=STORAGE_LAYOUT[0],
        sweep_interval=0,
    )
    return base.replace(**changes)


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--storage-layout",
        choices=STORAGE_LAYOUTS,
        default=DEFAULT_STORAGE_LAYOUT,
        help="the layout the stores and apps of the tests write new messages in "
        f"(default: the service's, {DEFAULT_STORAGE_LAYOUT})",
    )


#: the drivers that write the segment layout
SEGMENT_DRIVERS = ["lua", "watch", "watch-naive"]


def both_layouts(request: pytest.FixtureRequest, driver: str) -> str:
    """A suite's ``storage_layout`` fixture parametrised over both layouts
    (``@pytest.fixture(params=STORAGE_LAYOUTS)``, returning this): the
    segment layout on the drivers that write it."""
    layout = str(request.param)
    if layout == "segments" and driver not in SEGMENT_DRIVERS:
        pytest.skip(f"the {driver} driver does not write segments yet")
    return layout


@pytest.fixture
def storage_layout(request: pytest.FixtureRequest) -> str:
    """The layout new messages are written in (--storage-layout, or a
    test's indirect parameter): both stay tested."""
    return str(getattr(request, "param", request.config.getoption("--storage-layout")))


@pytest.fixture
def settings(redis_url: str, driver: str, storage_layout: str) -> Settings:
    return make_settings(redis_url, driver=driver, storage_layout=storage_layout)


@pytest.fixture
def clock() -> ManualClock:
    """The time the ``store`` and ``http`` under test see: it stands still
    until a test calls ``clock.advance(seconds)``, so tests of ttl, delay,
    claim expiry and the idempotency window move time on instead of sleeping.
    (A few ``slow`` tests keep real sleeps, end to end.)"""
    return ManualClock()


@contextlib.asynccontextmanager
async def opened_store(settings: Settings, clock: Clock) -> AsyncIterator[FeedStore]:
    """A store of these settings, open for the block and closed after it."""
    feed = make_store(settings, clock)
    await feed.open()
    try:
        yield feed
    finally:
        await feed.close()


@pytest.fixture
async def store(settings: Settings, clock: ManualClock) -> AsyncIterator[FeedStore]:
    async with opened_store(settings, clock) as feed:
        yield feed


@pytest.fixture
def project() -> str:
    return "test-" + uuid.uuid4().hex


@pytest.fixture
def client_id() -> str:
    return str(uuid.uuid4())


@pytest.fixture
def headers(project: str, client_id: str) -> dict[str, str]:
    return {"Client-ID": client_id, "X-Project-ID": project}


@pytest.fixture
async def http(
    settings: Settings, clock: ManualClock
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


REPO_ROOT = Path(__file__).resolve().parent.parent


def build_wheel(source: Path, dest: Path) -> Path:
    """Build feedsvc's wheel from a source tree into dest."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dest), str(source)],
        check=True,
        timeout=120,
    )  # fmt: skip
    [wheel] = list(dest.glob("feedsvc-*.whl"))
    return wheel
