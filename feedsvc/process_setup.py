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

The young generations keep Python's thresholds. A first threshold of 20,000
instead of 700 made their collections rarer and longer (median 4-6 ms
instead of 0.1-0.2 ms with 5,000 clients) and spent less time collecting,
but neither the rate served to 64 clients nor the 5,000 clients' p99 moved
by more than the run-to-run noise (three alternating rounds by hand, and
``python -m bench pool`` twice on each side).
"""

from __future__ import annotations

import contextlib
import gc
import resource

#: Collections of the middle generation between two of the oldest (Python: 10).
OLDEST_EVERY = 1000


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
