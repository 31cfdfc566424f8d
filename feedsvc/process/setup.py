"""How a serving process sets itself up for many clients: its open files
limit and Python's cycle collector.

**Open files.** Every client connection is a file descriptor, and the soft
limit a process starts with is often 1,024 (systemd's default, many shells'),
while the hard limit is far higher. :func:`raise_open_files_limit` raises the
soft limit to the hard one, as Go's runtime and nginx's
``worker_rlimit_nofile`` do, so that the 1,025th client is not refused with
"Too many open files" on a machine that would allow it. The limit in force is
``process_max_fds`` in ``/metrics``.

**The cycle collector.** Python frees almost every object by reference
counting the moment it is no longer used; the cycle collector (:mod:`gc`) is
for the rest, objects that refer to each other in a cycle. It sorts objects
into three generations and collects the youngest often and cheaply; the
oldest, every object of the process, only when ten collections of the middle
one have gone by and the objects moved into the oldest since its last
collection are more than a quarter of it.

With many keep-alive clients that second condition holds all the time.
aiohttp keeps a connection's last request and response, and the few dozen
objects they hold, alive until the connection's next request arrives, so
each request leaves objects that outlive the young generations and are moved
into the oldest, there to be freed by their reference count a second later.
Measured with 5,000 paced clients (docs/BENCHMARKS.md, "The cause: the
cycle collector"): about 38 live objects per connection, the oldest
generation collected every few seconds, each time a pause of 20-330 ms in
which no request moved; the process, busy collecting, then served less than
half of what it serves to 100 clients, and the latency grew until clients
timed out.

:func:`settle_heap` therefore

* collects once and freezes everything made at start-up (modules, the app,
  its routes, the store): it lives as long as the process, and a frozen
  object is never walked again;
* raises the third threshold from 10 to :data:`OLDEST_EVERY`: the oldest
  generation is collected after that many collections of the middle one
  (and still only under the quarter rule above), which at full load is
  minutes apart rather than seconds. Nothing is left uncollected: garbage
  cycles are almost always found young, where nothing changed; a cycle that
  became garbage after it was moved to the oldest generation waits for that
  collection. Posts of messages made no garbage cycles at all, nor did
  the bench's hello (looked for with ``gc.DEBUG_SAVEALL`` under load).
  ``tests/test_process_setup.py`` counts the collections; ``python_gc_*``
  in ``/metrics`` shows them in production.

**The young generations on a clock.** Python collects the youngest
generation when the objects made since its last collection, less those
freed since, pass 700: a *net* count. With thousands of keep-alive clients
every request frees about as many objects as it makes (the previous
request's, which aiohttp kept until now and which have long been moved to
an older generation), so the count stays near zero while the youngest
generation, the objects made since, grows and grows. Measured with 5,000
clients paced at 2,400 POSTs a second (``gc.callbacks`` timing each
collection and counting the objects it met): a young collection that met
142,637 objects and took 55 ms, then one of the middle generation holding
their survivors, 105,350 objects, 64 ms; in three runs the longest
collection took 92, 81 and 2.4 ms and the p99 was 188, 95 and 3.2 ms.

:class:`YoungCollections` therefore collects the young generations every
:data:`YOUNG_EVERY` seconds unless Python collected since the last tick,
choosing which of the two as Python does (the middle one once the youngest
was collected more than ``threshold1`` times). A collection so meets at
most what the last 10 ms made. The same three runs, alternated with those
above: longest collection 4.8, 7.1 and 5.5 ms, p99 4.1, 4.7 and 3.4 ms.
With 64 clients at full load Python collects every few milliseconds by
itself and the clock adds nothing (4.9-5.5 µs of collecting per POST, as
without it). The oldest generation keeps the count above
(:data:`OLDEST_EVERY` collections of the middle one): the clock's
collections of the middle generation count towards it, and once it is due
the clock collects the oldest generation itself, as Python would at a
collection of its own (which the clock's leave few occasions for). Python's
quarter rule is not applied there: with many clients it holds anyway, each
request moving its objects into the oldest generation. While no request
arrives the clock
slows down to a tick every 100 ms: an idle process then spends 0.2 % of
a core on it, against 0.9 % for a tick every 10 ms (a 10 ms timer alone
costs 0.8 % here).

Tried and not kept: raising the first threshold as well (to 10,000, the
clock then doing nearly all young collections) cut the rate served flat
out to 5,000 clients from 5,150-5,580 to 3,800-4,700 requests a second: a
saturated loop runs its timers late, so the collections came fewer and
bigger. A first threshold of 20,000 without the clock made young
collections rarer and longer (median 4-6 ms instead of 0.1-0.2 ms with
5,000 clients) and moved neither the rate served to 64 clients nor the
5,000 clients' p99 beyond the noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
from collections.abc import Callable

#: Collections of the middle generation between two of the oldest (Python: 10).
OLDEST_EVERY = 1000
#: Seconds between two collections of the young generations (at most) while
#: requests arrive ...
YOUNG_EVERY = 0.01
#: ... and at most this long once none do: an idle process wakes ten times
#: a second, not a hundred (each wake-up costs the CPU it costs), and the
#: first collection after a quiet spell meets at most what 100 ms made.
YOUNG_EVERY_IDLE = 0.1


def raise_open_files_limit() -> None:
    """Soft limit of open files up to the hard one (where the system lets us)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def settle_heap() -> None:
    """Freeze what start-up made and set the collector's thresholds: call it
    once the service is set up, before it accepts connections."""
    gc.collect()
    gc.freeze()
    youngest, middle, _ = gc.get_threshold()
    gc.set_threshold(youngest, middle, OLDEST_EVERY)


class YoungCollections:
    """Collects the young generations on the event loop's clock (and the
    oldest when its count is due; see the module's docstring): every
    :data:`YOUNG_EVERY` seconds, unless Python collected meanwhile.
    ``activity()`` counts what the process has served so far; while it
    stays the same, the ticks come twice as far apart each time, up to
    :data:`YOUNG_EVERY_IDLE`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, activity: Callable[[], int]) -> None:
        self._loop = loop
        self._activity = activity
        self._active = activity()
        self._every = YOUNG_EVERY
        self._seen = _collections()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._timer = self._loop.call_later(YOUNG_EVERY, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self.tick(), self._tick)

    def tick(self) -> float:
        """Collect, as one tick of the clock does; the seconds to the next."""
        self.collect()
        active = self._activity()
        if active != self._active:
            self._every = YOUNG_EVERY
        else:
            self._every = min(self._every * 2, YOUNG_EVERY_IDLE)
        self._active = active
        return self._every

    def collect(self) -> None:
        """Collect the generation Python would, unless Python collected any
        since the last time: the oldest too, when its count is due, since
        Python weighs it only at a collection of its own, which the clock's
        leave few occasions for."""
        if _collections() == self._seen:
            _, middle, oldest = gc.get_threshold()
            _, since_young, since_middle = gc.get_count()
            if since_middle > oldest:
                gc.collect(2)
            else:
                gc.collect(1 if since_young > middle else 0)
        self._seen = _collections()


def _collections() -> int:
    """Collections of any generation since the process started."""
    return sum(stats["collections"] for stats in gc.get_stats())
