"""Many Server-Sent Event streams from one process, cheaply (``python -m bench.sse_client``).

The benchmark's client: asyncio Protocols on uvloop (no per-stream task, no
HTTP client library), each stream's body scanned with one regular
expression per read. Every message event it takes must carry a body stamp
``{"n": <the producer's counter>, "t": <time the POST was sent>, ...}``;
for each it records the arrival time (once per read) and the latency
``arrival - t``, and checks per stream that ``n`` goes 1, 2, 3, ...:
a jump is a **gap**, a step back or a repeat a **repeat**. A stream that
the server ends (too slow, its lifetime) is opened again with
``Last-Event-ID`` (counted as a reconnect).

It is driven over stdin, one command a line, and answers one JSON line on
stdout for each:

* (at start) ``{"ready": ..., "failed": ...}`` once every stream has its
  response head (a 200) or has failed;
* ``report T0 T1 PATH``: the events whose stamp ``t`` lies in [T0, T1):
  their latencies are written to PATH (float64, seconds), the answer gives
  their count, and also the events that *arrived* in [T0, T1), and the
  running counts (gaps, repeats, reconnects, heartbeat comments);
* ``stop`` (or the end of stdin, or ``--max-seconds``): closes every
  stream and answers the totals (events, gaps, repeats, reconnects,
  heartbeats, each stream's last ``n``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from array import array
from collections.abc import Sequence
from typing import cast

import numpy as np

from feedsvc.process import setup as process_setup

EVENT = re.compile(
    rb"id: (\d+)\r?\nevent: message\r?\n"
    rb'data: \{[^\n]*?"body":\{"n":(\d+),"t":([0-9.]+)[^\n]*\n\r?\n'
)
HEARTBEAT = b": heartbeat"
# connections being opened at once (the server's accept queue is finite)
CONNECTING_AT_ONCE = 64


class Recorder:
    """Every event's (arrival, latency, post time), for the whole process."""

    def __init__(self) -> None:
        self.arrivals = array("d")
        self.latencies = array("d")
        self.posted = array("d")
        self.gaps = 0
        self.repeats = 0
        self.heartbeats = 0
        self.reconnects = 0
        self.failures: list[str] = []


class Stream(asyncio.Protocol):
    def __init__(self, client: Client, index: int) -> None:
        self.client = client
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.body = b""
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.last_n = 0
        self.last_id: bytes | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.transport.write(self.client.request(self.last_id))

    def data_received(self, data: bytes) -> None:
        if not self.ready.done():
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.head[: self.head.find(b"\r\n")]
            data = self.head[end + 4 :]
            if b" 200 " not in status:
                self.ready.set_result(False)
                self.client.recorder.failures.append(status.decode("latin-1"))
                self.closing = True
                assert self.transport is not None
                self.transport.close()
                return
            self.ready.set_result(True)
        self.scan(data)

    def scan(self, data: bytes) -> None:
        buffer = self.body + data if self.body else data
        recorder = self.client.recorder
        if HEARTBEAT in data:
            recorder.heartbeats += data.count(HEARTBEAT)
        now = time.time()
        end = 0
        last = self.last_n
        for match in EVENT.finditer(buffer):
            n = int(match[2])
            if n == last + 1:
                last = n
            elif n > last:
                recorder.gaps += n - last - 1
                last = n
            else:
                recorder.repeats += 1
            posted = float(match[3])
            recorder.arrivals.append(now)
            recorder.latencies.append(now - posted)
            recorder.posted.append(posted)
            self.last_id = match[1]
            end = match.end()
        self.last_n = last
        rest = buffer[end:]
        start = rest.rfind(b"id: ")
        self.body = rest[start:] if start >= 0 else rest[-8:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_result(False)
            self.client.recorder.failures.append(f"closed before the head: {exc!r}")
            return
        if not self.closing and not self.client.stopping:
            self.client.recorder.reconnects += 1
            self.client.reopen(self)


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.recorder = Recorder()
        self.streams: list[Stream] = []
        self.stopping = False
        self.tasks: set[asyncio.Task[None]] = set()
        headers = "".join(f"{h}\r\n" for h in args.header)
        self.head = (
            f"GET {args.path} HTTP/1.1\r\nHost: {args.host}:{args.port}\r\n"
            f"Accept: text/event-stream\r\n{headers}"
        ).encode()

    def request(self, last_id: bytes | None) -> bytes:
        resume = b"Last-Event-ID: " + last_id + b"\r\n" if last_id is not None else b""
        return self.head + resume + b"\r\n"

    async def open(self, stream: Stream, gate: asyncio.Semaphore) -> bool:
        loop = asyncio.get_running_loop()
        async with gate:
            try:
                await loop.create_connection(lambda: stream, self.args.host, self.args.port)
            except OSError as exc:
                self.recorder.failures.append(f"connect: {exc!r}")
                return False
            return await stream.ready

    def reopen(self, old: Stream) -> None:
        stream = Stream(self, old.index)
        stream.last_n, stream.last_id = old.last_n, old.last_id
        self.streams[old.index] = stream
        task = asyncio.create_task(self._reopen(stream))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reopen(self, stream: Stream) -> None:
        await asyncio.sleep(0.05)
        await self.open(stream, asyncio.Semaphore(1))

    async def connect_all(self) -> tuple[int, int]:
        gate = asyncio.Semaphore(CONNECTING_AT_ONCE)
        self.streams = [Stream(self, i) for i in range(self.args.connections)]
        results = await asyncio.gather(*(self.open(s, gate) for s in self.streams))
        ok = sum(results)
        return ok, len(results) - ok

    def report(self, t0: float, t1: float, path: str) -> dict[str, object]:
        r = self.recorder
        posted = np.frombuffer(r.posted, dtype=np.float64)
        arrivals = np.frombuffer(r.arrivals, dtype=np.float64)
        latencies = np.frombuffer(r.latencies, dtype=np.float64)
        chosen = latencies[(posted >= t0) & (posted < t1)]
        chosen.tofile(path)
        arrived = int(np.count_nonzero((arrivals >= t0) & (arrivals < t1)))
        return {"events": int(chosen.size), "arrived": arrived, "gaps": r.gaps,
                "repeats": r.repeats, "reconnects": r.reconnects,
                "heartbeats": r.heartbeats}  # fmt: skip

    def totals(self) -> dict[str, object]:
        r = self.recorder
        return {
            "events": len(r.latencies),
            "gaps": r.gaps,
            "repeats": r.repeats,
            "reconnects": r.reconnects,
            "heartbeats": r.heartbeats,
            "failures": len(r.failures),
            "failure_examples": r.failures[:3],
            "last_n": [s.last_n for s in self.streams],
        }

    def close(self) -> None:
        self.stopping = True
        for stream in self.streams:
            stream.closing = True
            if stream.transport is not None:
                stream.transport.abort()


def say(payload: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    client = Client(args)
    ok, failed = await client.connect_all()
    say({"ready": ok, "failed": failed, "failure_examples": client.recorder.failures[:3]})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.max_seconds
    try:
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    line = await asyncio.to_thread(sys.stdin.readline)
            except TimeoutError:
                break
            words = line.split()
            if not words or words[0] == "stop":
                break
            if words[0] == "report":
                say(client.report(float(words[1]), float(words[2]), words[3]))
    finally:
        totals = client.totals()
        client.close()
        say(totals)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sse_client", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", required=True, help="e.g. /v2/queues/q/messages?echo=true")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop by itself then")
    args = parser.parse_args(argv)
    process_setup.raise_open_files_limit()
    import uvloop

    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
