"""The browser console (``GET /console``) in a real browser against a real service.

Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them
with apt when missing), driven by Selenium through /usr/bin/chromedriver and
/usr/bin/chromium named explicitly, so Selenium never looks for or downloads
a browser of its own. Chromium runs headless with a fresh profile and
resolves no host name except this machine's, so a page that reached for a
CDN would fail here as it would offline. Every Chromium and chromedriver
process a test starts is gone when it ends (:func:`browser`).

Each test saves a screenshot of the page into its ``tmp_path`` and prints
the path (``pytest -s`` shows it); docs/console.png is one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from feedsvc.api.console import ASSETS
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process  # feedsvc serve, chromedriver, chromium

# Debian's paths; a machine with them elsewhere names them in these variables
CHROMIUM = Path(os.environ.get("FEEDSVC_TEST_CHROMIUM") or "/usr/bin/chromium")
CHROMEDRIVER = Path(os.environ.get("FEEDSVC_TEST_CHROMEDRIVER") or "/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1600,1000",
    # every host name but this machine's fails to resolve: offline, as far
    # as the page can tell, and no test traffic leaves the machine
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
]
WAIT = 20.0  # seconds a page may take to show what a test waits for
RESUME_WAIT = 40.0  # a reconnect after a restart: the page's back-off grows to 10 s

T = TypeVar("T")


@pytest.fixture(autouse=True)
def browser_installed() -> None:
    """Without the browser or its driver each test fails, on CI and off it,
    saying what to install: a skipped test proves nothing, and 8 quiet skips
    let ``make test`` pass on a machine that never ran the console."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} is missing: apt-get install chromium chromium-driver "
            "(.ci/run does), or deselect tests/test_console.py knowingly",
            pytrace=False,
        )


# -- the service, over HTTP ------------------------------------------------------------


def call(
    method: str, url: str, headers: dict[str, str], body: object = None
) -> tuple[int, Any, dict[str, str]]:
    """(status, decoded JSON or None, headers) of one request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        raw, status, got = error.read(), error.code, dict(error.headers)
    payload = (
        json.loads(raw)
        if raw and got.get("Content-Type", "").startswith("application/json")
        else None
    )
    return status, payload, got


def client_headers(project: str) -> dict[str, str]:
    """A client of the API other than the page (its own Client-ID)."""
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project}


def post(url: str, headers: dict[str, str], queue: str, *bodies: object) -> list[str]:
    """Post bodies to queue; the new messages' ids, in post order."""
    status, payload, _ = call(
        "POST",
        f"{url}/v2/queues/{queue}/messages",
        headers,
        {"messages": [{"body": b} for b in bodies]},
    )
    assert status == 201, payload
    return [href.rsplit("/", 1)[1] for href in payload["resources"]]


def list_all(url: str, headers: dict[str, str], queue: str) -> list[dict[str, Any]]:
    """Every message of queue (echo on), following next links."""
    found: list[dict[str, Any]] = []
    href: str | None = f"/v2/queues/{queue}/messages?echo=true"
    while href:
        status, page, _ = call("GET", url + href, headers)
        assert status == 200, page
        found += page["messages"]
        href = page["links"][0]["href"] if page["messages"] else None
    return found


@pytest.fixture
def service(redis_server: RedisServer) -> Iterator[ServiceProcess]:
    with ServiceProcess("--redis-url", redis_server.url) as svc:
        yield svc


@pytest.fixture
def project() -> str:
    return "console-" + uuid.uuid4().hex[:12]


# -- the browser -------------------------------------------------------------------------


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium through chromedriver; both gone (with every child)
    when the test ends."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(
        executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")
    )
    driver = webdriver.Chrome(service=service, options=options)
    started: list[psutil.Process] = []
    try:
        assert service.process is not None
        root = psutil.Process(service.process.pid)
        started = [root, *root.children(recursive=True)]
        driver.set_window_size(1600, 1000)
        yield driver
    finally:
        with contextlib.suppress(Exception):
            driver.quit()
        # chromedriver stops Chromium on quit; whatever is still there is killed, by pid
        _, alive = psutil.wait_procs(started, timeout=10)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        _, alive = psutil.wait_procs(alive, timeout=5)
        assert not alive, f"browser processes left behind: {alive}"


def wait_for(
    driver: WebDriver, condition: Callable[[WebDriver], T | None], timeout: float = WAIT
) -> T:
    """condition's first truthy answer (polled every 0.1 s), else TimeoutException."""
    found = WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)
    assert found is not None
    return found


