"""Load the Lua scripts in ``lua/`` by name.

Each ``lua/<name>.lua`` is one script; ``lua/_lib.lua`` holds the helpers
they share (expiry GC, the fixed KEYS layout) and is prepended to every
script, so a script is self-contained once loaded and its SHA1 is known
before talking to Redis. The folder sits at the top of the source tree; a
wheel carries it as ``feedsvc/lua`` (see ``pyproject.toml``), so both places
are looked up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

LIB = "_lib"


@dataclass(frozen=True, slots=True)
class LuaScript:
    name: str
    source: bytes
    sha: str


def lua_dir() -> Traversable:
    installed = resources.files("feedsvc") / "lua"
    if installed.is_dir():
        return installed
    source_tree = Path(__file__).resolve().parents[2] / "lua"
    if source_tree.is_dir():
        return source_tree
    raise FileNotFoundError("the feedsvc Lua scripts are missing (lua/ folder)")


@cache
def load_script(name: str) -> LuaScript:
    folder = lua_dir()
    lib = (folder / f"{LIB}.lua").read_bytes()
    body = (folder / f"{name}.lua").read_bytes()
    source = lib + b"\n" + body
    return LuaScript(name, source, hashlib.sha1(source).hexdigest())


def script_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in lua_dir().iterdir()
        if entry.name.endswith(".lua") and not entry.name.startswith("_")
    )
