"""Followers of a queue wake through Redis, not by polling.

A post publishes a notification on its queue's shard channel in the same
round trip as the write (``post.lua``; inside MULTI for the watch driver):
the last seq it indexed and when its first delayed message falls due; a
claim's release publishes one too (messages were freed). What becomes
visible with time alone (a delayed message falling due, a claim expiring)
is announced by nobody: a reader learns the moment from the read it does
anyway and sets a local timer (``QueueFollow.due``).
Each process holds **one subscription per server** (per primary on a
Cluster: a shard channel lives on the slot's primary), carrying SSUBSCRIBE
for every queue someone in this process follows, and fans notifications out
to the local followers. An idle follower costs Redis nothing.

A follower does not learn *what* changed, only *that* it may have: it keeps
its own position and re-reads from it. So a lost notification can only cost
latency, never a message: after the subscription is lost (Redis restarted,
a failover, a peer gone silent found by TCP keep-alive) every follower is
woken once to re-read, and again once the subscription is back.

The usage, free of lost wake-ups::

    async with notifier.follow(channel) as follow:
        while True:
            token = follow.token()      # before reading
            page = read()
            if page or follow.ended:
                break
            await follow.wait(token, seconds)  # returns at once if woken since
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.exceptions as rexc
from redis.asyncio.connection import AbstractConnection

from feedsvc.clock import Clock
from feedsvc.errors import StorageUnavailable
from feedsvc.storage.nodes import Node, Servers
from feedsvc.storage.record import Notification

log = logging.getLogger("feedsvc")

RECONNECT_DELAYS = (0.05, 0.2, 0.5, 1.0, 2.0)
# Seconds follow() waits for Redis to confirm a new subscription.
CONFIRM_WAIT = 2.0


class QueueFollow:
    """One queue's wake-ups, shared by all its followers in this process
    (implements ``feedsvc.storage.base.Follow``)."""

    def __init__(self, channel: str, clock: Clock) -> None:
        self.channel = channel
        self._clock = clock
        self.followers = 0
        self.ended = False  # the queue was deleted
        self._event = asyncio.Event()
        self._due: asyncio.TimerHandle | None = None
        # wake-ups that may have freed a claimed message: all but a post's
        self.frees = 0

    def token(self) -> asyncio.Event:
        """Take before reading; wait() with it returns at once if woken since."""
        return self._event

    async def wait(self, token: asyncio.Event, seconds: float) -> bool:
        """Until woken (True) or seconds pass (False)."""
        if token.is_set():
            return True
        try:
            async with asyncio.timeout(seconds):
                await token.wait()
        except TimeoutError:
            return False
        return True

    def wake(self, posted: bool = False) -> None:
        """Wake the followers; posted: by a post's notification, which
        freed no claimed message (anything else may have: see ``frees``)."""
        if not posted:
            self.frees += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    def due(self, at_ms: int) -> None:
        """Wake again at at_ms, the clock's time (a delayed message falls
        due, a claim expires): a local timer, no Redis command. The earliest
        moment asked for wins; whoever reads then learns the next one."""
        # 1 ms late, so that the read it starts finds the moment passed
        self.wake_at(max(0.0, (at_ms + 1 - self._clock.now_ms()) / 1000))

    def wake_at(self, delay: float) -> None:
        """Wake again after delay seconds."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        if self._due is None or self._due.when() > when or self._due.cancelled():
            if self._due is not None:
                self._due.cancel()
            self._due = loop.call_at(when, self._fall_due)

    def _fall_due(self) -> None:
        self._due = None
        self.wake()

    def close(self) -> None:
        if self._due is not None:
            self._due.cancel()


