"""The retry policy (``feedsvc.delivery.retry``): Zaqar's schedule, one delay
at a time, in constant memory, with bounded numbers. No Redis needed: the
policy is plain arithmetic (delivery with it is in test_delivery.py)."""

from __future__ import annotations

import itertools
import math
import tracemalloc
from typing import Any

import pytest

from feedsvc.delivery.retry import LIMITS, RetryPolicy, effective_policy, parse, stored
from feedsvc.errors import BadRequest


def zaqar_schedule(policy: dict[str, Any]) -> list[float]:
    """Zaqar's whole list (``notification/tasks/webhook.py`` and
    ``common/consts.py``), as feedsvc built it before issue 28."""
    low = policy.get("minimum_delay", 5)
    high = policy.get("maximum_delay", 30)
    step = 5

    def linear() -> list[int]:
        return list(range(low, high, step))

    def geometric() -> list[int]:
        x_max = int((high - low) / step)
        k = math.pow(10, math.log10(high / low) / (x_max - 1))
        return [int(low * math.pow(k, a - 1)) for a in range(1, x_max + 1)]

    def exponential() -> list[int]:
        x_max = int((high - low) / step)
        k = math.pow(10, math.log10(high / low) / (x_max - 1))
        p = low / k
        return [int(p * math.pow(k, a)) for a in range(1, x_max + 1)]

    def arithmetic() -> list[int]:
        x_max = int((high - low) / step)
        d = 2.0 * (high - low) / (x_max * (x_max - 1))
        return [int(low + (a - 1) * a * d / 2) for a in range(1, x_max + 1)]

    functions = {
        "linear": linear,
        "geometric": geometric,
        "exponential": exponential,
        "arithmetic": arithmetic,
    }
    function = functions[policy.get("retry_backoff_function", "linear")]
    try:
        backoff = function() if low > 0 else linear()
    except (ZeroDivisionError, ValueError):
        backoff = linear()
    return [
        *[0.0] * policy.get("retries_with_no_delay", 3),
        *[float(low)] * policy.get("minimum_delay_retries", 3),
        *(float(d) for d in backoff),
        *[float(high)] * policy.get("maximum_delay_retries", 3),
    ]


POLICIES = [
    {},
    {"retries_with_no_delay": 1, "minimum_delay_retries": 0, "maximum_delay_retries": 0,
     "minimum_delay": 0, "maximum_delay": 10},
    *[
        {"retry_backoff_function": f, "minimum_delay": low, "maximum_delay": high,
         "retries_with_no_delay": 2, "minimum_delay_retries": 1, "maximum_delay_retries": 2}
        for f, (low, high) in itertools.product(
            ("linear", "geometric", "exponential", "arithmetic"),
            [(0, 10), (1, 11), (5, 30), (5, 16), (7, 300), (60, 3600), (20, 40)],
        )
    ],
]  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
def test_each_delay_is_zaqars(policy: dict[str, Any]) -> None:
    parsed = parse({"_retry_policy": policy}) or RetryPolicy()
    expected = zaqar_schedule(policy)
    assert [parsed.delay(n) for n in range(len(expected) + 3)] == [*expected, None, None, None]
    assert parsed.attempts == len(expected)


def test_a_delay_far_into_a_huge_schedule_costs_no_memory() -> None:
    # Zaqar's list for this policy holds 2 * 10**8 entries (1.6 GB of pointers);
    # the n-th delay is arithmetic on the policy's numbers
    policy = RetryPolicy(retries_with_no_delay=10**8, maximum_delay=10**9)
    tracemalloc.start()
    try:
        delays = [policy.delay(n) for n in (0, 10**8 - 1, 10**8 + 3, 10**8 + 5 * 10**7)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert delays == [0.0, 0.0, 5.0, 5.0 + 5 * (5 * 10**7 - 3)]
    assert peak < 100_000


def test_numbers_past_the_limits_are_refused() -> None:
    for key, (least, most) in LIMITS.items():
        with pytest.raises(BadRequest, match=f"at most {most}"):
            parse({"_retry_policy": {key: most + 1}})
        with pytest.raises(BadRequest, match="must not be negative"):
            parse({"_retry_policy": {key: least - 1}})
        with pytest.raises(BadRequest, match="must be a integer"):
            parse({"_retry_policy": {key: None}})


def test_numbers_at_the_limits_are_accepted() -> None:
    top = {"retries_with_no_delay": 100, "minimum_delay_retries": 1000, "minimum_delay": 86390,
           "maximum_delay": 86400, "maximum_delay_retries": 1000}  # fmt: skip
    assert {k: LIMITS[k][1] for k in top if k != "minimum_delay"} == {
        k: v for k, v in top.items() if k != "minimum_delay"
    }
    bottom = dict.fromkeys(LIMITS, 0) | {"maximum_delay": 10}
    for numbers in (top, bottom):
        policy = parse({"_retry_policy": numbers})
        assert {k: getattr(policy, k) for k in numbers} == numbers


def test_a_stored_policy_past_the_limits_is_held_to_them() -> None:
    # stored before the limits (or by hand): delivery reads it within them
    huge = {"retries_with_no_delay": 10**8, "maximum_delay": 10**9, "minimum_delay": None,
            "maximum_delay_retries": -4, "retry_backoff_function": "cubic"}  # fmt: skip
    policy = stored(huge)
    assert policy == RetryPolicy(
        retries_with_no_delay=100, maximum_delay=86400, maximum_delay_retries=0
    )
    assert effective_policy({"_retry_policy": huge}, {}) == policy
    assert effective_policy({}, {"_retry_policy": {"minimum_delay": "5"}}) == RetryPolicy()
