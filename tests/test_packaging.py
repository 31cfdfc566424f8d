"""The wheel carries the Lua scripts, the console's files and py.typed, and an
installed copy finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from feedsvc.api.console import ASSETS
from tests.conftest import REPO_ROOT, build_wheel

pytestmark = pytest.mark.process  # pip wheel


def test_wheel_ships_lua_scripts_that_an_installed_copy_finds(tmp_path: Path) -> None:
    wheel = build_wheel(REPO_ROOT, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    expected = sorted(p.name for p in (REPO_ROOT / "lua").glob("*.lua"))
    assert sorted(n.split("/")[-1] for n in names if n.startswith("feedsvc/lua/")) == expected
    assert "feedsvc/py.typed" in names
    console = sorted(n.removeprefix("feedsvc/console/") for n in names if "/console/" in n)
    assert console == sorted(ASSETS), console

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "from feedsvc.storage.scripts import lua_dir, load_script, script_names;"
        "print(lua_dir()); print(','.join(script_names())); load_script('post');"
        "from feedsvc.api.console import ASSETS, asset_bytes;"
        "print(sum(len(asset_bytes(name)) for name in ASSETS))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    folder, scripts, console_size = result.stdout.split()
    assert Path(folder).is_relative_to(site)
    assert scripts.split(",") == sorted(n[:-4] for n in expected if not n.startswith("_"))
    source = REPO_ROOT / "feedsvc" / "console"
    assert int(console_size) == sum((source / name).stat().st_size for name in ASSETS)
