"""The two loops: ``make test`` runs every test, ``make test-fast`` the ones
its marker expression (the Makefile's FAST_TESTS) keeps. A marker misspelt
there would deselect nothing, silently (``--strict-markers`` does not read
``-m``), and the markers conftest.py sets by rule must land where it says."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.conftest import FULL_RUN_DRIVERS, REPO_ROOT


def declared_markers() -> set[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    lines = config["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":", 1)[0] for line in lines}


def test_the_fast_loop_names_only_declared_markers() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    found = re.search(r"^FAST_TESTS = (.+)$", makefile, re.MULTILINE)
    assert found is not None
    named = set(re.findall(r"\bnot (\w+)", found.group(1)))
    assert named == {"cluster", "process", "slow", "full_driver", "keystone"}
    assert named <= declared_markers()


def test_a_run_on_a_full_run_driver_is_marked_so(
    driver: str, request: pytest.FixtureRequest
) -> None:
    marked = request.node.get_closest_marker("full_driver") is not None
    assert marked == (driver in FULL_RUN_DRIVERS)
