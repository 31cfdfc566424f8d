"""Coalesce concurrent Redis calls onto one pipelined connection (auto-pipelining).

Requests that arrive in the same event-loop turn put their commands into one
pending batch (written early once it holds ``BatchCap.calls`` calls, or one
call of ``EARLY_WRITE`` commands); a flusher packs the whole batch with
hiredis and writes it to a dedicated connection in one socket write, without
waiting for the replies to earlier batches (ioredis-style auto-pipelining).
A reader task parses the replies with hiredis as they stream back and hands
each caller its own slice, in order. Per request this removes redis-py's
fixed costs (a pool checkout, a pipeline object, a timeout context per
reply); what is left is one ``pack_command`` and a few reply objects.

Guarantees:

* Each caller gets exactly the replies to its own commands, in order; error
  replies come back as exception values (redis-py's classes, e.g.
  ``NoScriptError``) in that caller's slice only.
* Commands of one caller are sent contiguously and in order; batches are
  sent in the order they were formed, on one connection, so Redis executes
  them in that order.
* **No call waits longer than ``reply_timeout`` in all**, counted from
  ``submit()``: time spent waiting for room, for a connection, for the write
  buffer to drain and for the replies all comes out of that one budget. A
  call whose time runs out before it is written fails alone and is never
  sent; a written call whose replies are overdue fails every caller still
  waiting on that connection (``TimeoutError``, i.e. a 503), closes it, and
  the next call reconnects. A lost connection fails them the same way with
  ``ConnectionError``.
* **Bounded work in flight.** At most ``max_in_flight`` calls are admitted
  (waiting to be written or for their replies); callers beyond that wait for
  room in arrival order, at most ``room_timeout``, and then fail with
  :class:`CoalescerBusy` (a ``ConnectionError``: a 503 with Retry-After).
* **A slow Redis pushes back.** No batch is written while the socket's
  write buffer is above its high-water mark: the flusher waits for it to
  drain, and batches full early wait for the flusher meanwhile, so new calls
  collect in the (bounded) pending batch instead of in an unbounded buffer.
* A caller that gives up before its batch is written is left out of it;
  after that its replies are read and dropped (its room is held until
  then), so a cancelled request never leaves the connection out of step.

The connection is made by redis-py (so AUTH, SELECT, TLS and unix sockets
work as configured in the URL; ``make_connection`` is a pool's or a cluster
node's factory); only the byte streams are driven here. ``submit`` stays
synchronous: a caller may put commands on several coalescers before it
waits for any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = tuple[Any, ...]
_READ_SIZE = 1 << 16
#: Calls admitted at once, by default: written or about to be, awaiting
#: replies. Calls whose callers gave up after they were written count too,
#: until their replies are read.
MAX_IN_FLIGHT = 1024
#: A call of at least this many commands (a post of hundreds of messages) is
#: written when it is submitted, with the calls pending before it, instead of
#: at the end of the loop turn: a turn that also parses other large request
#: bodies can take many milliseconds, and Redis would sit idle meanwhile
#: (batches of 1,000 messages were slower than batches of 100 for that).
EARLY_WRITE = 256
#: Likewise, once this many calls are pending they are written at once, and
#: the rest of the turn's calls make the next batch: the most, when at least
#: twice as many calls are in flight (BatchCap). Without this cap a turn
#: that handles a few dozen requests (about 44 per batch with 64 keep-alive
#: clients) kept Redis waiting until its end, a millisecond or more; Redis
#: then ran the whole batch while the process, with nothing left to do,
#: waited for it (90-95 % busy at full load). With the cap Redis starts on
#: the first calls while the process still handles the others (99-100 %
#: busy): POSTs 11,150-11,160 → 12,340-12,460 a second and GETs of a page
#: 10,250-10,390 → 10,850-10,960, at the same CPU per request. A cap of 16
#: cost 6-7 µs more per POST than one of 32 (more writes, and more wake-ups
#: of the reader, each serving fewer callers). docs/BENCHMARKS.md has the runs.
EARLY_CALLS = 32
#: The fewest (BatchCap): smaller batches cost more per call than they save.
MIN_EARLY_CALLS = 8
#: Seconds over which BatchCap takes the most calls in flight: long enough
#: to see the most (with 64 clients of GETs, a tenth of a second often saw
#: 56-60 of them), and a rise is followed at once anyway.
CAP_WINDOW = 1.0


class BatchCap:
    """How many pending calls are written at once: half the most calls in
    flight over the last ``window`` seconds, from MIN_EARLY_CALLS to
    EARLY_CALLS, so that the process builds one batch while Redis runs the
    one before.

    A fixed cap of 32 suits 64 or more calls in flight, but with 32 (say 32
    keep-alive clients) a turn rarely collects 32 calls, and Redis ran each
    whole batch while the process waited for it: a cap of 16 served 20-30 %
    more POSTs there, and 10 % fewer with 64 clients (docs/BENCHMARKS.md).
    The cap is EARLY_CALLS until the first call; a window of ``math.inf``
    keeps it there.
    """

    __slots__ = ("_peak", "_until", "_window", "calls")

    def __init__(self, window: float = CAP_WINDOW) -> None:
        self.calls = EARLY_CALLS
        self._window = window
        self._peak = 0
        # loop time at which the window ends: at the first call (which finds
        # it a whole window old), unless windows are endless
        self._until = -window if math.isfinite(window) else math.inf

    def observe(self, in_flight: int, now: float) -> None:
        """Called with the calls in flight as each is submitted, at loop time
        now. The cap rises at once with them, and falls when a window ends."""
        if in_flight > self._peak:
            self._peak = in_flight
            self.calls = max(self.calls, min(EARLY_CALLS, (in_flight + 1) // 2))
        if now >= self._until:
            if now >= self._until + self._window:
                # no call for a whole window (or none yet): what was in
                # flight before a quiet spell says nothing about after it
                self._peak = in_flight
            self.calls = min(EARLY_CALLS, max(MIN_EARLY_CALLS, (self._peak + 1) // 2))
            self._peak = 0
            self._until = now + self._window


def _packed(call: _Call) -> list[bytes] | None:
    """The call's commands in Redis's protocol; None, and the call failed,
    if an argument cannot be encoded (that caller's bug alone: the calls
    batched with it go on)."""
    try:
        return [hiredis.pack_command(command) for command in call.commands]
    except Exception as exc:
        call.future.set_exception(exc)
        return None


class CoalescerBusy(RedisConnectionError):
    """No room for another call within the time allowed: Redis is not keeping up.

    A ``redis.exceptions.ConnectionError``, so the store answers it like any
    other unavailable Redis: 503 with Retry-After.
    """


def _reply_error(message: str) -> Exception:
    # redis-py's own mapping of an error reply to its exception class
    # (NoScriptError, ...); private, watched by tests/test_canaries.py.
    from redis._parsers.base import BaseParser

    error: Exception = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error


def _above_high_water(transport: asyncio.WriteTransport) -> bool:
    return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]


def _streams(conn: AbstractConnection) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The connected socket's streams. redis-py has no public handle on them
    (private attributes, watched by tests/test_canaries.py)."""
    reader, writer = conn._reader, conn._writer
    assert reader is not None and writer is not None, "not connected"
    return reader, writer


