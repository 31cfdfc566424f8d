"""Ordered message groups under concurrent claimers: a property test, every
driver, a single Redis and a Cluster (docs/consumers.md, "Ordered groups").

Claimers (asyncio tasks on the store) claim from a queue of several groups
and ungrouped messages while a poster keeps posting, and fail at random:
they let a claim expire (the clock moves on), release one message with
delay 0, release the whole claim, pop; or succeed (delete). A model
checks, from the calls' results only (no timing):

(a) no two live claims ever hold messages of one group (nor one message);
(b) a claim's (or pop's) messages of group G are G's earliest live
    messages, consecutive, in post order;
(c) every message is deleted in the end (none lost), and none is handed
    out after it was deleted.

A seeded random loop, several seeds. The clock is a ManualClock that the
claimers move on now and then, so claims expire when the model says. With
claimers of both drivers on one queue too: they share the layout. A scan
that goes on past a group's claimed head (the group check removed) fails
every variant within a seed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.errors import (
    ClaimDoesNotHold,
    ClaimNotFound,
    InvalidClaim,
    MessageNotFound,
    TooMuchContention,
)
from feedsvc.storage.base import Claim, FeedStore, ListQuery, Message, NewMessage
from feedsvc.storage.drivers import make_store
from tests.conftest import make_settings

QUEUE = "ordered"
GROUPS = ["acct-1", "acct-2", "acct-3", "order:4", "x"]
MESSAGES = 90
CLAIMERS = 6
ROUNDS = 400  # per claimer at most: far more than a run needs
SEEDS = [1, 2, 3]
OTHER = {"lua": "watch", "watch": "lua"}
POSTER = "0b7f0c2e-6a43-4f39-9e2a-3d1b2f6d9a10"


@dataclass
class Holding:
    """A claim as the model sees it: live from created until expires (ms,
    the store's clock), holding what was not deleted or released yet."""

    created: int
    expires: int
    held: dict[str, str]  # message id -> its group ("" none)


@dataclass
class Handout:
    """A claim's or a pop's messages, and the model's stamp at its return."""

    stamp: int
    ids: list[str]


@dataclass
class Model:
    group_of: dict[str, str] = field(default_factory=dict)
    order: dict[str, list[str]] = field(default_factory=dict)  # group -> ids in post order
    holdings: dict[str, Holding] = field(default_factory=dict)
    #: a message's first successful delete (or pop): the stamp at its call
    deleted_from: dict[str, int] = field(default_factory=dict)
    #: ... and at its return
    deleted_by: dict[str, int] = field(default_factory=dict)
    handouts: list[Handout] = field(default_factory=list)
    #: each message's group as claims and pops returned it
    told: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    _stamps: itertools.count[int] = field(default_factory=itertools.count)

    def stamp(self) -> int:
        return next(self._stamps)

    def posted(self, ids: list[str], groups: list[str]) -> None:
        for message_id, group in zip(ids, groups, strict=True):
            self.group_of[message_id] = group
            self.order.setdefault(group, []).append(message_id)

    def _seen(self, messages: list[Message], started: int) -> None:
        """What a claim or pop returned: each message's group as it says
        (its post may not have returned yet), and none deleted before."""
        for m in messages:
            self.told[m.id] = m.group or ""
            if self.deleted_by.get(m.id, started) < started:
                self.violations.append(f"{m.id} handed out after it was deleted")

    def claimed(self, claim: Claim, ttl: int, started: int, now: int) -> None:
        """(a) against every claim still holding something: two claims' lives
        (from the clock each was made at) overlap unless one ended first (its
        holding ended before the other returned). Only while both last past
        now, the clock at the return: a claim made with a clock read before
        another claimer moved it on may come after a third claim that took
        the message from an expired one (and gave it back)."""
        self._seen(claim.messages, started)
        mine = {m.id: self.told[m.id] for m in claim.messages}
        new = Holding(claim.created_ms, claim.created_ms + ttl * 1000, mine)
        for other_id, other in self.holdings.items():
            if max(new.created, other.created, now) >= min(new.expires, other.expires):
                continue  # one had expired before the other was made
            for message_id, group in mine.items():
                if message_id in other.held or (group and group in other.held.values()):
                    self.violations.append(
                        f"claims {claim.id} and {other_id} both hold {group or message_id}"
                    )
        self.holdings[claim.id] = new
        self.handouts.append(Handout(self.stamp(), list(mine)))

    def ended(self, claim_id: str, ids: list[str]) -> None:
        holding = self.holdings.get(claim_id)
        if holding is not None:
            for message_id in ids:
                holding.held.pop(message_id, None)

    def deleted(self, message_id: str, started: int) -> None:
        self.deleted_from.setdefault(message_id, started)
        self.deleted_by.setdefault(message_id, self.stamp())

    def popped(self, messages: list[Message], started: int, before: list[str], now: int) -> None:
        """(a) for a pop: a claim made before it started (before), still live
        when it returned (now) and still holding the group, was a holder."""
        self._seen(messages, started)
        for m in messages:
            group = self.told[m.id]
            for claim_id in before:
                h = self.holdings[claim_id]
                if h.expires > now and (m.id in h.held or (group and group in h.held.values())):
                    self.violations.append(f"pop took {group or m.id} held by claim {claim_id}")
            self.deleted(m.id, started)
        self.handouts.append(Handout(self.stamp(), [m.id for m in messages]))

    def check_order(self) -> None:
        """(b): each handout's messages of G are G's messages not deleted
        before it returned, from the first, consecutively."""
        for handout in self.handouts:
            by_group: dict[str, list[str]] = {}
            for message_id in handout.ids:
                if group := self.group_of[message_id]:
                    by_group.setdefault(group, []).append(message_id)
            for group, ids in by_group.items():
                left = [
                    i
                    for i in self.order[group]
                    if i in ids or self.deleted_from.get(i, handout.stamp + 1) > handout.stamp
                ]
                if ids != left[: len(ids)]:
                    self.violations.append(f"{group}: handed out {ids}, its front was {left[:4]}")


class Run:
    """The claimers, the poster and the model of one seed. With several
    stores (drivers), the poster uses the first and claimer n the n-th."""

    def __init__(
        self, stores: list[FeedStore], clock: ManualClock, project: str, seed: int
    ) -> None:
        self.stores, self.clock, self.project = stores, clock, project
        self.store = stores[0]
        self.rng = random.Random(seed)
        self.model = Model()
        self.posting_done = False

    async def post_all(self) -> None:
        rng, n = self.rng, 0
        while n < MESSAGES:
            size = min(rng.randint(1, 5), MESSAGES - n)
            # ungrouped ones first, then groups: part of the queue is from before groups
            groups = [
                "" if n < 6 or rng.random() < 0.3 else rng.choice(GROUPS) for _ in range(size)
            ]
            batch = [
                NewMessage(orjson.dumps(n + k), 86400, 10 if rng.random() < 0.05 else 0, group=g)
                for k, g in enumerate(groups)
            ]
            ids = await self.store.post_messages(self.project, QUEUE, POSTER, batch)
            self.model.posted(ids, groups)
            n += size
            await asyncio.sleep(0)
        self.posting_done = True

    @property
    def finished(self) -> bool:
        return self.posting_done and len(self.model.deleted_from) == MESSAGES

    async def claimer(self, store: FeedStore, rng: random.Random) -> None:
        for _ in range(ROUNDS):
            if self.finished:
                return
            if rng.random() < 0.08:
                self.clock.advance(rng.choice([5, 15, 30]))
            try:
                if rng.random() < 0.1:
                    await self.pop(store, rng)
                else:
                    await self.claim(store, rng)
            except TooMuchContention:
                pass  # a 503 a client retries: nothing changed
            await asyncio.sleep(0)
        raise AssertionError("the claimers did not consume the queue in time")

    async def pop(self, store: FeedStore, rng: random.Random) -> None:
        started, before = self.model.stamp(), list(self.model.holdings)
        popped = await store.pop_messages(self.project, QUEUE, rng.randint(1, 3))
        self.model.popped(popped, started, before, self.clock.now_ms())

    async def claim(self, store: FeedStore, rng: random.Random) -> None:
        project, model = self.project, self.model
        ttl = rng.choice([20, 40, 60])
        started = model.stamp()
        claim = await store.claim_messages(project, QUEUE, ttl, 60, rng.randint(1, 4))
        if claim is None:
            return
        model.claimed(claim, ttl, started, self.clock.now_ms())
        for n, m in enumerate(claim.messages):
            await asyncio.sleep(0)
            roll = rng.random()
            if roll < 0.06:
                return  # let the claim expire
            if roll < 0.11:
                model.ended(claim.id, [m.id for m in claim.messages])
                await store.release_claim(project, QUEUE, claim.id)
                return
            if roll < 0.2:
                # the claim's later messages of its group are released with it
                group = model.told[m.id]
                later = [x.id for x in claim.messages[n + 1 :] if model.told[x.id] == group]
                later = later if group else []
                model.ended(claim.id, [m.id, *later])
                try:
                    await store.release_message(project, QUEUE, m.id, claim.id, 0)
                    still = await store.get_claim(project, QUEUE, claim.id)
                except (ClaimDoesNotHold, MessageNotFound, ClaimNotFound):
                    continue  # the claim expired meanwhile
                if kept := {x.id for x in still.messages} & {m.id, *later}:
                    model.violations.append(f"releasing {m.id} of {group} left {kept} held")
                continue
            model.ended(claim.id, [m.id])
            started = model.stamp()
            try:
                await store.delete_message(project, QUEUE, m.id, claim.id)
            except (InvalidClaim, ClaimNotFound):
                continue  # its claim expired (or a release took it back)
            model.deleted(m.id, started)

    async def run(self) -> None:
        claimers = [
            self.claimer(self.stores[n % len(self.stores)], random.Random(self.rng.random()))
            for n in range(CLAIMERS)
        ]
        await asyncio.gather(self.post_all(), *claimers)
        self.model.check_order()
        assert self.model.violations == []
        assert self.model.told.items() <= self.model.group_of.items()
        assert set(self.model.deleted_from) == set(self.model.group_of)
        page = await self.store.list_messages(
            self.project, QUEUE, ListQuery("reader", include_claimed=True, include_delayed=True)
        )
        assert page.messages == []


@pytest.mark.parametrize("seed", SEEDS)
async def test_groups_hold_under_concurrent_claimers(
    store: FeedStore, clock: ManualClock, project: str, seed: int
) -> None:
    await Run([store], clock, project, seed).run()


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("driver", ["lua", "watch"], indirect=True)
async def test_groups_hold_with_both_drivers_claiming_one_queue(
    store: FeedStore, driver: str, redis_url: str, clock: ManualClock, project: str, seed: int
) -> None:
    """The two drivers share the layout: claimers of both on one queue (the
    poster is the driver's, every other claimer the other's) keep it exact."""
    other = make_store(make_settings(redis_url, driver=OTHER[driver]), clock)
    await other.open()
    try:
        await Run([store, other], clock, project, seed).run()
    finally:
        await other.close()
