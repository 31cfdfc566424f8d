"""bench/claims_layout.py runs and prints its ratios (a tiny run on the
test Redis: the numbers themselves are not judged here)."""

from __future__ import annotations

import pytest

from bench import claims_layout


async def test_the_claims_bench_prints_both_layouts_and_their_ratio(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await claims_layout.run(redis_url, 200, 3)
    out = capsys.readouterr().out
    assert out.count("per claim of 10:") == 2
    assert out.count("segments / records: CPU") == claims_layout.ROUNDS