def text_of(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def screenshot(driver: WebDriver, path: Path) -> Path:
    assert driver.save_screenshot(str(path)), path
    print(f"console screenshot: {path}")
    return path


def open_console(driver: WebDriver, url: str, project: str, queue: str | None = None) -> None:
    query = f"project={project}" + (f"&queue={queue}" if queue else "")
    driver.get(f"{url}/console?{query}")


def tail_ids(driver: WebDriver) -> list[str]:
    items = driver.find_elements(By.CSS_SELECTOR, "#tail li.message")
    return [str(item.get_attribute("data-id")) for item in items]


def tail_state(driver: WebDriver) -> str | None:
    return driver.find_element(By.ID, "tail-state").get_attribute("data-state")


def severe_log(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """The page's console errors (CSP violations, failed loads, script errors)."""
    entries: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [e for e in entries if e.get("level") == "SEVERE"]


# -- the tests ---------------------------------------------------------------------------


def test_a_missing_browser_fails_the_console_tests_rather_than_skipping_them(
    tmp_path: Path,
) -> None:
    """A skipped test proves nothing: ``make test`` without chromedriver
    reported 8 skips and passed (issue 28). Now each console test errors,
    saying what to install, on CI and off it."""
    missing = tmp_path / "no-chromedriver"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         f"{__file__}::test_console_files_are_served_with_a_same_origin_policy"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "CI": "", "FEEDSVC_TEST_CHROMEDRIVER": str(missing)},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 error" in result.stdout and "skipped" not in result.stdout, result.stdout
    assert f"{missing} is missing" in result.stdout
    assert "apt-get install chromium chromium-driver" in result.stdout


def test_console_files_are_served_with_a_same_origin_policy(service: ServiceProcess) -> None:
    status, _, headers = call("GET", service.url + "/console", {})
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    for name, media_type in ASSETS.items():
        if name != "index.html":
            status, _, headers = call("GET", f"{service.url}/console/{name}", {})
            assert status == 200, name
            assert headers["Content-Type"].startswith(media_type), headers
    status, error, _ = call("GET", service.url + "/console/secrets.txt", {})
    assert status == 404 and error["title"] == "Not found"
    status, error, _ = call("GET", service.url + "/console/../pyproject.toml", {})
    assert status == 404


def test_page_loads_offline_and_lists_queues_with_stats(
    service: ServiceProcess, browser: webdriver.Chrome, project: str, tmp_path: Path
) -> None:
    headers = client_headers(project)
    post(service.url, headers, "orders-eu", {"order": 1}, {"order": 2})
    assert call("PUT", f"{service.url}/v2/queues/audit.log", headers)[0] == 201

    open_console(browser, service.url, project)
    rows = wait_for(
        browser,
        lambda d: (
            found
            if len(found := d.find_elements(By.CSS_SELECTOR, "#queues tbody tr")) == 2
            and all(r.find_element(By.CSS_SELECTOR, ".total").text for r in found)
            else None
        ),
    )
    table = {
        r.get_attribute("data-queue"): [
            r.find_element(By.CSS_SELECTOR, f".{c}").text for c in ("total", "free", "claimed")
        ]
        for r in rows
    }
    assert table == {"audit.log": ["0", "0", "0"], "orders-eu": ["2", "2", "0"]}

    # everything the page loaded came from the service itself
    origin = service.url.rstrip("/")
    loaded = browser.execute_script(
        "return performance.getEntriesByType('navigation')"
        ".concat(performance.getEntriesByType('resource')).map(e => e.name)"
    )
    assert loaded and all(name.startswith(origin + "/") for name in loaded), loaded
    assert {f"{origin}/console/console.js", f"{origin}/console/console.css"} <= set(loaded)
    assert not severe_log(browser)

    # a click chooses the queue: its newest messages, and the deep link follows
    rows[[r.get_attribute("data-queue") for r in rows].index("orders-eu")].click()
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages li.message")) == 2)
    bodies = [
        json.loads(e.text) for e in browser.find_elements(By.CSS_SELECTOR, "#messages li .body")
    ]
    assert bodies == [{"order": 1}, {"order": 2}]
    assert browser.current_url == f"{service.url}/console?project={project}&queue=orders-eu"
    screenshot(browser, tmp_path / "console-queues.png")


def test_newest_messages_are_read_from_the_tail(
    service: ServiceProcess, browser: WebDriver, project: str
) -> None:
    """The console finds the newest messages from the queue's tail (from=tail)
    in a few requests, not by walking the queue from its head (issue 31,
    item 7), and its live tail starts after them."""
    headers = client_headers(project)
    for start in range(0, 600, 200):
        post(service.url, headers, "long", *({"n": n} for n in range(start, start + 200)))
    open_console(browser, service.url, project, "long")
    wait_for(browser, lambda d: text_of(d, "#messages-note") == "the newest 50")
    shown = [
        json.loads(e.text)["n"]
        for e in browser.find_elements(By.CSS_SELECTOR, "#messages li .body")
    ]
    assert shown == list(range(550, 600))  # the newest 50, oldest first
    asked = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(n => n.includes('/queues/long/messages'))"
    )
    assert any("from=tail" in name for name in asked), asked
    assert len(asked) <= 6, asked  # from=tail, 3 pages of 20 and the empty end; not 30
    wait_for(browser, lambda d: text_of(d, "#tail-state").startswith("live"))
    post(service.url, headers, "long", {"n": 600})
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tail li")) == 1)
    [live] = browser.find_elements(By.CSS_SELECTOR, "#tail li .body")
    assert json.loads(live.text) == {"n": 600}


