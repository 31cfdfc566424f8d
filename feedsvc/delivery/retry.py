"""Zaqar's retry policy (``notification/tasks/webhook.py``): its one owner.

Both places that take a ``_retry_policy`` (a subscription's options, a
queue's metadata) check it with ``parse``; the delivery runner reads the
stored one with ``effective_policy`` and asks it for one delay at a time.

After a failed attempt, the next one waits ``delay(n)`` seconds, where n
counts the failures so far: first ``retries_with_no_delay`` immediate
retries, then ``minimum_delay_retries`` at ``minimum_delay``, then the
back-off function's delays from ``minimum_delay`` towards ``maximum_delay``,
then ``maximum_delay_retries`` at ``maximum_delay``; past the end
(``delay`` is None) the message is given up on (counted as a failure) and
delivery moves to the next one.

Zaqar builds the whole schedule as a list (and sleeps through it in a
thread); here the n-th delay is computed directly, in constant time and
memory, and every number is bounded (``LIMITS``): Zaqar's unbounded
numbers let one policy make a schedule of a hundred million entries, on
every attempt.

Zaqar sleeps in a thread; feedsvc stores the attempt count and the next
attempt's time with the subscription, so a worker that takes over continues
the schedule where the last one stopped.

The policy is the subscription's ``options._retry_policy``, else the
queue's ``_retry_policy`` metadata; a queue policy with
``ignore_subscription_override`` wins over the subscription's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from feedsvc.errors import BadRequest

#: Zaqar's defaults (``zaqar/common/consts.py``).
DEFAULTS = {
    "retries_with_no_delay": 3,
    "minimum_delay_retries": 3,
    "minimum_delay": 5,
    "maximum_delay": 30,
    "maximum_delay_retries": 3,
}
#: The inclusive bounds of each number (Zaqar has none). Immediate retries
#: are few (each one hits the receiver at once); a delay is at most a day.
LIMITS = {
    "retries_with_no_delay": (0, 100),
    "minimum_delay_retries": (0, 1000),
    "minimum_delay": (0, 86400),
    "maximum_delay": (0, 86400),
    "maximum_delay_retries": (0, 1000),
}
BACKOFF_FUNCTIONS = ("linear", "arithmetic", "exponential", "geometric")
LINEAR_INTERVAL = 5


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retries_with_no_delay: int = DEFAULTS["retries_with_no_delay"]
    minimum_delay_retries: int = DEFAULTS["minimum_delay_retries"]
    minimum_delay: int = DEFAULTS["minimum_delay"]
    maximum_delay: int = DEFAULTS["maximum_delay"]
    maximum_delay_retries: int = DEFAULTS["maximum_delay_retries"]
    backoff: str = "linear"
    ignore_subscription_override: bool = False

    def _backoff_length(self) -> int:
        low, high = self.minimum_delay, self.maximum_delay
        if self._backoff_is_linear():
            return len(range(low, high, LINEAR_INTERVAL))
        return int((high - low) / LINEAR_INTERVAL)

    def _backoff_is_linear(self) -> bool:
        # Zaqar falls back to linear when the function cannot be computed:
        # a zero minimum (log of 0) or fewer than two steps (division by 0)
        low, high = self.minimum_delay, self.maximum_delay
        return self.backoff == "linear" or low <= 0 or int((high - low) / LINEAR_INTERVAL) < 2

    def _backoff_delay(self, i: int) -> int:
        """The i-th (from 0) delay of the back-off, as Zaqar's list has it."""
        low, high = self.minimum_delay, self.maximum_delay
        if self._backoff_is_linear():
            return low + i * LINEAR_INTERVAL
        x_max = int((high - low) / LINEAR_INTERVAL)
        if self.backoff == "arithmetic":
            d = 2.0 * (high - low) / (x_max * (x_max - 1))
            return int(low + i * (i + 1) * d / 2)
        k = math.pow(10, math.log10(high / low) / (x_max - 1))
        if self.backoff == "geometric":
            return int(low * math.pow(k, i))
        return int(low / k * math.pow(k, i + 1))  # exponential

    @property
    def attempts(self) -> int:
        """How many retries the policy allows in all."""
        return (
            self.retries_with_no_delay
            + self.minimum_delay_retries
            + self._backoff_length()
            + self.maximum_delay_retries
        )

    def delay(self, failures: int) -> float | None:
        """Seconds before the retry after that many failures; None: give up."""
        n = failures
        if n < 0:
            return 0.0
        if n < self.retries_with_no_delay:
            return 0.0
        n -= self.retries_with_no_delay
        if n < self.minimum_delay_retries:
            return float(self.minimum_delay)
        n -= self.minimum_delay_retries
        length = self._backoff_length()
        if n < length:
            return float(self._backoff_delay(n))
        n -= length
        if n < self.maximum_delay_retries:
            return float(self.maximum_delay)
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(metadata: Any) -> RetryPolicy | None:
    """The ``_retry_policy`` of options or queue metadata (None if there is
    none), checked with Zaqar's words plus feedsvc's bounds: BadRequest."""
    policy = metadata.get("_retry_policy") if isinstance(metadata, dict) else None
    if policy and not isinstance(policy, dict):
        raise BadRequest("retry_policy must be a dict.")
    if not policy:
        return None
    numbers: dict[str, int] = {}
    for key, (least, most) in LIMITS.items():
        if key not in policy:
            continue
        value = policy[key]
        if not _is_int(value):  # null too: Zaqar answers it with a 500
            raise BadRequest(f"Retry policy: {key} must be a integer.")
        if value < least:
            raise BadRequest(f"Retry policy: {key} must not be negative.")
        if value > most:
            raise BadRequest(f"Retry policy: {key} must be at most {most}.")
        numbers[key] = value
    function = policy.get("retry_backoff_function")
    if function and not isinstance(function, str):
        raise BadRequest("retry_backoff_function must be a string.")
    if function and function not in BACKOFF_FUNCTIONS:
        raise BadRequest("invalid retry_backoff_function.")
    ignore = policy.get("ignore_subscription_override")
    if ignore and not isinstance(ignore, bool):
        raise BadRequest("ignore_subscription_override must be a boolean.")
    low = numbers.get("minimum_delay", DEFAULTS["minimum_delay"])
    high = numbers.get("maximum_delay", DEFAULTS["maximum_delay"])
    if high < low:
        raise BadRequest("minimum_delay must less than maximum_delay.")
    if high - low < 2 * LINEAR_INTERVAL:
        raise BadRequest("invalid minimum_delay and maximum_delay.")
    return _policy(numbers, function or "linear", bool(ignore))


