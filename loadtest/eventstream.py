"""Reading a Server-Sent Events stream off a raw socket: HTTP/1.1 chunked
framing and the event-stream format, as byte-level state machines.

Pure logic, no I/O: the Locust streamer and the benchmark's many-stream
client feed whatever bytes a socket gave them, cut anywhere, and get whole
events back. Both are written for what feedsvc sends (LF line ends, one
``data:`` line per event) but follow the formats: CRLF and CR line ends,
several ``data:`` lines, comments, ``retry:``; chunk extensions and
trailers are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass


class FramingError(ValueError):
    """The bytes are not HTTP/1.1 chunked framing."""


class ChunkedDecoder:
    """``feed(raw) -> body bytes`` for a ``Transfer-Encoding: chunked`` body."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of the current chunk still to come
        self._after_data = False  # its CRLF still to come
        self.done = False  # the last (empty) chunk was read

    def feed(self, raw: bytes) -> bytes:
        self._buffer += raw
        out: list[bytes] = []
        while not self.done:
            if self._left:
                piece = self._buffer[: self._left]
                self._buffer = self._buffer[self._left :]
                self._left -= len(piece)
                out.append(piece)
                if self._left:
                    break
                self._after_data = True
            if self._after_data:
                if len(self._buffer) < 2:
                    break
                if self._buffer[:2] != b"\r\n":
                    raise FramingError(f"no CRLF after a chunk: {self._buffer[:16]!r}")
                self._buffer = self._buffer[2:]
                self._after_data = False
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                if len(self._buffer) > 1024:
                    raise FramingError("a chunk size line over 1 KiB")
                break
            size_text = self._buffer[:line_end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise FramingError(f"bad chunk size {size_text[:16]!r}") from None
            self._buffer = self._buffer[line_end + 2 :]
            if size == 0:
                self.done = True  # trailers, if any, are not read
                break
            self._left = size
        return b"".join(out)


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event: its type (``message`` if none was given), data
    (``data:`` lines joined by LF) and the stream's last event id then."""

    type: str
    data: str
    id: str | None


class EventStreamParser:
    """``feed(body bytes) -> [Event]``, as the HTML standard's event-stream
    interpretation: a blank line dispatches, ``id`` persists across events,
    an event with no data is not dispatched, ``retry`` is kept."""

    def __init__(self) -> None:
        self._pending = b""
        self._after_cr = False  # the last byte fed was CR: a following LF is no new line
        self._data: list[str] = []
        self._type = ""
        self.last_id: str | None = None
        self.retry_ms: int | None = None
        self._first = True  # a leading BOM is dropped

    def feed(self, raw: bytes) -> list[Event]:
        if self._after_cr and raw.startswith(b"\n"):
            raw = raw[1:]
        self._after_cr = raw.endswith(b"\r")
        text = self._pending + raw
        events: list[Event] = []
        start = 0
        while True:
            cr, lf = text.find(b"\r", start), text.find(b"\n", start)
            if cr < 0 and lf < 0:
                break
            end = lf if cr < 0 or 0 <= lf < cr else cr
            step = 2 if text[end : end + 2] == b"\r\n" else 1
            event = self._line(text[start:end].decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
            start = end + step
        self._pending = text[start:]
        return events

    def _line(self, line: str) -> Event | None:
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        if line == "":
            if not self._data:
                self._type = ""
                return None
            event = Event(self._type or "message", "\n".join(self._data), self.last_id)
            self._data, self._type = [], ""
            return event
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._type = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None
