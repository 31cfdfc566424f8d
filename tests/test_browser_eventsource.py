"""A browser's own ``EventSource`` follows a queue from a page of another
origin (issue 31, point 6), in Debian's headless Chromium (the harness of
tests/test_console.py): the page is served by a tiny ``http.server`` on
another port, feedsvc runs with ``--cors-origin`` naming that page's
origin, and the page opens ``new EventSource(url)`` with the credential in
the URL (a pre-signed URL's parts, or ``access_token``), no header of its
own. The test posts over HTTP and the page receives it; the same page
served from an origin that is not listed cannot read the stream. The rules
one by one, without a browser: tests/test_query_credentials.py.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.remote.webdriver import WebDriver

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess
from tests import test_console
from tests.test_console import call, client_headers, post, screenshot, wait_for

pytestmark = pytest.mark.process  # feedsvc serve, chromedriver, chromium

# the console tests' fixtures: Chromium through chromedriver, failing
# (not skipping) when either is missing
browser = test_console.browser
browser_installed = test_console.browser_installed

#: The page: opens an EventSource on the URL in its own query (?url=...),
#: and keeps what it gets in window.follower for the test to read.
PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>follower</title></head>
<body><h1>follower</h1><p id="state">starting</p><ol id="events"></ol>
<script>
  const url = new URLSearchParams(location.search).get("url");
  const follower = (window.follower = { opened: 0, errors: 0, events: [] });
  const source = (window.source = new EventSource(url));
  const state = document.getElementById("state");
  source.onopen = () => { follower.opened += 1; state.textContent = "open"; };
  source.onerror = () => { follower.errors += 1; state.textContent = "error"; };
  source.onmessage = (event) => {
    follower.events.push({ id: event.lastEventId, data: JSON.parse(event.data) });
    const item = document.createElement("li");
    item.textContent = event.data;
    document.getElementById("events").append(item);
  };
</script></body></html>
"""


class _PageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows what fails


@contextlib.contextmanager
def page_server() -> Iterator[str]:
    """The page's origin: http://127.0.0.1:<a free port>, served from a thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def listed() -> Iterator[str]:
    with page_server() as origin:
        yield origin


@pytest.fixture
def unlisted() -> Iterator[str]:
    with page_server() as origin:
        yield origin


TOKEN = "reader-" + uuid.uuid4().hex
ADMIN = "writer-" + uuid.uuid4().hex


@pytest.fixture
def project() -> str:
    return "es-" + uuid.uuid4().hex[:12]


@pytest.fixture
def service(
    redis_server: RedisServer, listed: str, project: str, tmp_path: Path
) -> Iterator[ServiceProcess]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} {project} read:feed-*\n{ADMIN} {project} *:*\n")
    with ServiceProcess(
        "--redis-url", redis_server.url,
        "--cors-origin", listed,
        "--auth-token-file", str(tokens),
        env={"FEEDSVC_SIGNED_URL_KEY": "browser-test-" + uuid.uuid4().hex},
    ) as svc:  # fmt: skip
        yield svc


def writer() -> dict[str, str]:
    return {**client_headers("ignored"), "Authorization": f"Bearer {ADMIN}"}


def signed_url(service: ServiceProcess, queue: str) -> str:
    """The queue's message stream, pre-signed for GET, its parts in the query."""
    status, doc, _ = call("POST", f"{service.url}/v2/queues/{queue}/share", writer(), {})
    assert status == 200, doc
    query = urllib.parse.urlencode(
        {
            "URL-Signature": doc["signature"],
            "URL-Expires": doc["expires"],
            "URL-Methods": ",".join(doc["methods"]),
            "URL-Paths": ",".join(doc["paths"]),
            "X-Project-ID": doc["project"],
        }
    )
    return f"{service.url}/v2/queues/{queue}/messages?{query}"


def open_follower(driver: WebDriver, origin: str, url: str) -> None:
    driver.get(f"{origin}/follow?{urllib.parse.urlencode({'url': url})}")


def follower(driver: WebDriver) -> dict[str, Any]:
    state: dict[str, Any] = driver.execute_script(
        "return Object.assign({readyState: window.source.readyState}, window.follower)"
    )
    return state


def received(driver: WebDriver) -> list[Any]:
    return [event["data"]["body"] for event in follower(driver)["events"]]


@pytest.mark.parametrize("credential", ["signed", "access_token"])
def test_an_event_source_on_a_listed_origin_follows_a_queue(
    service: ServiceProcess,
    browser: webdriver.Chrome,
    listed: str,
    credential: str,
    tmp_path: Path,
) -> None:
    queue = "feed-" + uuid.uuid4().hex[:8]
    post(service.url, writer(), queue, {"n": 0})  # before the page: not shown (from=tail)
    if credential == "signed":
        url = signed_url(service, queue) + "&from=tail"
    else:
        url = f"{service.url}/v2/queues/{queue}/messages?from=tail&access_token={TOKEN}"
    open_follower(browser, listed, url)
    wait_for(browser, lambda d: follower(d)["opened"] >= 1)
    post(service.url, writer(), queue, {"n": 1}, {"n": 2})
    wait_for(browser, lambda d: len(received(d)) >= 2)
    assert received(browser) == [{"n": 1}, {"n": 2}]
    assert follower(browser)["readyState"] == 1  # OPEN: still following
    screenshot(browser, tmp_path / f"eventsource-{credential}.png")


def test_a_page_of_an_origin_not_listed_cannot_read_the_stream(
    service: ServiceProcess, browser: webdriver.Chrome, listed: str, unlisted: str
) -> None:
    queue = "feed-" + uuid.uuid4().hex[:8]
    url = signed_url(service, queue)
    # the same page from an origin --cors-origin does not name: refused, and
    # EventSource gives up on a CORS failure (readyState CLOSED, no retries)
    open_follower(browser, unlisted, url)
    wait_for(browser, lambda d: follower(d)["readyState"] == 2)
    assert follower(browser)["opened"] == 0 and follower(browser)["errors"] >= 1
    outsider = browser.current_window_handle
    # the listed page in another tab, as the control: it gets the post
    browser.switch_to.new_window("tab")
    open_follower(browser, listed, url)
    wait_for(browser, lambda d: follower(d)["opened"] >= 1)
    post(service.url, writer(), queue, {"n": "seen by the listed page only"})
    wait_for(browser, lambda d: received(d) == [{"n": "seen by the listed page only"}])
    browser.switch_to.window(outsider)
    state = follower(browser)
    assert state["events"] == [] and state["opened"] == 0 and state["readyState"] == 2
    # and feedsvc sent that origin no CORS header to read it by
    _, _, headers = call("GET", url, {"Origin": unlisted})
    assert "Access-Control-Allow-Origin" not in headers