class _Call:
    """Commands submitted, not yet written."""

    __slots__ = ("commands", "deadline", "future", "timer")

    def __init__(
        self, commands: Sequence[Command], future: asyncio.Future[list[Any]], deadline: float
    ) -> None:
        self.commands = commands
        self.future = future
        self.deadline = deadline  # loop time by which the caller has its replies or an error
        self.timer: asyncio.TimerHandle | None = None  # set while it waits for room


class _Waiter:
    """A written call: its future and the replies still to come."""

    __slots__ = ("deadline", "future", "remaining", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], count: int, deadline: float) -> None:
        self.future = future
        self.remaining = count
        self.replies: list[Any] = []
        self.deadline = deadline


def _fail_all(calls: Iterable[_Call | _Waiter], exc: Exception) -> None:
    """Fail each call whose caller still waits."""
    for call in calls:
        if not call.future.done():
            call.future.set_exception(exc)


class Coalescer:
    def __init__(
        self,
        make_connection: Callable[[], AbstractConnection],
        reply_timeout: float,
        max_batch: int = 4096,
        max_in_flight: int = MAX_IN_FLIGHT,
        room_timeout: float | None = None,
        cap_window: float = CAP_WINDOW,
    ) -> None:
        """reply_timeout bounds each call from submit to its replies;
        room_timeout (at most reply_timeout, which it defaults to) bounds the
        wait for one of the max_in_flight places; cap_window is BatchCap's."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._make_connection = make_connection
        self._reply_timeout = reply_timeout
        room_timeout = reply_timeout if room_timeout is None else room_timeout
        self._room_timeout = min(room_timeout, reply_timeout)
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._admitted = 0  # calls in _pending or _waiting
        self._cap = BatchCap(cap_window)
        self._queued: deque[_Call] = deque()  # waiting for room, in arrival order
        self._pending: list[_Call] = []
        self._flusher: asyncio.Task[None] | None = None
        self._conn: AbstractConnection | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: deque[_Waiter] = deque()
        # the reader's reply timer, re-aimed at the oldest written call's deadline
        self._overdue: asyncio.Timeout | None = None
        self.batches = self.calls = 0
        self.refused = 0  # calls failed with CoalescerBusy
        self.drain_waits = 0  # times the flusher waited for the write buffer to drain
        self._draining = False  # the flusher waits for the write buffer to drain

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet answered (to be written, or awaiting replies)."""
        return self._admitted

    @property
    def waiting_for_room(self) -> int:
        return sum(not call.future.done() for call in self._queued)

    def submit(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Queue commands for the next batch; the future gets their replies.
        (Lets a caller put commands on several connections before waiting.)"""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        now = loop.time()
        call = _Call(commands, future, now + self._reply_timeout)
        self._cap.observe(self._admitted, now)
        self._admit_queued()
        if not self._queued and self._admitted < self._max_in_flight:
            self._admit(call)
        else:
            call.timer = loop.call_at(now + self._room_timeout, self._refuse, call)
            self._queued.append(call)
        return future

    # -- room ------------------------------------------------------------------

    def _admit(self, call: _Call) -> None:
        self._admitted += 1
        pending = self._pending
        pending.append(call)
        full = len(pending) >= self._cap.calls or len(call.commands) >= EARLY_WRITE
        if full and self._write_now():
            return
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())

    def _write_now(self) -> bool:
        """Write the pending calls now if connected and below high water (else the flusher will)."""
        writer = self._writer
        if writer is None or self._draining or len(self._pending) > self._max_batch:
            return False
        # a lost connection is the flusher's to replace (uvloop's write() raises on it)
        if writer.transport.is_closing() or _above_high_water(writer.transport):
            return False
        batch, self._pending = self._pending, []
        self._write(writer, batch)
        return True

    def _admit_queued(self) -> None:
        queued = self._queued
        while queued and self._admitted < self._max_in_flight:
            call = queued.popleft()
            if call.timer is not None:
                call.timer.cancel()
            if not call.future.done():  # else the caller gave up, or was refused
                self._admit(call)

    def _release(self, count: int) -> None:
        self._admitted -= count
        if self._queued:
            self._admit_queued()

    def _refuse(self, call: _Call) -> None:
        if not call.future.done():
            self.refused += 1
            call.future.set_exception(
                CoalescerBusy(
                    f"{self._admitted} Redis calls already in flight on this connection; "
                    f"no room for another within {self._room_timeout:g} s"
                )
            )
        # finished calls at the head hold nobody back, but would keep their memory
        while self._queued and self._queued[0].future.done():
            self._queued.popleft()

    # -- writing ---------------------------------------------------------------

    async def _flush(self) -> None:
        try:
            # let every request of this loop turn join the batch
            await asyncio.sleep(0)
            while self._pending:
                try:
                    writer = await self._connected(min(call.deadline for call in self._pending))
                except Exception as exc:
                    batch, self._pending = self._pending, []
                    _fail_all(batch, exc)
                    self._release(len(batch))
                    continue
                if _above_high_water(writer.transport):
                    await self._push_back(writer)
                    continue  # the connection may have gone meanwhile: look again
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                self._write(writer, batch)
        finally:
            self._flusher = None

    def _write(self, writer: asyncio.StreamWriter, batch: list[_Call]) -> None:
        chunks: list[bytes] = []
        now = asyncio.get_running_loop().time()
        was_idle = not self._waiting
        dropped = 0
        for call in batch:
            if call.future.done():  # the caller gave up before anything was sent
                dropped += 1
                continue
            if call.deadline <= now:  # its time ran out waiting to be sent
                call.future.set_exception(RedisTimeoutError("Timeout waiting to write to Redis"))
                dropped += 1
                continue
            packed = _packed(call)
            if packed is None:
                dropped += 1
                continue
            chunks += packed
            self._waiting.append(_Waiter(call.future, len(call.commands), call.deadline))
            self.calls += 1
        if chunks:
            self.batches += 1
            writer.write(b"".join(chunks))
            if was_idle:
                self._aim_overdue()
        if dropped:
            self._release(dropped)

    async def _push_back(self, writer: asyncio.StreamWriter) -> None:
        """Wait while the write buffer drains; nothing is written meanwhile."""
        transport = writer.transport
        self.drain_waits += 1
        self._draining = True
        # Bytes stuck in the buffer belong to written calls, so the reader's
        # timer (the oldest call's deadline) fails the connection and aborts
        # the transport before the newest call's deadline; that wakes drain().
        # The bound here only guards against that not happening.
        newest = self._waiting[-1].deadline if self._waiting else None
        try:
            async with asyncio.timeout_at(newest):
                await writer.drain()
                await asyncio.sleep(0)  # drain() returns at once if the transport never paused
        except TimeoutError:
            transport.abort()  # the reader sees the connection end and fails its callers
        except OSError:
            pass  # the connection is gone: the reader fails its callers
        finally:
            self._draining = False

    async def _connected(self, deadline: float) -> asyncio.StreamWriter:
        """The connection's writer; connecting (by deadline) if there is none.
        A lost one (Redis closed it, drop_connection(), a push-back that gave
        up) is replaced once its reader has failed what was written on it:
        uvloop's write() raises on a closed connection."""
        if self._reader is not None and self._writer and self._writer.transport.is_closing():
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.wait({self._reader})
            except TimeoutError:
                raise RedisTimeoutError("Timeout waiting for a lost connection to close") from None
        if self._conn is None or self._writer is None:
            conn = self._make_connection()
            try:
                async with asyncio.timeout_at(deadline):
                    await conn.connect()  # type: ignore[no-untyped-call]
            except BaseException as exc:
                await conn.disconnect(nowait=True)  # a connect cut short leaves no socket open
                if isinstance(exc, TimeoutError):
                    raise RedisTimeoutError("Timeout connecting to Redis") from None
                raise
            stream, self._writer = _streams(conn)
            self._conn = conn
            self._overdue = None
            self._reader = asyncio.create_task(self._read(conn, stream))
        return self._writer

    # -- reading ---------------------------------------------------------------

    def _aim_overdue(self) -> None:
        """Point the reader's timer at the oldest written call's deadline (none if idle)."""
        overdue = self._overdue
        if overdue is None or overdue.expired():
            return
        when = self._waiting[0].deadline if self._waiting else None
        if overdue.when() != when:
            overdue.reschedule(when)

    async def _read(self, conn: AbstractConnection, stream: asyncio.StreamReader) -> None:
        parser = hiredis.Reader(replyError=_reply_error)
        try:
            try:
                async with asyncio.timeout(None) as overdue:
                    self._overdue = overdue
                    self._aim_overdue()
                    while True:
                        data = await stream.read(_READ_SIZE)
                        if not data:
                            raise RedisConnectionError("Redis closed the connection")
                        parser.feed(data)
                        answered = 0
                        while (reply := parser.gets()) is not False:
                            waiter = self._waiting[0]
                            waiter.replies.append(reply)
                            waiter.remaining -= 1
                            if waiter.remaining == 0:
                                self._waiting.popleft()
                                answered += 1
                                if not waiter.future.done():
                                    waiter.future.set_result(waiter.replies)
                        self._aim_overdue()
                        if answered:
                            self._release(answered)
            except TimeoutError:
                raise RedisTimeoutError("Timeout reading from Redis") from None
        except asyncio.CancelledError:
            self._fail(conn, RedisConnectionError("The coalescer was closed"))
            raise
        except Exception as exc:
            self._fail(conn, exc)
            await conn.disconnect(nowait=True)

    def _fail(self, conn: AbstractConnection, exc: Exception) -> None:
        """Fail every caller waiting on conn, which is dropped (once, by its reader)."""
        if self._conn is conn:
            writer = self._writer
            self._conn = self._writer = self._reader = self._overdue = None
            if writer is not None:
                # unsent bytes go too, which also wakes a flusher waiting in drain()
                writer.transport.abort()
        waiting, self._waiting = self._waiting, deque()
        _fail_all(waiting, exc)
        self._release(len(waiting))

    def drop_connection(self) -> None:
        """Close the connection now (calls written on it fail); the next call reconnects."""
        if self._writer is not None:
            self._writer.transport.abort()

    async def close(self) -> None:
        """Let the calls already admitted finish (bounded), then disconnect.

        Calls still waiting for room are refused at once."""
        queued, self._queued = self._queued, deque()
        for call in queued:
            if call.timer is not None:
                call.timer.cancel()
        _fail_all(queued, RedisConnectionError("The coalescer was closed"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reply_timeout
        while self._admitted and loop.time() < deadline:  # noqa: ASYNC110 - shutdown only
            await asyncio.sleep(0.01)
        flusher, conn, reader = self._flusher, self._conn, self._reader
        for task in (flusher, reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pending, self._pending = self._pending, []
        _fail_all(pending, RedisConnectionError("The coalescer was closed"))
        self._admitted -= len(pending)
        if conn is not None:
            await conn.disconnect(nowait=True)
        self._conn = self._writer = None