class _Subscriber:
    """One connection to one server, subscribed to some shard channels."""

    def __init__(self, node: Node, notifier: Notifier) -> None:
        self.node = node
        self.channels: set[str] = set()
        self._notifier = notifier
        self._conn: AbstractConnection | None = None
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        # SUNSUBSCRIBEs written on the current connection and not yet answered:
        # an answer beyond these is Redis ending the channel (its slot moved)
        self._unsubscribing: dict[str, int] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self._task = asyncio.create_task(self._run())

    def add(self, channel: str) -> asyncio.Future[None]:
        """Subscribe; the future is done once Redis confirmed it."""
        self.channels.add(channel)
        confirmed = self._confirmed.get(channel)
        if confirmed is None or confirmed.done():
            confirmed = self._confirmed[channel] = asyncio.get_running_loop().create_future()
        self._send("SSUBSCRIBE", channel)
        return confirmed

    def discard(self, channel: str) -> None:
        self.channels.discard(channel)
        self._confirmed.pop(channel, None)
        if self._send("SUNSUBSCRIBE", channel):
            self._unsubscribing[channel] = self._unsubscribing.get(channel, 0) + 1

    def _send(self, *command: Any) -> bool:
        """Write command on the current connection (in a task of this
        subscriber's); False if there is none: the next one subscribes
        self.channels anew."""
        conn = self._conn
        if conn is None:
            return False
        task = asyncio.create_task(self._write(conn, command))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return True

    async def _write(self, conn: AbstractConnection, command: tuple[Any, ...]) -> None:
        # Only on the connection it was meant for, and only while it is open:
        # redis-py's send_command connects a closed connection again, which
        # would open a socket that nobody reads or closes.
        if conn is not self._conn or not conn.is_connected:
            return
        with contextlib.suppress(rexc.RedisError, OSError):
            await conn.send_command(*command, check_health=False)

    async def _run(self) -> None:
        failures = 0
        while True:
            conn = self.node.subscriber_connection()
            try:
                await conn.connect()  # type: ignore[no-untyped-call]
                self._unsubscribing = {}
                self._conn = conn  # from now on add() sends its own SSUBSCRIBE
                if self.channels:
                    # one SSUBSCRIBE per channel: channels of several slots in
                    # one command are refused (CROSSSLOT), even on one node
                    packed = conn.pack_commands([("SSUBSCRIBE", c) for c in self.channels])
                    await conn.send_packed_command(packed, check_health=False)
                failures = 0
                self._notifier.wake_all()  # anything posted while unsubscribed
                await self._listen(conn)
            except asyncio.CancelledError:
                raise
            except (rexc.RedisError, OSError) as exc:
                log.debug("follower subscription lost (%s): re-reading and reconnecting", exc)
            finally:
                self._conn = None
                await conn.disconnect(nowait=True)
            self._notifier.subscription_lost(self)
            await asyncio.sleep(RECONNECT_DELAYS[min(failures, len(RECONNECT_DELAYS) - 1)])
            failures += 1

    async def _listen(self, conn: AbstractConnection) -> None:
        while True:
            reply = await conn.read_response(disconnect_on_error=False, push_request=True)
            if isinstance(reply, rexc.ResponseError):
                raise reply  # MOVED on a cluster: route again
            if not isinstance(reply, list) or not reply:
                continue
            kind = reply[0]
            if kind == b"smessage":
                self._notifier.deliver(reply[1].decode(), reply[2])
            elif kind == b"ssubscribe":
                channel = reply[1].decode()
                confirmed = self._confirmed.get(channel)
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
                # anything posted before the subscription took effect
                self._notifier.wake(channel)
            elif kind == b"sunsubscribe":
                channel = reply[1].decode()
                asked = self._unsubscribing.get(channel, 0)
                if asked > 1:
                    self._unsubscribing[channel] = asked - 1
                elif asked == 1:
                    del self._unsubscribing[channel]
                elif channel in self.channels:  # not asked for: its slot moved away
                    self.channels.discard(channel)
                    self._confirmed.pop(channel, None)
                    self._notifier.moved_away([channel])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for task in list(self._writes):
            task.cancel()
        if self._writes:
            await asyncio.wait(self._writes)


