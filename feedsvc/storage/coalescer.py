"""Coalesce concurrent Redis calls into shared pipelines (auto-pipelining).

Requests that arrive in the same event-loop turn (and while every connection
is busy) put their commands into one pending batch; a flusher sends the whole
batch as one pipeline, in one socket write, and hands each caller its own
slice of the replies. It is what ioredis calls auto-pipelining: per request,
redis-py's fixed cost (a pool checkout, a send, a read loop under a timeout)
is paid once per batch instead.

Guarantees:

* Each caller gets exactly the replies to its own commands, in order;
  error replies come back as exception values in that caller's slice only
  (one request's NOSCRIPT or WRONGTYPE does not fail the others).
* Commands of one caller are sent contiguously and in order; batches are
  sent in the order they were formed.
* A connection failure fails every caller of that batch (503), never a
  caller of another batch.
* A caller that gives up (cancelled, timed out) before its batch is sent
  is left out of it; once sent, the batch runs to completion in its own
  task, so a cancelled request never leaves a connection half-read.
* At most ``slots`` batches are in flight (the shared connection gate);
  while all are busy, new calls wait in the next batch, which is what makes
  batches grow under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

Command = tuple[Any, ...]


class Coalescer:
    def __init__(self, redis: Redis, gate: asyncio.Semaphore, max_batch: int = 1024) -> None:
        self._redis = redis
        self._gate = gate
        self._max_batch = max_batch
        self._pending: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.commands = 0
        self.calls = 0

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Run commands in the next batch; replies in order, errors as values."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((commands, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._pending:
                await self._gate.acquire()
                batch = [item for item in self._pending[: self._max_batch] if not item[1].done()]
                del self._pending[: self._max_batch]
                if not batch:
                    self._gate.release()
                    continue
                task = asyncio.create_task(self._send(batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        finally:
            self._flusher = None

    async def _send(self, batch: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for commands, _ in batch:
                for command in commands:
                    pipe.execute_command(*command)
            self.batches += 1
            self.calls += len(batch)
            self.commands += len(pipe)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except BaseException as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            start = 0
            for commands, future in batch:
                end = start + len(commands)
                if not future.done():
                    future.set_result(replies[start:end])
                start = end
        finally:
            self._gate.release()

    async def close(self) -> None:
        """Let batches already sent finish."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
