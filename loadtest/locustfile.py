"""Zaqar-bench-like load for feedsvc: producers, observers and consumers.

Run it from the repository root, with the web UI::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8888

or headless (``--headless -u 100 -r 100 -t 30s``); ``python -m loadtest
compare`` drives it against each driver. Options (see options.py and
loadtest/README.md; each also reads a ``LOCUST_*`` variable, and
the web UI shows them under "Custom parameters"):

* ``Producer`` posts 1..``--batch`` messages per request to one of
  ``--queues`` queues picked at random, or always to the first one with
  ``--hot`` (the contention case). Each body carries a stamp (producer, seq,
  start time, see checker.py) padded to ``--message-size`` bytes. With
  ``--groups N`` each request's messages go to one of this process's N
  groups of the queue, posted one request at a time per group, and the stamp
  also carries the group and the message's place in it (its group seq).
* ``Observer`` reads every queue from its head with its own marker
  (``--page-size`` per page, ``echo=true&include_claimed=true``), follows
  ``next`` links and polls every ``--poll-interval`` s at the end. Each
  message goes through the no-miss checker; a gap, duplicate or reorder is
  a Locust failure named ``no-miss: gap`` / ``duplicate`` / ``reorder``.
* ``Consumer`` claims up to ``--claim-limit`` messages and, in the order
  given, releases each with probability ``--release-ratio`` (``POST
  .../release`` with ``--release-delay``; the service also releases the
  claim's later messages of its group, which the consumer then leaves
  alone) or deletes it through its href (which carries the claim id); then
  it releases the claim.
* ``LongPoller`` follows one queue from its head with long polls
  (``wait=--long-poll-wait``), following ``next`` links; ``Streamer`` follows
  one with a Server-Sent Events stream, reconnecting with ``Last-Event-ID``
  whenever the stream ends. Follower ``i`` of a class takes queue ``i mod
  --queues``. Like observers, both check every message; all three record
  each message's post-to-delivery latency (the producer stamps the time it
  sent the POST) as ``deliver poll``, ``deliver long-poll``, ``deliver sse``
  in the timings. When the test stops, every reader is also asked for
  messages of this process's producers that it must have seen by then and
  did not (checker.py, ``missed``): ``no-miss: lost``.

Consumers and the checker: a deleted message legitimately disappears. A
consumer notes each message in this process's ``CONSUMED`` set *before* it
sends the DELETE, and the checker excuses a gap only if every skipped
message is in that set, so with a single Locust process (the default) the
check stays exact with consumers running. With ``--processes``/workers a
consumer's deletions are not visible to observers in other processes, so
gaps are then not judged at all while Consumer runs (duplicates and reorders
still are); the checked comparison runs use no consumers.

With groups or releases on, Consumer running and one Locust process, the
consumption checker (consumption.py) is fed every post, claim, delete and
release; at the stop, consumers finish the claim in hand, drain.py
consumes what is left, and each finding
(unacknowledged, ack order, handed early, group shared) is a Locust
failure named ``consumers: ...``.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import gevent
from gevent.lock import Semaphore
from locust import FastHttpUser, events, task
from locust.env import Environment
from locust.event import EventHook
from locust.runners import MasterRunner, WorkerRunner

try:
    from loadtest.checker import FeedChecker, Finding, Stamp, read_stamp
    from loadtest.consumption import ConsumptionChecker, ConsumptionFinding
    from loadtest.drain import CLAIM_TTL, drain
    from loadtest.eventstream import ChunkedDecoder, EventStreamParser, FramingError
    from loadtest.keepalive import keep_alive_past_fd_1023
    from loadtest.options import Options, add_options
    from loadtest.timings import Recorder
except ImportError:  # `locust -f .../loadtest/locustfile.py` from another directory
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from loadtest.checker import FeedChecker, Finding, Stamp, read_stamp
    from loadtest.consumption import ConsumptionChecker, ConsumptionFinding
    from loadtest.drain import CLAIM_TTL, drain
    from loadtest.eventstream import ChunkedDecoder, EventStreamParser, FramingError
    from loadtest.keepalive import keep_alive_past_fd_1023
    from loadtest.options import Options, add_options
    from loadtest.timings import Recorder

log = logging.getLogger("loadtest")

F = TypeVar("F", bound=Callable[..., Any])


def listen(hook: EventHook) -> Callable[[F], F]:
    """``@hook.add_listener`` with a type (Locust's add_listener has none)."""

    def register(handler: F) -> F:
        hook.add_listener(handler)  # type: ignore[no-untyped-call]
        return handler

    return register


keep_alive_past_fd_1023()


# -- options -----------------------------------------------------------------


listen(events.init_command_line_parser)(add_options)


def apply_weights(environment: Environment) -> None:
    o = environment.parsed_options
    if o is None:
        return
    Producer.weight = o.producer_weight
    Observer.weight = o.observer_weight
    Consumer.weight = o.consumer_weight
    LongPoller.weight = o.long_poller_weight
    Streamer.weight = o.streamer_weight
    Observer.fixed_count = max(0, o.observers)
    LongPoller.fixed_count = max(0, o.long_pollers)
    Streamer.fixed_count = max(0, o.streamers)


# -- process-wide state --------------------------------------------------------

RECORDER = Recorder()
#: (queue, producer, seq) of every message a consumer in this process deleted
#: or is about to delete, or released with a delay (lists hide a message until
#: it is due); the checker excuses gaps made of these only.
CONSUMED: set[tuple[str, str, int]] = set()
CHECKERS: list[FeedChecker] = []
ACKED = {"messages": 0}
#: queue -> stream -> last acknowledged seq, for the runner's final audit.
ACKED_STREAMS: dict[str, dict[str, int]] = {}
#: queue -> stream -> [(time the 201 arrived, last seq acknowledged)], in order:
#: what each reader must have seen by the end (FeedChecker.missed).
ACK_LOG: dict[str, dict[str, list[tuple[float, int]]]] = {}
JUDGE_GAPS = {"exact": True}
#: the consumption checker of this run ("checker"), when it is judged: groups
#: or releases are on, consumers run, and all in this one process
CONSUMPTION: dict[str, ConsumptionChecker] = {}
#: claims being handled now (a stopped consumer's may still be: see Consumer)
HANDLING = {"claims": 0}
#: how long the stop waits for them, seconds
HANDLING_WAIT = 20.0
#: queue -> group -> [the next group seq, the lock a producer posts under]
GROUPS: dict[str, dict[str, tuple[list[int], Semaphore]]] = {}
#: names this process's groups apart from other processes' (each has its own)
PROCESS = uuid.uuid4().hex[:6]
#: consumption findings reported one by one (all are counted in the totals)
REPORTED = 20
#: this run's id, stamped on every message posted and the only one judged:
#: made by the master (or the one process) at each test start and handed to
#: the workers with the spawn message, as Locust does for custom options
RUN = {"id": ""}
#: followers started so far per class, to spread them over the queues
FOLLOWER_NUMBERS: dict[str, itertools.count[int]] = {}


def was_consumed(queue: str, producer: str, seq: int) -> bool:
    return (queue, producer, seq) in CONSUMED or not JUDGE_GAPS["exact"]


def describe(response: Any) -> str:
    """A failed response in one line: status and body, or the connection error."""
    if response.status_code == 0:  # no HTTP answer: timeout, reset, refused
        return f"no response: {getattr(response, 'error', None)!r}"
    return f"{response.status_code}: {(response.text or '')[:200]}"


class CheckFailed(Exception):
    """A no-miss checker finding, reported as a Locust failure."""


def report(environment: Environment, finding: Finding | ConsumptionFinding) -> None:
    what = "no-miss" if isinstance(finding, Finding) else "consumers"
    log.error("%s checker: %s", what, finding)
    environment.events.request.fire(  # type: ignore[no-untyped-call]
        request_type="CHECK",
        name=f"{what}: {finding.kind}",
        response_time=0,
        response_length=0,
        exception=CheckFailed(str(finding)),
        context={},
    )


def deliver(environment: Environment, checker: FeedChecker, message: Any, mode: str) -> None:
    """A reader got a message: check it, and record its post-to-delivery latency."""
    stamp = read_stamp(message["body"])
    if stamp is None:
        return
    now = time.time()
    finding = checker.see(stamp, message["ttl"], now)
    if finding is not None:
        report(environment, finding)
    if stamp.posted is not None:
        RECORDER.record(f"deliver {mode}", now, (now - stamp.posted) * 1000, True)


@listen(events.init)
def on_init(environment: Environment, **_: Any) -> None:
    apply_weights(environment)
    distributed = isinstance(environment.runner, MasterRunner | WorkerRunner)
    if distributed and Consumer in environment.user_classes:
        JUDGE_GAPS["exact"] = False
        log.warning(
            "Consumer runs in several processes: observers cannot know what other "
            "processes deleted, so gaps are not judged (duplicates and reorders are)"
        )
    o = environment.parsed_options
    if distributed and o is not None and (o.groups > 0 or o.release_ratio > 0):
        log.warning("several processes: at-least-once and group order are not judged")


def judges_consumption(environment: Environment) -> bool:
    o = environment.parsed_options
    return (
        o is not None
        and (o.groups > 0 or o.release_ratio > 0)
        and Consumer in environment.user_classes
        and not isinstance(environment.runner, MasterRunner | WorkerRunner)
    )


@listen(events.test_start)
def on_test_start(environment: Environment, **_: Any) -> None:
    apply_weights(environment)  # the web UI may have changed them
    options = environment.parsed_options
    if isinstance(environment.runner, WorkerRunner) and options is not None:
        RUN["id"] = getattr(options, "feed_run_id", "") or RUN["id"]
    else:
        RUN["id"] = uuid.uuid4().hex[:12]
        if options is not None:
            options.feed_run_id = RUN["id"]
    log.info("run %s: only its own messages are judged", RUN["id"])
    RECORDER.samples.clear()
    RECORDER.failures.clear()
    RECORDER.spawned_at = RECORDER.stopping_at = None
    ACKED["messages"] = 0
    ACKED_STREAMS.clear()
    ACK_LOG.clear()
    CHECKERS.clear()
    CONSUMED.clear()
    FOLLOWER_NUMBERS.clear()
    GROUPS.clear()
    CONSUMPTION.clear()
    if judges_consumption(environment):
        CONSUMPTION["checker"] = ConsumptionChecker()


@listen(events.spawning_complete)
def on_spawning_complete(user_count: int, **_: Any) -> None:
    RECORDER.spawned_at = time.time()


@listen(events.request)
def on_request(
    request_type: str,
    name: str,
    response_time: float,
    exception: BaseException | None,
    start_time: float | None = None,
    **_: Any,
) -> None:
    if exception is not None:
        RECORDER.fail(name)
    if request_type == "CHECK":
        return
    end = (start_time or time.time()) + response_time / 1000
    RECORDER.record(name, end, response_time, exception is None)


@listen(events.test_stopping)
def on_test_stopping(environment: Environment, **_: Any) -> None:
    RECORDER.stopping_at = time.time()


@listen(events.test_stop)
def on_test_stop(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, MasterRunner):
        return
    missed = 0
    for checker in CHECKERS:
        for finding in checker.missed(ACK_LOG.get(checker.queue, {})):
            missed += 1
            report(environment, finding)
    consumption = CONSUMPTION.get("checker")
    drained: dict[str, Any] = {}
    if consumption is not None:
        o = Options.of(environment)
        deadline = time.time() + HANDLING_WAIT
        while HANDLING["claims"] and time.time() < deadline:
            gevent.sleep(0.05)
        drained = drain(environment.host or "", o.project, o.queues, consumption, o.release_delay)
        found = consumption.finish()
        for problem in found[:REPORTED]:
            report(environment, problem)
        if len(found) > REPORTED:
            log.error("consumers checker: %d more findings not reported", len(found) - REPORTED)
    totals: dict[str, Any] = {
        "acknowledged": ACKED["messages"],
        "checked": sum(c.checked for c in CHECKERS),
        "other_runs": sum(c.other_runs for c in CHECKERS),
        "readers": len(CHECKERS),
        "missed_at_stop": missed,
        "findings": sum(c.findings for c in CHECKERS)
        + (consumption.findings if consumption else 0),
        "excused_expired": sum(c.excused_expired for c in CHECKERS),
        "excused_consumed": sum(c.excused_consumed for c in CHECKERS),
        "gaps_judged": JUDGE_GAPS["exact"],
    }
    if consumption is not None:
        totals["consumption"] = {
            "acknowledged": consumption.acknowledged,
            "deletes": consumption.deletes,
            "releases": consumption.releases,
            "redelivered": consumption.redelivered,
            "excused_unanswered": consumption.excused_unanswered,
            "findings": consumption.findings,
            "by_kind": consumption.by_kind,
            **drained,
        }
    log.info("checker: %s", totals)
    directory = environment.parsed_options.timings_dir if environment.parsed_options else ""
    if directory:
        RECORDER.dump(Path(directory), {"checker": totals, "acknowledged": ACKED_STREAMS})


# -- users ---------------------------------------------------------------------


class FeedUser(FastHttpUser):
    abstract = True
    # feedsvc answers within pool + Redis timeouts (a few seconds) or with a
    # 503; a request still open after this long is a failure, not a wait.
    network_timeout = 15.0
    connection_timeout = 15.0

    def on_start(self) -> None:
        self.options = Options.of(self.environment)
        self.headers = {
            "Client-ID": str(uuid.uuid4()),
            "X-Project-ID": self.options.project,
            "Content-Type": "application/json",
        }


@dataclass
class _Stream:
    producer: str
    started: float
    next_seq: int = 1


class Producer(FeedUser):
    weight = 4

    def on_start(self) -> None:
        super().on_start()
        self.identity = uuid.uuid4().hex[:12]
        self.generation = 0
        self.streams: dict[str, _Stream] = {}

    def wait_time(self) -> float:
        return self.options.producer_wait

    def _stream(self, queue: str) -> _Stream:
        stream = self.streams.get(queue)
        if stream is None:
            self.generation += 1
            stream = _Stream(f"{self.identity}.{self.generation}", time.time())
            self.streams[queue] = stream
        return stream

    @task
    def post_messages(self) -> None:
        o = self.options
        queue = o.queues[0] if o.hot else random.choice(o.queues)
        if not o.groups:
            self.post(queue, "", [0])
            return
        # one request at a time per group: group seqs are then in post order
        group = f"{RUN['id']}.{PROCESS}.{random.randrange(o.groups)}"
        next_seq, lock = GROUPS.setdefault(queue, {}).setdefault(group, ([1], Semaphore()))
        with lock:
            self.post(queue, group, next_seq)

    def post(self, queue: str, group: str, next_seq: list[int]) -> None:
        """Post 1..--batch messages of ``group`` (numbered from ``next_seq``)."""
        o = self.options
        stream = self._stream(queue)
        count = random.randint(1, o.batch)
        first, group_first = stream.next_seq, next_seq[0]
        posted = time.time()
        stamps = [
            Stamp(stream.producer, first + i, stream.started, posted, RUN["id"], group,
                  group_first + i if group else 0)
            for i in range(count)
        ]  # fmt: skip
        messages = [{"ttl": o.ttl, "body": stamp.body(o.pad)} for stamp in stamps]
        if group:
            next_seq[0] += count
            for message in messages:
                message["group"] = group
        if (consumption := CONSUMPTION.get("checker")) is not None:
            for stamp in stamps:
                consumption.posting(queue, stamp)
        with self.client.post(
            f"/v2/queues/{queue}/messages",
            data=json.dumps({"messages": messages}),
            headers=self.headers,
            name="POST messages",
            catch_response=True,
        ) as response:
            if consumption is not None:
                for stamp in stamps:
                    consumption.posted(queue, stamp, response.status_code == 201)
            if response.status_code == 201:
                stream.next_seq += count
                ACKED["messages"] += count
                ACKED_STREAMS.setdefault(queue, {})[stream.producer] = stream.next_seq - 1
                acks = ACK_LOG.setdefault(queue, {}).setdefault(stream.producer, [])
                acks.append((time.time(), stream.next_seq - 1))
                response.success()
            else:
                # Unknown outcome: later messages go to a new stream, so the
                # checker never expects these to be there (or not).
                del self.streams[queue]
                response.failure(describe(response))


class Observer(FeedUser):
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        o = self.options
        first = f"?limit={o.page_size}&echo=true&include_claimed=true"
        self.cursors = {q: f"/v2/queues/{q}/messages{first}" for q in o.queues}
        self.checkers = {q: FeedChecker(q, was_consumed, RUN["id"]) for q in o.queues}
        CHECKERS.extend(self.checkers.values())
        self.order = cycle(o.queues)
        self.idle = False

    def wait_time(self) -> float:
        # Follow next links at once; poll again only when a queue is drained.
        return self.options.poll_interval / len(self.options.queues) if self.idle else 0.0

    @task
    def read_messages(self) -> None:
        queue = next(self.order)
        with self.client.get(
            self.cursors[queue], headers=self.headers, name="GET messages", catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(describe(response))
                return
            payload = json.loads(response.content or b"null")
        checker = self.checkers[queue]
        for message in payload["messages"]:
            deliver(self.environment, checker, message, "poll")
        following = [link["href"] for link in payload["links"] if link["rel"] == "next"]
        if following:
            self.cursors[queue] = following[0]
        self.idle = not payload["messages"]


class Consumer(FeedUser):
    weight = 1

    def wait_time(self) -> float:
        return self.options.poll_interval if self.idle else 0.0

    def on_start(self) -> None:
        super().on_start()
        self.claim_body = json.dumps({"ttl": CLAIM_TTL, "grace": 60})
        self.release_body = json.dumps({"delay": self.options.release_delay})
        self.idle = False

    @task
    def claim_messages(self) -> None:
        # Locust may kill a stopping user mid-request (even with --stop-timeout),
        # and a claim cut off there holds messages unknown to anyone until it
        # expires: a claim is handled in a greenlet that outlives the user.
        gevent.spawn(self.claim_and_handle).get()

    def claim_and_handle(self) -> None:
        HANDLING["claims"] += 1
        try:
            self.handle_a_claim()
        finally:
            HANDLING["claims"] -= 1

    def handle_a_claim(self) -> None:
        o = self.options
        queue = o.queues[0] if o.hot else random.choice(o.queues)
        sent = time.time()
        if (checker := CONSUMPTION.get("checker")) is not None:
            checker.claim_requested()
        with self.client.post(
            f"/v2/queues/{queue}/claims?limit={o.claim_limit}",
            data=self.claim_body,
            headers=self.headers,
            name="POST claims",
            catch_response=True,
        ) as response:
            if checker is not None:
                checker.claim_answered(response.status_code)
            self.idle = response.status_code == 204
            if self.idle:
                response.success()
                return
            if response.status_code != 201:
                response.failure(describe(response))
                return
            claim = (response.headers.get("Location") if response.headers else None) or ""
            messages = json.loads(response.content or b"null")["messages"]
        stamps = [read_stamp(message["body"]) for message in messages]
        checker = checker if claim else None
        ours = [s if s is not None and s.run == RUN["id"] else None for s in stamps]
        if checker is not None:
            checker.claimed(queue, claim, [s for s in ours if s], sent, time.time(), CLAIM_TTL)
        # releasing a message also releases the claim's later messages of its group
        released: dict[str, tuple[float, int]] = {}  # group -> (release sent, status)
        probed: set[str] = set()
        for index, (message, stamp, mine) in enumerate(zip(messages, stamps, ours, strict=True)):
            group = message.get("group") or ""
            if group in released:  # the release of an earlier one took it along
                sent, status = released[group]
                if checker is not None and mine is not None:
                    checker.released(queue, claim, mine, sent, status)
                if o.release_delay and status == 204 and group not in probed:
                    probed.add(group)
                    self.probe_released(queue, claim, message, mine, sent + o.release_delay)
            elif random.random() < o.release_ratio:
                if o.release_delay:  # hidden from lists until due, with the group's later ones
                    later = zip(messages[index:], stamps[index:], strict=True)
                    CONSUMED.update(
                        (queue, s.producer, s.seq)
                        for m, s in later
                        if s is not None and (m is message or (group and m.get("group") == group))
                    )
                outcome = self.release(message["href"])
                if group:  # an ungrouped release releases that message only
                    released[group] = outcome
                if checker is not None and mine is not None:
                    checker.released(queue, claim, mine, *outcome)
            else:
                if stamp is not None:
                    CONSUMED.add((queue, stamp.producer, stamp.seq))
                started = time.time()
                deleted = self.client.delete(
                    message["href"], headers=self.headers, name="DELETE message"
                )
                if checker is not None and mine is not None:
                    checker.deleted(queue, claim, mine, started, time.time(), deleted.status_code)
        if claim:
            started = time.time()
            answer = self.client.delete(claim, headers=self.headers, name="DELETE claim")
            if checker is not None:
                checker.claim_released(claim, started, answer.status_code)

    def probe_released(
        self, queue: str, claim: str, message: Any, stamp: Stamp | None, due: float
    ) -> None:
        """A release must take the claim's next message of the group along: a
        delete of it with the claim is refused (400). A 204 before the release
        is due (``due``; no other claim can take it sooner) is a failure (and
        an ack order finding); a later one may be another claim's delete."""
        started = time.time()
        with self.client.delete(
            message["href"],
            headers=self.headers,
            name="DELETE released message",
            catch_response=True,
        ) as response:
            if response.status_code == 400 or (response.status_code == 204 and time.time() >= due):
                response.success()
            else:
                what = "a release left the group's next message in the claim"
                response.failure(f"{what}: {describe(response)}")
        checker = CONSUMPTION.get("checker")
        if checker is not None and stamp is not None:
            checker.deleted(queue, claim, stamp, started, time.time(), response.status_code)

    def release(self, href: str) -> tuple[float, int]:
        """POST .../messages/{id}/release?claim_id=...: (time sent, status)."""
        path, _, query = href.partition("?")
        started = time.time()
        response = self.client.post(
            f"{path}/release?{query}",
            data=self.release_body,
            headers=self.headers,
            name="POST release",
        )
        return started, response.status_code


def follower_queue(environment: Environment, kind: str) -> str:
    """The queue the next follower of a class follows: 0, 1, ... mod --queues."""
    o = Options.of(environment)
    number = next(FOLLOWER_NUMBERS.setdefault(kind, itertools.count()))
    return o.queues[number % len(o.queues)]


class LongPoller(FeedUser):
    """Follows one queue with long polls, following next links."""

    weight = 1
    network_timeout = 40.0  # a poll is held up to 20 s

    def wait_time(self) -> float:
        return 0.0

    def on_start(self) -> None:
        super().on_start()
        self.queue = follower_queue(self.environment, "LongPoller")
        self.checker = FeedChecker(self.queue, was_consumed, RUN["id"])
        CHECKERS.append(self.checker)
        self.cursor = f"/v2/queues/{self.queue}/messages?" + urlencode(
            {"limit": self.options.page_size, "echo": "true", "include_claimed": "true"}
        )

    @task
    def poll_messages(self) -> None:
        wait = urlencode({"wait": f"{self.options.long_poll_wait:g}"})
        with self.client.get(
            f"{self.cursor}&{wait}",
            headers=self.headers,
            name="GET messages wait",
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(describe(response))
                time.sleep(1.0)  # a 503 (too many followers, Redis): back off
                return
            payload = json.loads(response.content or b"null")
        for message in payload["messages"]:
            deliver(self.environment, self.checker, message, "long-poll")
        following = [link["href"] for link in payload["links"] if link["rel"] == "next"]
        if following:
            self.cursor = following[0]


class Streamer(FeedUser):
    """Follows one queue over Server-Sent Events on a socket of its own,
    reconnecting with Last-Event-ID whenever the stream ends."""

    weight = 1
    # seconds without a byte (heartbeats included) before the stream counts as dead
    silence = 45.0

    def wait_time(self) -> float:
        return self.pause

    def on_start(self) -> None:
        super().on_start()
        self.queue = follower_queue(self.environment, "Streamer")
        self.checker = FeedChecker(self.queue, was_consumed, RUN["id"])
        CHECKERS.append(self.checker)
        self.last_id: str | None = None
        self.pause = 0.0
        where = urlsplit(self.host or "")
        self.address: tuple[str, int] = (where.hostname or "127.0.0.1", where.port or 80)

    def request_bytes(self) -> bytes:
        query = urlencode({"echo": "true", "include_claimed": "true"})
        lines = [
            f"GET /v2/queues/{self.queue}/messages?{query} HTTP/1.1",
            f"Host: {self.address[0]}:{self.address[1]}",
            "Accept: text/event-stream",
            f"Client-ID: {self.headers['Client-ID']}",
            f"X-Project-ID: {self.headers['X-Project-ID']}",
        ]
        if self.last_id is not None:
            lines.append(f"Last-Event-ID: {self.last_id}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def failed(self, started: float, what: str) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name="GET stream",
            response_time=(time.time() - started) * 1000,
            response_length=0,
            exception=ConnectionError(what),
            context={},
        )
        self.pause = 1.0

    @task
    def follow(self) -> None:
        started = time.time()
        try:
            sock = socket.create_connection(self.address, timeout=self.connection_timeout)
        except OSError as exc:
            self.failed(started, f"connect: {exc!r}")
            return
        try:
            sock.settimeout(self.silence)
            sock.sendall(self.request_bytes())
            self.read_stream(sock, started)
        except (OSError, FramingError, ValueError) as exc:
            self.failed(started, f"{type(exc).__name__}: {exc}")
        finally:
            sock.close()

    def read_stream(self, sock: socket.socket, started: float) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the response head")
            head += chunk
        head, _, rest = head.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        fields = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if status != 200:
            raise ConnectionError(f"{status}: {rest[:200]!r}")
        self.environment.events.request.fire(
            request_type="SSE",
            name="GET stream",
            response_time=(time.time() - started) * 1000,
            response_length=len(head),
            exception=None,
            context={},
        )
        chunked = fields.get("transfer-encoding", "").lower() == "chunked"
        decoder = ChunkedDecoder() if chunked else None
        parser = EventStreamParser()
        parser.last_id = self.last_id
        data = rest
        while True:
            body = decoder.feed(data) if decoder is not None else data
            for event in parser.feed(body):
                if event.type == "message":
                    deliver(self.environment, self.checker, json.loads(event.data), "sse")
                    self.last_id = event.id
                elif event.type == "end":  # the queue was deleted
                    self.pause = 1.0
                    return
            if decoder is not None and decoder.done:
                break
            data = sock.recv(65536)
            if not data:
                break
        # the server ended the stream (its lifetime, or this reader was too slow)
        self.pause = (parser.retry_ms or 0) / 1000