def test_posting_through_the_form_stores_the_message(
    service: ServiceProcess, browser: WebDriver, project: str, tmp_path: Path
) -> None:
    open_console(browser, service.url, project, "inbox")
    wait_for(browser, lambda d: "no messages" in text_of(d, "#messages-note"))

    body = browser.find_element(By.ID, "post-body")
    body.clear()
    body.send_keys(
        '{"order": 7, "note": "<b>not markup</b>", "big": 123456789012345678901234567890}'
    )
    browser.find_element(By.ID, "post-ttl").send_keys("120")
    browser.find_element(By.ID, "post-submit").click()
    result = wait_for(
        browser,
        lambda d: (
            e
            if (e := d.find_element(By.ID, "post-result")).get_attribute("data-status") == "posted"
            else None
        ),
    )
    stored = list_all(service.url, client_headers(project), "inbox")
    assert [(m["body"], m["ttl"]) for m in stored] == [
        ({"order": 7, "note": "<b>not markup</b>", "big": 123456789012345678901234567890}, 120)
    ]
    assert stored[0]["id"] in result.text
    # shown as stored: text, not markup, and the integer not rounded to a double
    browser.find_element(By.ID, "refresh-messages").click()
    shown = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#messages li .body"))
    assert [e.text for e in shown] == [
        '{"order":7,"note":"<b>not markup</b>","big":123456789012345678901234567890}'
    ]

    # not JSON: said so, nothing sent
    body.clear()
    body.send_keys("{order: 8")
    browser.find_element(By.ID, "post-submit").click()
    wait_for(browser, lambda d: "not JSON" in text_of(d, "#post-result"))
    assert len(list_all(service.url, client_headers(project), "inbox")) == 1
    screenshot(browser, tmp_path / "console-post.png")


def test_auth_token_is_asked_for_and_kept_in_session_storage_only(
    redis_server: RedisServer, browser: WebDriver, tmp_path: Path
) -> None:
    token = "console-" + uuid.uuid4().hex
    project = "tenant-" + uuid.uuid4().hex[:8]
    with ServiceProcess(
        "--redis-url", redis_server.url, "--auth-token", f"{token}={project}"
    ) as svc:
        bearer = {**client_headers("ignored"), "Authorization": f"Bearer {token}"}
        post(svc.url, bearer, "private", {"secret": 1})

        open_console(browser, svc.url, project)  # the page itself needs no token
        wait_for(browser, lambda d: "401" in text_of(d, "#status"))
        assert not browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")

        browser.find_element(By.ID, "token").send_keys(token)
        browser.find_element(By.CSS_SELECTOR, "#target button[type=submit]").click()
        wait_for(
            browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#queues tr[data-queue=private]")
        )
        kept = browser.execute_script(
            "return [Object.keys(localStorage).length, Object.values(sessionStorage)]"
        )
        assert kept[0] == 0 and token in kept[1]
        assert token not in browser.current_url
        screenshot(browser, tmp_path / "console-auth.png")


SSE_STREAM = (
    "\ufeffretry: 2500\r\n: heartbeat\r\n\r\n"
    'id: 17\nevent: message\ndata: {"n": 1}\n\n'
    "data:a\rdata: b\r\r"  # CR line ends; no id: the last one stays
    "id: 18\r\ndata: x\r\ndata:  y\r\n\r\n"  # one space after the colon is dropped
    "id\nevent: end\ndata: {}\n\n"  # an id field with no colon resets the id
    "id: 19\ndata: never dispatched"  # no blank line: cut off, dropped
)
SSE_EVENTS = [
    {"type": "message", "data": '{"n": 1}', "id": "17"},
    {"type": "message", "data": "a\nb", "id": "17"},
    {"type": "message", "data": "x\n y", "id": "18"},
    {"type": "end", "data": "{}", "id": ""},
]


