"""One subscription delivered by this process while it holds the lease.

The runner sends, in post order, each message after the stored position;
after each answer it stores the new state (position, attempts, back-off)
in a transaction that first checks the lease is still its own, and stops at
once if it is not. A background task renews the lease every third of its
length; before each attempt the runner makes sure the attempt ends (at most
``--delivery-timeout``, below half the lease) before the lease could run
out, so a worker that takes over never overlaps with one still sending.
Whatever an attempt raises is that attempt's failure (recorded, retried,
given up on, counted); anything else that stops the loop is recorded as a
failed attempt too and tried again later, never a silent re-send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

from feedsvc import tracing
from feedsvc.clock import Clock
from feedsvc.config import Settings
from feedsvc.delivery.retry import DEFAULTS, effective_policy
from feedsvc.delivery.senders import Outcome, Senders, control_document, notification
from feedsvc.errors import FeedError, SubscriptionNotFound
from feedsvc.message_headers import trace_headers
from feedsvc.storage.base import (
    Delivery,
    FeedStore,
    Parent,
    Subscription,
    Unreadable,
    checkpoint,
    feed_of,
)

log = logging.getLogger("feedsvc")

BATCH = 20
# The longest sleep before a retry that is due later: the loop looks again
# (the subscription may have been changed or deleted meanwhile).
MAX_NAP = 5.0


@dataclass(slots=True)
class DeliveryCounters:
    """What /metrics shows: outcomes by scheme, and given-up messages per subscription."""

    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    failures: dict[tuple[str, str, str], int] = field(default_factory=dict)
    takeovers: int = 0
    leases_lost: int = 0

    def count(self, scheme: str, outcome: str) -> None:
        key = (scheme, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def failed(self, parent: Parent, subscription_id: str) -> None:
        key = (parent.project, parent.name, subscription_id)
        self.failures[key] = self.failures.get(key, 0) + 1


class LeaseLost(Exception):
    pass


def internal_error(exc: BaseException) -> str:
    """last_error for an exception: its type, and its text if it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Runner:
    def __init__(
        self,
        store: FeedStore,
        senders: Senders,
        settings: Settings,
        clock: Clock,
        counters: DeliveryCounters,
        parent: Parent,
        subscription_id: str,
    ) -> None:
        self._store = store
        self._state = store.deliveries
        self._senders = senders
        self._settings = settings
        self._clock = clock
        self._counters = counters
        self.parent = parent
        self.subscription_id = subscription_id
        self._token = os.urandom(12).hex()
        self._lease_ms = int(settings.delivery_lease * 1000)
        self._renewed = 0.0  # monotonic time of the last successful acquire or renewal
        self._lost = False
        self._finished = False  # run() is over: the renewal stops too
        self._scheme = "unknown"  # the subscriber's, once read: for the metrics

    async def acquire(self) -> bool:
        started = time.monotonic()
        if await self._state.acquire(
            self.parent, self.subscription_id, self._token, self._lease_ms
        ):
            self._renewed = started
            return True
        return False

    async def let_go(self) -> None:
        """Give back a lease acquired and not used (the worker is stopping)."""
        with contextlib.suppress(FeedError):
            await self._state.release(self.parent, self.subscription_id, self._token)

    async def run(self, done: Callable[[], None]) -> None:
        """Deliver until nothing is left (or the lease is lost); then let go."""
        renewer = asyncio.create_task(self._renew_forever())
        try:
            while True:
                position = await self._deliver()
                await self._state.release(self.parent, self.subscription_id, self._token)
                # a post that landed after the last read found the lease taken
                # and woke no one: look once more now that the lease is free
                if position is None or await self._state.last_seq(self.parent) <= position:
                    break
                checkpoint()
                if not await self.acquire():
                    break
        except asyncio.CancelledError:
            # stopping: let the lease go so another process continues at once
            with contextlib.suppress(FeedError, asyncio.CancelledError):
                await asyncio.shield(
                    self._state.release(self.parent, self.subscription_id, self._token)
                )
            raise
        except LeaseLost:
            self._counters.leases_lost += 1
            log.warning("lost the lease of subscription %s", self.subscription_id)
            # if it was only about to run out, free it: the next wake-up or sweep
            # (here or elsewhere) continues at once rather than after it expires
            with contextlib.suppress(FeedError):
                await self._state.release(self.parent, self.subscription_id, self._token)
        except FeedError as exc:  # Redis trouble: the sweep tries again later
            log.warning("delivery of subscription %s stopped: %s", self.subscription_id, exc)
        except Exception as exc:  # a bug: recorded as a failed attempt, tried again later
            log.exception("delivery of subscription %s failed", self.subscription_id)
            await self._note_failure(exc)
        finally:
            self._finished = True
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            done()

    async def _note_failure(self, exc: Exception) -> None:
        """Record what stopped the loop as a failed attempt (visible in the
        subscription's ``delivery`` and the metrics) due again after the
        default policy's longest delay, and let the lease go: never a silent
        loop that sends the same message again at every lease expiry."""
        self._counters.count(self._scheme, "attempt_failed")
        due = self._clock.now_ms() + DEFAULTS["maximum_delay"] * 1000
        try:
            await self._state.note_failure(
                self.parent, self.subscription_id, self._token, internal_error(exc), due
            )
            await self._state.release(self.parent, self.subscription_id, self._token)
        except FeedError:  # Redis trouble: the lease runs out, the sweep tries again
            pass
        except Exception:  # never out of run(): its task has no one to tell
            log.exception("recording the failure of subscription %s", self.subscription_id)

    async def _renew_forever(self) -> None:
        while not self._finished:
            checkpoint()
            await asyncio.sleep(self._settings.delivery_lease / 3)
            if self._finished:
                return
            started = time.monotonic()
            try:
                ok = await self._state.renew(
                    self.parent, self.subscription_id, self._token, self._lease_ms
                )
            except FeedError:
                ok = False
            if not ok:
                self._lost = True
                return
            self._renewed = started

    def _check_lease(self) -> None:
        """Raise unless an attempt started now ends before the lease can run out."""
        left = self._renewed + self._settings.delivery_lease - time.monotonic()
        if self._lost or left <= self._settings.delivery_timeout:
            raise LeaseLost()

    async def _settle(self, delivery: Delivery, outcome: str, clear_control: bool = False) -> None:
        if not await self._state.settle(
            self.parent, self.subscription_id, self._token, delivery, outcome, clear_control
        ):
            raise LeaseLost()

    async def _deliver(self) -> int | None:
        """Work through the backlog; the position reached (None: nothing to deliver
        until something else changes: the subscription is gone, or unconfirmed)."""
        while True:
            checkpoint()
            try:
                sub = await feed_of(self._store, self.parent).subscriptions.get(
                    self.parent, self.subscription_id
                )
            except SubscriptionNotFound:
                return None
            self._scheme = sub.subscriber.partition(":")[0]
            d = sub.delivery
            wait = (d.due_ms - self._clock.now_ms()) / 1000
            if wait > 0:
                checkpoint()
                await asyncio.sleep(min(wait, MAX_NAP, self._settings.delivery_sweep))
                continue
            if d.control is not None:
                control = d.control
                outcome = await self._attempt(sub, partial(control_document, sub, control), None)
                await self._after(sub, d, outcome, d.position, control_sent=True)
                continue
            if self._settings.require_confirmation and not sub.confirmed:
                # only the confirmation request goes to the unconfirmed; the
                # confirmation restarts delivery (and skips what came before)
                return None
            batch = await self._state.messages_after(self.parent, d.position, BATCH)
            if not batch:
                return d.position
            for seq, message in batch:
                if message is None:  # expired or deleted before it could be sent
                    await self._settle(replace(d, position=seq, attempts=0, due_ms=0), "")
                    d = replace(d, position=seq)
                    continue
                if isinstance(message, Unreadable):
                    # not sent: a failed attempt, so the retry policy gives a
                    # key put back in time its chance, then it is given up on
                    outcome = Outcome(False, error=message.reason)
                else:
                    document = partial(notification, sub, message)
                    trace = trace_headers(message.headers)
                    if tracing.ENABLED:
                        with tracing.span("process", sub.source, links=[trace]) as span:
                            tracing.message_ids(span, [message.id])
                            outcome = await self._attempt(sub, document, message.id, trace)
                            span.set_attribute("feedsvc.delivery.ok", outcome.ok)
                    else:
                        outcome = await self._attempt(sub, document, message.id, trace)
                if not await self._after(sub, d, outcome, seq):
                    break
                d = replace(d, position=seq, attempts=0, due_ms=0)

    async def _attempt(
        self,
        sub: Subscription,
        document: Callable[[], bytes],
        message_id: str | None,
        trace: Mapping[str, str] | None = None,
    ) -> Outcome:
        checkpoint()
        self._check_lease()
        try:
            outcome = await self._senders.send(sub, document(), message_id, trace)
        except Exception as exc:  # whatever it is, it is this attempt's failure
            # an input nobody foresaw or a bug: a failed attempt like any
            # other (recorded, retried, given up on), never a wedge
            log.warning("subscription %s: an attempt raised", sub.id, exc_info=True)
            outcome = Outcome(False, error=internal_error(exc))
        scheme = sub.subscriber.partition(":")[0]
        self._counters.count(scheme, "delivered" if outcome.ok else "attempt_failed")
        return outcome

    async def _after(
        self,
        sub: Subscription,
        d: Delivery,
        outcome: Outcome,
        seq: int,
        control_sent: bool = False,
    ) -> bool:
        """Store what the attempt at seq means, d being the state before it (not
        the state the batch started from: messages before seq may have been
        delivered since); True if delivery moves on to the next message."""
        if outcome.ok:
            await self._settle(
                Delivery(position=seq), "" if control_sent else "delivered", control_sent
            )
            return True
        metadata = await self._state.parent_metadata(self.parent)
        error = outcome.error
        try:
            delay = effective_policy(sub.options, metadata).delay(d.attempts)
        except Exception as exc:  # a stored policy nobody can follow
            # the default policy applies, and the reason is on the record
            delay = effective_policy({}, {}).delay(d.attempts)
            error = f"{error}; retry policy unusable ({internal_error(exc)}): the default applies"
        if outcome.final or delay is None:
            log.warning("subscription %s gave up on a notification: %s", sub.id, error)
            self._counters.count(sub.subscriber.partition(":")[0], "given_up")
            self._counters.failed(self.parent, sub.id)
            failed = Delivery(position=seq, last_error=error)
            await self._settle(failed, "failed", control_sent)
            return True
        due = self._clock.now_ms() + int(delay * 1000)
        retry = Delivery(
            position=d.position,
            attempts=d.attempts + 1,
            due_ms=due,
            last_error=error,
        )
        await self._settle(retry, "")
        return False