class Notifier:
    """The process's subscriptions and the followers they wake."""

    def __init__(self, servers: Servers, clock: Clock) -> None:
        self._servers = servers
        self._clock = clock
        self._follows: dict[str, QueueFollow] = {}
        self._subscribers: dict[str, _Subscriber] = {}  # by node name
        self._routes: dict[str, _Subscriber] = {}  # by channel
        self._reroutes: set[asyncio.Task[None]] = set()
        self._closed = False  # no subscription starts after close()
        servers.on_new_routes(self.check_routes)

    @property
    def following(self) -> int:
        """Queues followed in this process (each one SSUBSCRIBEd channel)."""
        return len(self._follows)

    @asynccontextmanager
    async def follow(self, channel: str) -> AsyncIterator[QueueFollow]:
        if self._closed:
            raise StorageUnavailable("The service is stopping.")
        follow = self._follows.get(channel)
        if follow is None:
            follow = self._follows[channel] = QueueFollow(channel, self._clock)
            await self._subscribe(channel)
        follow.followers += 1
        try:
            yield follow
        finally:
            follow.followers -= 1
            if follow.followers == 0 and self._follows.get(channel) is follow:
                del self._follows[channel]
                follow.close()
                subscriber = self._routes.pop(channel, None)
                if subscriber is not None:
                    subscriber.discard(channel)

    async def _subscribe(self, channel: str) -> None:
        if self._closed:
            return  # shutting down: the follower is woken by nothing but its timeout
        with contextlib.suppress(rexc.RedisError, rexc.RedisClusterException, OSError):
            await self._servers.ready()  # on a cluster: the slot table
        try:
            node = self._servers.node_for(channel)
        except (rexc.RedisError, rexc.RedisClusterException, KeyError):
            node = self._servers.default_node()  # no table yet: re-routed on loss
        if self._closed:  # closed while the slot table was read
            return
        subscriber = self._subscribers.get(node.name)
        if subscriber is None:
            subscriber = self._subscribers[node.name] = _Subscriber(node, self)
        self._routes[channel] = subscriber
        confirmed = subscriber.add(channel)
        # Wait (bounded) for the subscription to take effect, so that a
        # follower's first read is covered; if Redis is slow or away, go on:
        # the confirmation (or the reconnection) wakes the follower later.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONFIRM_WAIT):
                await asyncio.shield(confirmed)

    def deliver(self, channel: str, data: bytes) -> None:
        follow = self._follows.get(channel)
        if follow is None:
            return
        note = Notification.read(data)
        if note.ended:
            follow.ended = True
        elif note.due:
            follow.due(note.due)
        follow.wake(posted=note.seq > 0)  # seq 0: a release (record.FREED)

    def wake(self, channel: str) -> None:
        follow = self._follows.get(channel)
        if follow is not None:
            follow.wake()

    def wake_all(self) -> None:
        for follow in self._follows.values():
            follow.wake()

    def subscription_lost(self, subscriber: _Subscriber) -> None:
        """Wake its followers to re-read; on a cluster, route its channels again
        (the slot may have moved, the node failed over) once the table is fresh."""
        for channel in subscriber.channels:
            follow = self._follows.get(channel)
            if follow is not None:
                follow.wake()
        if self._servers.cluster:
            moved = list(subscriber.channels)
            subscriber.channels.clear()
            self.moved_away(moved)

    def moved_away(self, channels: list[str]) -> None:
        """Channels no longer subscribed where they were (a lost connection,
        or Redis ended them: their slot moved): wake their followers and,
        once the slot table is fresh, subscribe them where they live now."""
        for channel in channels:
            self._routes.pop(channel, None)
            self.wake(channel)
        self._start_reroute(channels, stale=True)

    def check_routes(self) -> None:
        """The slot table changed (a slot moved, a primary failed over, maybe
        silently): subscribe again each channel whose slot lives elsewhere now."""
        moved: list[str] = []
        for channel, subscriber in list(self._routes.items()):
            with contextlib.suppress(rexc.RedisError, rexc.RedisClusterException, KeyError):
                if self._servers.node_for(channel).name != subscriber.node.name:
                    subscriber.discard(channel)
                    del self._routes[channel]
                    moved.append(channel)
        if moved:
            self._start_reroute(moved, stale=False)

    def _start_reroute(self, channels: list[str], stale: bool) -> None:
        """Subscribe channels again in a task of the notifier's own (close()
        ends it): none is started once closed."""
        if self._closed:
            return
        task = asyncio.create_task(self._reroute(channels, stale))
        self._reroutes.add(task)
        task.add_done_callback(self._rerouted)

    def _rerouted(self, task: asyncio.Task[None]) -> None:
        self._reroutes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("re-routing subscriptions failed: %r", task.exception())

    async def _reroute(self, channels: list[str], stale: bool) -> None:
        if stale:
            await self._servers.lost()
        for channel in channels:
            if channel in self._follows and channel not in self._routes:
                await self._subscribe(channel)
        for channel in channels:
            self.wake(channel)

    async def reset(self) -> None:
        """Start every subscription again (the master changed behind Sentinel)."""
        subscribers, self._subscribers = self._subscribers, {}
        self._routes.clear()
        for subscriber in subscribers.values():
            await subscriber.close()
        for channel in list(self._follows):
            await self._subscribe(channel)
        self.wake_all()

    async def close(self) -> None:
        self._closed = True
        reroutes = list(self._reroutes)
        for task in reroutes:
            task.cancel()
        if reroutes:
            await asyncio.wait(reroutes)
        subscribers, self._subscribers = self._subscribers, {}
        self._routes.clear()
        for subscriber in subscribers.values():
            await subscriber.close()
        for follow in self._follows.values():
            follow.close()