def test_sse_parser_frames_events_whatever_the_chunking(
    service: ServiceProcess, browser: WebDriver
) -> None:
    """The page's own event-stream parser (console.js SseParser), in the
    browser: the stream whole, cut at every position, and char by char."""
    browser.get(service.url + "/console")
    run = """
        const [text, cuts] = arguments;
        const events = [], retries = [], comments = [];
        const parser = new window.feedsvcConsole.SseParser({
            onEvent: (e) => events.push(e),
            onRetry: (ms) => retries.push(ms),
            onComment: (c) => comments.push(c),
        });
        let at = 0;
        for (const cut of cuts.concat([text.length])) {
            parser.feed(text.slice(at, cut));
            at = cut;
        }
        return {events, retries, comments, last: parser.lastEventId};
    """
    splits = [[], *([i] for i in range(1, len(SSE_STREAM))), list(range(1, len(SSE_STREAM)))]
    for cuts in splits:
        got = browser.execute_script(run, SSE_STREAM, cuts)
        assert got == {
            "events": SSE_EVENTS,
            "retries": [2500],
            "comments": [" heartbeat"],
            "last": "",
        }, cuts


def test_live_tail_shows_posts_and_resumes_after_a_restart_without_gap_or_repeat(
    redis_server: RedisServer, browser: WebDriver, project: str, tmp_path: Path
) -> None:
    headers = client_headers(project)
    first = ServiceProcess("--redis-url", redis_server.url, "--shutdown-grace", "1")
    port = first.start().port
    again = ServiceProcess("--redis-url", redis_server.url, "--shutdown-grace", "1", port=port)
    try:
        url = first.url
        posted = post(url, headers, "live", {"n": 0})
        open_console(browser, url, project, "live")
        wait_for(
            browser,
            lambda d: tail_state(d) == "live",
        )
        assert tail_ids(browser) == []  # the list showed n=0; the tail starts after it

        # posted over HTTP, shown live
        posted += post(url, headers, "live", {"n": 1}, {"n": 2}, {"n": 3})
        wait_for(browser, lambda d: len(tail_ids(d)) == 3)
        assert tail_ids(browser) == posted[1:4]

        # the stream is cut: the service dies; meanwhile another one on the
        # same Redis takes posts that the page must fetch from its
        # Last-Event-ID when it is back, then it gets live ones again
        first.kill()
        wait_for(
            browser,
            lambda d: tail_state(d) != "live",
        )
        with ServiceProcess("--redis-url", redis_server.url) as other:
            posted += post(other.url, headers, "live", {"n": 4}, {"n": 5})
        again.start()  # on the same port: the page's URL is unchanged
        wait_for(browser, lambda d: len(tail_ids(d)) == 5, RESUME_WAIT)
        posted += post(url, headers, "live", {"n": 6})
        wait_for(browser, lambda d: len(tail_ids(d)) >= 6)
        assert tail_ids(browser) == posted[1:]  # every message once, in post order
        bodies = [
            json.loads(e.text)["n"]
            for e in browser.find_elements(By.CSS_SELECTOR, "#tail li .body")
        ]
        assert bodies == [1, 2, 3, 4, 5, 6]
        assert int(text_of(browser, "#tail-reconnects")) >= 1
        assert tail_state(browser) == "live"
        screenshot(browser, tmp_path / "console-tail.png")

        # the queue deleted: the stream ends and the page does not reconnect
        assert call("DELETE", f"{url}/v2/queues/live", headers)[0] == 204
        wait_for(
            browser,
            lambda d: tail_state(d) == "ended",
        )
    finally:
        first.close(graceful=False)
        again.close(graceful=False)


def test_live_tail_goes_on_across_the_servers_own_closes(
    redis_server: RedisServer, browser: WebDriver, project: str
) -> None:
    """Streams end after --stream-lifetime (about 1 s here) while posts go on:
    the page reconnects each time with Last-Event-ID and shows every post once."""
    headers = client_headers(project)
    with ServiceProcess(
        "--redis-url", redis_server.url, "--stream-lifetime", "1", "--stream-retry", "100"
    ) as svc:
        open_console(browser, svc.url, project, "churn")
        wait_for(browser, lambda d: tail_state(d) == "live")
        posted: list[str] = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            posted += post(svc.url, headers, "churn", {"n": len(posted)})
            time.sleep(0.1)
        wait_for(browser, lambda d: len(tail_ids(d)) >= len(posted))
        assert tail_ids(browser) == posted
        assert int(text_of(browser, "#tail-reconnects")) >= 2