def stored(policy: Any) -> RetryPolicy:
    """A policy as stored, read leniently: one stored before ``parse`` had
    bounds (or by hand) is held to them, and what is not a number is the
    default, so delivery never fails on its policy."""
    if not isinstance(policy, dict):
        return RetryPolicy()
    numbers = {}
    for key, (least, most) in LIMITS.items():
        value = policy.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            numbers[key] = min(max(value, least), most)
    function = policy.get("retry_backoff_function")
    return _policy(
        numbers,
        function if function in BACKOFF_FUNCTIONS else "linear",
        policy.get("ignore_subscription_override") is True,
    )


def _policy(numbers: dict[str, int], backoff: str, ignore: bool) -> RetryPolicy:
    """A policy of the numbers given, Zaqar's defaults for the others."""
    given = DEFAULTS | numbers
    return RetryPolicy(
        retries_with_no_delay=given["retries_with_no_delay"],
        minimum_delay_retries=given["minimum_delay_retries"],
        minimum_delay=given["minimum_delay"],
        maximum_delay=given["maximum_delay"],
        maximum_delay_retries=given["maximum_delay_retries"],
        backoff=backoff,
        ignore_subscription_override=ignore,
    )


def effective_policy(options: dict[str, Any], queue_metadata: dict[str, Any]) -> RetryPolicy:
    """Zaqar's choice between the subscription's and the queue's policy."""
    mine = options.get("_retry_policy") or {}
    queue = queue_metadata.get("_retry_policy") or {}
    if not isinstance(mine, dict):
        mine = {}
    if not isinstance(queue, dict):
        queue = {}
    if mine.get("ignore_subscription_override") or queue.get("ignore_subscription_override"):
        return stored(queue)
    return stored(mine or queue)
