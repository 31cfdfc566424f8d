"""Zaqar's retry policy (``notification/tasks/webhook.py``), as a schedule.

After a failed attempt, the next one waits ``schedule[n]`` seconds, where n
counts the failures so far: first ``retries_with_no_delay`` immediate
retries, then ``minimum_delay_retries`` at ``minimum_delay``, then the
back-off function's delays from ``minimum_delay`` towards ``maximum_delay``,
then ``maximum_delay_retries`` at ``maximum_delay``; past the end the message
is given up on (counted as a failure) and delivery moves to the next one.

Zaqar sleeps through this schedule in a thread; feedsvc stores the attempt
count and the next attempt's time with the subscription, so a worker that
takes over continues the schedule where the last one stopped.

The policy is the subscription's ``options._retry_policy``, else the
queue's ``_retry_policy`` metadata; a queue policy with
``ignore_subscription_override`` wins over the subscription's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

RETRIES_WITH_NO_DELAY = 3
MINIMUM_DELAY_RETRIES = 3
MINIMUM_DELAY = 5
MAXIMUM_DELAY = 30
MAXIMUM_DELAY_RETRIES = 3
LINEAR_INTERVAL = 5


def _linear(low: int, high: int, step: int) -> list[int]:
    return list(range(low, high, step))


def _geometric(low: int, high: int, step: int) -> list[int]:
    x_max = int((high - low) / step)
    k = math.pow(10, math.log10(high / low) / (x_max - 1))
    return [int(low * math.pow(k, a - 1)) for a in range(1, x_max + 1)]


def _exponential(low: int, high: int, step: int) -> list[int]:
    x_max = int((high - low) / step)
    k = math.pow(10, math.log10(high / low) / (x_max - 1))
    p = low / k
    return [int(p * math.pow(k, a)) for a in range(1, x_max + 1)]


def _arithmetic(low: int, high: int, step: int) -> list[int]:
    x_max = int((high - low) / step)
    d = 2.0 * (high - low) / (x_max * (x_max - 1))
    return [int(low + (a - 1) * a * d / 2) for a in range(1, x_max + 1)]


BACKOFF: dict[str, Callable[[int, int, int], list[int]]] = {
    "linear": _linear,
    "arithmetic": _arithmetic,
    "geometric": _geometric,
    "exponential": _exponential,
}


def effective_policy(options: dict[str, Any], queue_metadata: dict[str, Any]) -> dict[str, Any]:
    """Zaqar's choice between the subscription's and the queue's policy."""
    mine = options.get("_retry_policy") or {}
    queue = queue_metadata.get("_retry_policy") or {}
    if not isinstance(mine, dict):
        mine = {}
    if not isinstance(queue, dict):
        queue = {}
    if mine.get("ignore_subscription_override") or queue.get("ignore_subscription_override"):
        return queue
    return mine or queue


def schedule(policy: dict[str, Any]) -> list[float]:
    """The delays, in seconds, before each retry."""
    low = int(policy.get("minimum_delay", MINIMUM_DELAY))
    high = int(policy.get("maximum_delay", MAXIMUM_DELAY))
    function = BACKOFF.get(str(policy.get("retry_backoff_function", "linear")), _linear)
    try:
        backoff = function(low, high, LINEAR_INTERVAL) if low > 0 else _linear(low, high, 5)
    except (ZeroDivisionError, ValueError):
        backoff = _linear(low, high, LINEAR_INTERVAL)
    return [
        *[0.0] * int(policy.get("retries_with_no_delay", RETRIES_WITH_NO_DELAY)),
        *[float(low)] * int(policy.get("minimum_delay_retries", MINIMUM_DELAY_RETRIES)),
        *(float(d) for d in backoff),
        *[float(high)] * int(policy.get("maximum_delay_retries", MAXIMUM_DELAY_RETRIES)),
    ]
