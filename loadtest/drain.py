"""The drain at the end of a run whose consumption is judged (consumption.py).

When Locust stops, producers' last messages were never claimed: at-least-once
can only be judged once they are all consumed. So, once the consumers'
claims in hand are handled (the locustfile waits for them), the Locust
process releases every claim its consumers did not release (their messages
become claimable at once), then
claims and deletes, in order, what is left in each queue, feeding the same
checker, until every acknowledged message of the run has been deleted, or
nothing more can be claimed once the last release's delay has passed (and,
if a claim request went unanswered, its claim has expired), or
``DRAIN_SECONDS`` more ran out. What is still not deleted then is reported
as unacknowledged.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import uuid
from typing import Any, Final
from urllib.parse import urlsplit

from loadtest.checker import read_stamp
from loadtest.consumption import ConsumptionChecker

log = logging.getLogger("loadtest")

#: the longest the drain goes on (beyond the releases' delay), seconds
DRAIN_SECONDS: Final = 30.0
#: how long a claim that found nothing waits before the next, seconds
EMPTY_WAIT: Final = 0.1
CLAIM_LIMIT: Final = 20
CLAIM_TTL: Final = 60


class _Client:
    """One blocking HTTP connection with the run's headers."""

    def __init__(self, base: str, project: str) -> None:
        where = urlsplit(base)
        self.conn = http.client.HTTPConnection(
            where.hostname or "127.0.0.1", where.port or 80, timeout=30
        )
        self.headers = {
            "Client-ID": str(uuid.uuid4()),
            "X-Project-ID": project,
            "Content-Type": "application/json",
        }

    def request(self, method: str, url: str, body: Any = None) -> tuple[int, Any, str]:
        """(status, JSON body or None, Location header)."""
        data = None if body is None else json.dumps(body)
        self.conn.request(method, url, body=data, headers=self.headers)
        response = self.conn.getresponse()
        raw = response.read()
        payload = json.loads(raw) if raw and response.status in (200, 201) else None
        return response.status, payload, response.getheader("Location") or ""


def drain(
    base: str, project: str, queues: list[str], checker: ConsumptionChecker, release_delay: float
) -> dict[str, Any]:
    """Consume what is left; returns what it did (for the run's totals)."""
    client = _Client(base, project)
    deleted = released = 0
    started = time.time()
    unknown_claims = checker.claims_maybe_holding()
    try:
        for claim in sorted(checker.unreleased_claims()):
            sent = time.time()
            status, _, _ = client.request("DELETE", claim)
            checker.claim_released(claim, sent, status)
            released += 1
        # by then every released message is due, and every claim nobody knows of expired
        settled = started + release_delay + 1.0
        if unknown_claims:
            settled = max(settled, started + CLAIM_TTL + 1.0)
        deadline = settled + DRAIN_SECONDS
        for queue in queues:
            while checker.pending(queue) > 0 and time.time() < deadline:
                got = _claim_and_delete(client, queue, checker)
                deleted += got
                if got == 0:
                    if time.time() > settled:
                        break
                    time.sleep(EMPTY_WAIT)
    except (OSError, http.client.HTTPException) as exc:
        log.error("drain: %r", exc)
    finally:
        client.conn.close()
    left = sum(checker.pending(queue) for queue in queues)
    log.info("drain: %d claims released, %d messages deleted, %d left", released, deleted, left)
    return {
        "drain_unknown_claims": unknown_claims,
        "drain_released_claims": released,
        "drained": deleted,
        "drain_seconds": round(time.time() - started, 2),
    }


def _claim_and_delete(client: _Client, queue: str, checker: ConsumptionChecker) -> int:
    """One claim: delete each of its messages in order, release it. How many
    messages it held (0: nothing claimable)."""
    sent = time.time()
    status, payload, claim = client.request(
        "POST", f"/v2/queues/{queue}/claims?limit={CLAIM_LIMIT}", {"ttl": CLAIM_TTL, "grace": 60}
    )
    if status != 201 or not claim:
        return 0
    messages = payload["messages"]
    stamps = [read_stamp(message["body"]) for message in messages]
    checker.claimed(
        queue, claim, [s for s in stamps if s is not None], sent, time.time(), CLAIM_TTL
    )
    for message, stamp in zip(messages, stamps, strict=True):
        sent = time.time()
        status, _, _ = client.request("DELETE", message["href"])
        if stamp is not None:
            checker.deleted(queue, claim, stamp, sent, time.time(), status)
    sent = time.time()
    status, _, _ = client.request("DELETE", claim)
    checker.claim_released(claim, sent, status)
    return len(messages)
