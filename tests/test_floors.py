"""feedsvc on the lowest aiohttp and redis that pyproject.toml allows.

The floors are read from pyproject.toml (one source of truth), installed
into a throwaway venv that shares every other package with this one, and
the address guard's, the API's and the encrypted queues' tests run there.
So a floor is a version this suite really ran on, not a guess (aiohttp
3.13 cannot even import feedsvc: it has no ``web.RequestKey``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.process  # pip, a venv, and a pytest of its own

FLOORED = ("aiohttp", "redis")


def floors() -> dict[str, str]:
    """The lower bound pyproject.toml gives each of FLOORED."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    found = {}
    for dependency in dependencies:
        match = re.match(r"^([a-z-]+)(?:\[[^\]]*\])?>=([0-9][^,;\s]*)", dependency)
        if match and match[1] in FLOORED:
            found[match[1]] = match[2]
    return found


@pytest.mark.timeout(900)
def test_feedsvc_works_on_its_lowest_aiohttp_and_redis(tmp_path: Path) -> None:
    pins = floors()
    assert sorted(pins) == sorted(FLOORED), pins
    venv = tmp_path / "floor"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
         *(f"{name}=={version}" for name, version in pins.items())],
        check=True, timeout=300,
    )  # fmt: skip
    # everything else (and feedsvc itself, installed editable) from this venv,
    # after the floors on the path
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "zz_this_venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    shown = subprocess.run(
        [python, "-c", "import aiohttp, redis; print(aiohttp.__version__, redis.__version__)"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert shown == [pins["aiohttp"], pins["redis"]]
    tests = ["tests/test_guard.py", "tests/test_api.py", "tests/test_encryption.py"]
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-m",
         "not process and not cluster and not slow", *tests],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\d+ passed", run.stdout), run.stdout[-3000:]
