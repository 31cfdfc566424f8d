"""Load the Lua scripts in ``lua/`` by name.

Each ``lua/<name>.lua`` is one script; ``lua/_lib.lua`` holds the helpers
they share (expiry GC, the fixed KEYS layout) and is prepended to every
script, so a script is self-contained once loaded and its SHA1 is known
before talking to Redis. Of the library's functions a script gets only
those it uses (:func:`used_library`): Redis runs a script's whole text on
every call, and each ``local function`` is a closure made anew each time.

Constants are written in where a script names them (:func:`inline_constants`):
the generated names (``record.lua_constants()``: F_* the record's fields,
S_* the key suffixes, H_* the header's positions, SEG_* the segment
layout's) and every top-level ``local`` in capitals set to literals (``local
K_META, K_SEQ = 1, 2``). A constant left a local would be an upvalue of
every function that names it, and a closure costs Redis about 35 ns an
upvalue a call: written in, the segment post's library costs 10-12 µs a
call instead of 13-18 µs (docs/design-compact-storage.md).

The folder sits at the top of the source tree; a wheel carries it as
``feedsvc/lua`` (see ``pyproject.toml``), so both places are looked up.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from feedsvc.storage.record import lua_constants

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


FUNCTION = re.compile(r"^local function (\w+)", re.MULTILINE)
LOCALS = re.compile(r"^local ((?:\w+\s*,\s*)*\w+)\s*=", re.MULTILINE)
COMMENT = re.compile(r"--[^\n]*")
LITERAL = r"(?:-?\d+|'(?:\\.|[^'\\\n])*')"
#: a top-level local in capitals set to literals: a constant
CONSTANT = re.compile(
    rf"^local ([A-Z][A-Z0-9_]*(?:, [A-Z][A-Z0-9_]*)*) = ({LITERAL}(?:, {LITERAL})*)\n",
    re.MULTILINE,
)
#: what a name is looked for among: comments and strings are passed over whole
TOKEN = re.compile(r"""--[^\n]*|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"|\b[A-Za-z_]\w*\b""")


def _defined(block: str) -> list[str]:
    """The names a library block defines: its functions and top-level locals."""
    constants = [n.strip() for group in LOCALS.findall(block) for n in group.split(",")]
    return FUNCTION.findall(block) + constants


def used_library(lib: str, body: str) -> str:
    """The library's blocks (text between blank lines) that the script body
    needs: each block whose functions or constants the body or a needed
    block's code mentions (a constant costs a call too: a string built,
    e.g. a key name), and a block that defines nothing (a comment) never."""
    blocks = lib.split("\n\n")
    defines = {i: _defined(block) for i, block in enumerate(blocks)}
    keep: set[int] = set()
    todo = [body]
    while todo:
        code = COMMENT.sub("", todo.pop())
        for i, names in defines.items():
            if i not in keep and any(re.search(rf"\b{n}\b", code) for n in names):
                keep.add(i)
                todo.append(blocks[i])
    return "\n\n".join(blocks[i] for i in sorted(keep))


def inline_constants(code: str, constants: dict[str, str]) -> str:
    """code with each constant's definition dropped and its name, wherever
    code says it (not in a comment or a string), written as its value."""
    constants = dict(constants)
    for names, values in CONSTANT.findall(code):
        constants.update(zip(names.split(", "), re.findall(LITERAL, values), strict=True))
    # a negative number in brackets: "x -N" must not become the comment "x --1"
    written = {n: f"({v})" if v.startswith("-") else v for n, v in constants.items()}
    code = CONSTANT.sub("", code)
    return TOKEN.sub(lambda m: written.get(m.group(0), m.group(0)), code)


@cache
def load_script(name: str) -> LuaScript:
    folder = lua_dir()
    lib = (folder / f"{LIB}.lua").read_text()
    body = (folder / f"{name}.lua").read_text()
    code = inline_constants(f"{used_library(lib, body)}\n{body}", lua_constants())
    source = f"-- {name}.lua, as feedsvc/storage/scripts.py loads it\n{code}".encode()
    return LuaScript(name, source, hashlib.sha1(source).hexdigest())


def script_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in lua_dir().iterdir()
        if entry.name.endswith(".lua") and not entry.name.startswith("_")
    )
