"""Coalesce concurrent Redis calls onto one pipelined connection (auto-pipelining).

Requests that arrive in the same event-loop turn put their commands into one
pending batch; a flusher packs the whole batch with hiredis and writes it to
a dedicated connection in one socket write, without waiting for the replies
to earlier batches (ioredis-style auto-pipelining). A reader task parses the
replies with hiredis as they stream back and hands each caller its own
slice, in order. Per request this removes redis-py's fixed costs (a pool
checkout, a pipeline object, a timeout context per reply); what is left is
one ``pack_command`` and a few reply objects.

Guarantees:

* Each caller gets exactly the replies to its own commands, in order; error
  replies come back as exception values (redis-py's classes, e.g.
  ``NoScriptError``) in that caller's slice only.
* Commands of one caller are sent contiguously and in order; batches are
  sent in the order they were formed, on one connection, so Redis executes
  them in that order.
* A connection failure or a reply overdue by ``reply_timeout`` fails every
  caller still waiting on that connection (they get ``ConnectionError`` /
  ``TimeoutError``, i.e. a 503), closes it, and the next call reconnects.
* A caller that gives up before its batch is written is left out of it;
  after that its replies are read and dropped, so a cancelled request never
  leaves the connection out of step.

The connection is made by redis-py (so AUTH, SELECT, TLS and unix sockets
work as configured in the URL; ``make_connection`` is a pool's or a cluster
node's factory); only the byte streams are driven here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = tuple[Any, ...]
_READ_SIZE = 1 << 16


def _reply_error(message: str) -> Exception:
    from redis._parsers.base import BaseParser

    error: Exception = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error


class _Waiter:
    __slots__ = ("future", "remaining", "replies", "sent")

    def __init__(self, future: asyncio.Future[list[Any]], count: int, sent: float) -> None:
        self.future = future
        self.remaining = count
        self.replies: list[Any] = []
        self.sent = sent


class Coalescer:
    def __init__(
        self,
        make_connection: Callable[[], AbstractConnection],
        reply_timeout: float,
        max_batch: int = 4096,
    ) -> None:
        self._make_connection = make_connection
        self._reply_timeout = reply_timeout
        self._max_batch = max_batch
        self._pending: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._conn: AbstractConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: deque[_Waiter] = deque()
        self.batches = 0
        self.calls = 0

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Run commands in the next batch; replies in order, errors as values."""
        return await self.submit(commands)

    def submit(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Queue commands for the next batch; the future gets their replies.
        (Lets a caller put commands on several connections before waiting.)"""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((commands, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        try:
            # let every request of this loop turn join the batch
            await asyncio.sleep(0)
            while self._pending:
                try:
                    conn = await self._connected()
                except Exception as exc:
                    batch, self._pending = self._pending, []
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                self._write(conn, batch)
        finally:
            self._flusher = None

    def _write(
        self,
        conn: AbstractConnection,
        batch: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]],
    ) -> None:
        chunks: list[bytes] = []
        now = time.monotonic()
        for commands, future in batch:
            if future.done():  # the caller gave up before anything was sent
                continue
            for command in commands:
                chunks.append(hiredis.pack_command(command))
            self._waiting.append(_Waiter(future, len(commands), now))
            self.calls += 1
        if chunks:
            self.batches += 1
            writer = conn._writer
            assert writer is not None
            writer.write(b"".join(chunks))

    async def _connected(self) -> AbstractConnection:
        if self._conn is None:
            conn = self._make_connection()
            await conn.connect()  # type: ignore[no-untyped-call]
            self._conn = conn
            self._reader = asyncio.create_task(self._read(conn))
        return self._conn

    async def _read(self, conn: AbstractConnection) -> None:
        parser = hiredis.Reader(replyError=_reply_error)
        stream = conn._reader
        assert stream is not None
        try:
            while True:
                try:
                    data = await asyncio.wait_for(stream.read(_READ_SIZE), self._reply_timeout)
                except TimeoutError:
                    oldest = self._waiting[0].sent if self._waiting else None
                    if oldest is not None and time.monotonic() - oldest >= self._reply_timeout:
                        raise RedisTimeoutError("Timeout reading from Redis") from None
                    continue
                if not data:
                    raise RedisConnectionError("Redis closed the connection")
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    waiter = self._waiting[0]
                    waiter.replies.append(reply)
                    waiter.remaining -= 1
                    if waiter.remaining == 0:
                        self._waiting.popleft()
                        if not waiter.future.done():
                            waiter.future.set_result(waiter.replies)
        except asyncio.CancelledError:
            self._fail(conn, RedisConnectionError("The coalescer was closed"))
            raise
        except Exception as exc:
            self._fail(conn, exc)
            await conn.disconnect(nowait=True)

    def _fail(self, conn: AbstractConnection, exc: Exception) -> None:
        if self._conn is conn:
            self._conn = None
            self._reader = None
        waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            if not waiter.future.done():
                waiter.future.set_exception(exc)

    async def close(self) -> None:
        """Let the replies already asked for arrive (bounded), then disconnect."""
        deadline = time.monotonic() + self._reply_timeout
        while self._waiting and time.monotonic() < deadline:  # noqa: ASYNC110 - shutdown only
            await asyncio.sleep(0.01)
        conn, reader = self._conn, self._reader
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if conn is not None:
            await conn.disconnect(nowait=True)
        self._conn = None