def test_a_token_from_a_token_file_signs_the_console_in_and_it_follows_from_the_tail(
    redis_server: RedisServer, browser: WebDriver, tmp_path: Path
) -> None:
    """Issue 31, point 8: with --auth-token-file the page shows nothing
    without the token and works with it (its scopes apply), kept in
    sessionStorage only; the live tail starts at the queue's tail, so what
    was posted before the page opened is not in it."""
    token = "console-" + uuid.uuid4().hex
    project = "tenant-" + uuid.uuid4().hex[:8]
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token} {project} read:* post:*\n")
    with ServiceProcess("--redis-url", redis_server.url, "--auth-token-file", str(tokens)) as svc:
        bearer = {**client_headers("ignored"), "Authorization": f"Bearer {token}"}
        older = post(svc.url, bearer, "orders", *({"n": n} for n in range(3)))

        open_console(browser, svc.url, project, "orders")
        wait_for(browser, lambda d: "401" in text_of(d, "#status"))
        assert not browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")
        assert not browser.find_elements(By.CSS_SELECTOR, "#messages li.message")

        browser.find_element(By.ID, "token").send_keys(token)
        browser.find_element(By.CSS_SELECTOR, "#target button[type=submit]").click()
        wait_for(
            browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#queues tr[data-queue=orders]")
        )
        browser.find_element(By.CSS_SELECTOR, "#queues tr[data-queue=orders]").click()
        wait_for(browser, lambda d: tail_state(d) == "live")
        assert tail_ids(browser) == []  # the older messages are not in the tail
        newer = post(svc.url, bearer, "orders", {"n": 3})
        wait_for(browser, lambda d: tail_ids(d) == newer)
        assert not set(older) & set(tail_ids(browser))
        kept = browser.execute_script(
            "return [Object.keys(localStorage).length, Object.values(sessionStorage)]"
        )
        assert kept[0] == 0 and token in kept[1]
        assert token not in browser.current_url
        screenshot(browser, tmp_path / "console-token-file.png")


def gap_items(driver: WebDriver, css: str) -> list[str | None]:
    return [e.get_attribute("data-missed") for e in driver.find_elements(By.CSS_SELECTOR, css)]


def test_the_console_shows_a_gap_the_service_reports(
    service: ServiceProcess, browser: WebDriver, project: str, tmp_path: Path
) -> None:
    """Issue 31, point 8: messages deleted while the tail was paused are
    said as a gap (``event: gap``) just before the next message, and a list
    page's ``X-Gap`` is shown in the newest messages."""
    headers = client_headers(project)
    post(service.url, headers, "gappy", {"n": 0})
    open_console(browser, service.url, project, "gappy")
    wait_for(browser, lambda d: tail_state(d) == "live")
    browser.find_element(By.ID, "tail-toggle").click()  # pause
    wait_for(browser, lambda d: tail_state(d) == "paused")
    gone = post(service.url, headers, "gappy", {"n": 1}, {"n": 2})
    for message_id in gone:
        status, _, _ = call(
            "DELETE", f"{service.url}/v2/queues/gappy/messages/{message_id}", headers
        )
        assert status == 204
    [kept] = post(service.url, headers, "gappy", {"n": 3})
    browser.find_element(By.ID, "tail-toggle").click()  # resume: from where it was
    wait_for(browser, lambda d: tail_ids(d) == [kept])
    items = browser.find_elements(By.CSS_SELECTOR, "#tail li")
    assert [i.get_attribute("class") for i in items] == ["gap", "message"]
    assert items[0].get_attribute("data-missed") == "2"
    assert "2 messages" in items[0].text
    # the list read again passes the same two: its page says X-Gap
    assert gap_items(browser, "#messages li.gap") == []
    browser.find_element(By.ID, "refresh-messages").click()
    wait_for(browser, lambda d: gap_items(d, "#messages li.gap") == ["2"])
    shown = [
        json.loads(e.text)["n"]
        for e in browser.find_elements(By.CSS_SELECTOR, "#messages li .body")
    ]
    assert shown == [0, 3]
    screenshot(browser, tmp_path / "console-gap.png")
