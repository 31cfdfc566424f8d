"""The storage layer's shape: one owner of the record layout (Lua included),
drivers named only inside storage/, no class too long to read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from feedsvc.storage import record
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.scripts import inline_constants, load_script, lua_dir, script_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "feedsvc"
MAX_CLASS_LINES = 300


def lua_sources() -> dict[str, str]:
    folder = lua_dir()
    return {
        entry.name: entry.read_text() for entry in folder.iterdir() if entry.name.endswith(".lua")
    }


def test_scripts_spell_no_field_name_or_key_suffix_themselves() -> None:
    """Field names and key suffixes reach the scripts only through the
    generated prelude, so renaming one in record.py/keys.py renames it in Lua."""
    owned = set(record.LUA_NAMES.values())
    offenders = []
    for name, source in lua_sources().items():
        code = "\n".join(line.split("--", 1)[0] for line in source.splitlines())
        for literal in re.findall(r"'([^']*)'", code):
            if literal in owned:
                offenders.append(f"{name}: '{literal}'")
    assert not offenders, f"spell these with the generated F_*/S_* names: {offenders}"


def test_every_generated_name_a_script_uses_exists() -> None:
    """A misspelt F_/S_ name would be a nil global in Lua, found only at run time."""
    known = set(record.lua_constants())
    used = {
        n for source in lua_sources().values() for n in re.findall(r"\b[FSH]_[A-Z_]+\b", source)
    }
    assert used, "the scripts use no generated names: the check is looking at the wrong files"
    assert used <= known, f"not named by record.lua_constants: {sorted(used - known)}"


def test_loaded_scripts_have_every_constant_written_in() -> None:
    """No constant is left a name in a loaded script (it would be a local
    every function naming it holds as an upvalue, a cost every call): the
    generated names and the scripts' own capitals set to literals."""
    for name in script_names():
        source = load_script(name).source.decode()
        code = re.sub(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"[^\"\n]*\"", "", source)
        left = set(re.findall(r"\b(?:[FSHK]|SEG)_[A-Z_]+\b|\bGC_BATCH\b|\bNEWLINE\b", code))
        assert not left, f"{name}: {sorted(left)}"
    post = load_script("post_segments").source.decode()
    assert "KEYS[1]" in post and "KEYS[K_META]" not in post


@pytest.mark.parametrize(
    ("code", "written"),
    [
        ("local A, B = 1, -2\nlocal C = 'x'\nreturn A - B .. C\n", "return 1 - (-2) .. 'x'\n"),
        # names inside strings and comments stay as they are
        ("local A = 7\nreturn 'A', \"A\", A -- A\n", "return 'A', \"A\", 7 -- A\n"),
        # a local in lower case, or set to an expression, is no constant
        (
            "local a = 1\nlocal B = 2 + 1\nreturn a, B, AB\n",
            "local a = 1\nlocal B = 2 + 1\nreturn a, B, AB\n",
        ),
        ("return F_BODY\n", "return 'b'\n"),
    ],
)
def test_inline_constants(code: str, written: str) -> None:
    assert inline_constants(code, {"F_BODY": "'b'"}) == written


def test_claim_extension_never_shortens_a_life() -> None:
    created, expires = 1_000_000, 1_060_000  # a 60 s message
    # a claim ending before the message would: the message keeps its ttl
    assert record.claim_extension(expires, created, 1_010_000, 10) == (expires, 60)
    # a claim outliving it: alive until claim expiry + grace
    assert record.claim_extension(expires, created, 1_100_000, 30) == (1_130_000, 130)


def test_no_class_in_feedsvc_is_longer_than_300_lines() -> None:
    """A class's own body, not what it inherits (docs/design.md, "Where
    things go"): inheritance is kept for a family's shared half (RedisStore
    and its drivers, each read once), and the way one class used to be spread
    over files, mixins, is what the next test forbids."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({length} lines)")
    assert not long, long


def test_no_class_in_feedsvc_declares_attributes_it_does_not_set() -> None:
    """No mixins: a class that declares an attribute without a value (a
    host's attribute it expects to be set by whatever mixes it in) is a part
    of another class in a file of its own; make it a collaborator with a
    constructor instead. Dataclasses, NamedTuples and Protocols declare their
    fields this way and are left out."""
    declared = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            bases = [ast.unparse(b) for b in node.bases]
            if any("dataclass" in d for d in decorators) or any(
                b.endswith(("Protocol", "NamedTuple", "TypedDict")) for b in bases
            ):
                continue
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and statement.value is None:
                    name = ast.unparse(statement.target)
                    declared.append(f"{path.relative_to(ROOT)}:{node.name}.{name}")
    assert not declared, declared


def test_only_storage_names_a_driver() -> None:
    """Outside feedsvc/storage/ a store is asked for by name (make_store)."""
    concrete = re.compile(r"\b(LuaStore|WatchStore|lua_store|watch_store)\b")
    found = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if "storage" not in path.relative_to(PACKAGE).parts and concrete.search(path.read_text())
    ]
    assert not found, found


def test_list_reply_decoder_reads_what_list_lua_returns() -> None:
    """One decoder per script reply: list.lua's layout (see its header)."""
    me = "d1d3e5c2-86a6-4a5e-9c7b-3c8a4d1f0b11"
    free = record.Header(7, 60, 1000, 61000, 0, 0, 0, "", me)
    out = [b"7", b"", b"", b"2", b"", b"ab" * 12, free.record(b'{"x":\n1}')]
    page = record.list_reply(out, now=2000, with_authors=True)
    assert (page.next_marker, page.missed, page.passed) == (7, 2, None)
    [message] = page.messages
    assert (message.id, message.seq, message.body) == ("ab" * 12, 7, b'{"x":\n1}')
    assert (message.ttl, message.created_ms, message.claim_id, message.claim_count) == (
        60,
        1000,
        None,
        0,
    )
    assert message.author == me
    # without authors (every list request: the store filters echo itself);
    # a claim is shown while it lasts, by the time the script was given
    held = record.Header(9, 60, 1000, 61000, 0, 5000, 1, "ef" * 12, me)
    two = [
        b"9",
        b"",
        b"5000",
        b"0",
        b"",
        b"ab" * 12,
        free.record(b"1"),
        b"cd" * 12,
        held.record(b"2"),
    ]
    page = record.list_reply(two, now=2000, with_authors=False)
    assert page.claim_ends == 5000
    first, second = page.messages
    assert (first.seq, first.body, first.author) == (7, b"1", None)
    assert (second.seq, second.body, second.claim_id, second.claim_count) == (
        9,
        b"2",
        "ef" * 12,
        1,
    )
    [_, lapsed] = record.list_reply(two, now=5000, with_authors=False).messages
    assert (lapsed.claim_id, lapsed.claim_count) == (None, 1)
    empty = [b"", b"", b"", b"0", b""]
    assert record.list_reply(empty, now=2000, with_authors=False).next_marker is None
    # an empty page at the feed's end says when a delayed message falls due
    due = [b"", b"0000000009000", b"", b"0", b""]
    waiting = record.list_reply(due, now=2000, with_authors=False)
    assert (waiting.messages, waiting.next_marker, waiting.next_due) == ([], None, 9000)
    # and, asked by a follower, how far it may pass
    passing = record.list_reply([b"", b"", b"", b"3", b"12"], now=2000, with_authors=False)
    assert (passing.next_marker, passing.missed, passing.passed) == (None, 3, 12)


def test_header_round_trips_every_field() -> None:
    header = record.Header(
        2**52, 1209600, 1_700_000_000_000, 1_700_001_209_600, 5, 6, 7, "ab" * 12, "me"
    )
    assert record.Header.decode(header.record(b"{}")) == header
    free = record.posted("me", 60, 1000, 3, delay=0)
    stored = free.record(b"[1]")
    assert record.Header.decode(stored) == free
    # fixed width, zero-padded (a script compares times as strings); no claim:
    # spaces; then the author, a newline, the body
    assert stored.startswith(b"00000000000000003 0000000060 0000000001000 0000000061000 ")
    assert stored.endswith(b" " * 25 + b"me\n[1]")
    assert len(free.fixed()) == record.FIXED
    with pytest.raises(ValueError):
        record.Header(10**17, 60, 1000, 61000, 0, 0, 0, "", "me").fixed()


def test_the_lua_header_layout_is_record_py_s() -> None:
    """The positions the scripts read a header at are generated from HEADER_FIELDS."""
    names = record.lua_header_names()
    text = record.Header(3, 60, 1000, 61000, 7, 9000, 2, "ef" * 12, "me").record(b"").decode()
    for name, value in [("SEQ", 3), ("TTL", 60), ("DUE", 7), ("CLAIM_EXPIRES", 9000)]:
        first, last = int(names[f"H_{name}"]), int(names[f"H_{name}_END"])
        assert int(text[first - 1 : last]) == value
    assert text[int(names["H_CLAIM"]) - 1 : int(names["H_CLAIM_END"])] == "ef" * 12
    assert text[int(names["H_AUTHOR"]) - 1 :] == "me\n"


LEGACY = {
    record.BODY: b"{}",
    record.TTL: b"60",
    record.CREATED: b"1000",
    record.EXPIRES: b"61000",
    record.SEQ: b"5",
    record.CLAIM: b"ef" * 12,
    record.CLAIM_EXPIRES: b"9000",
    record.CLAIM_COUNT: b"2",
    record.AUTHOR: b"me",
    record.DUE: b"0",
}


def test_row_decoder_reads_both_layouts() -> None:
    """A legacy message (a hash, a field each) reads as the same message as
    its record, and is marked legacy so that a write moves it."""
    header = record.Header(5, 60, 1000, 61000, 0, 9000, 2, "ef" * 12, "me")
    absent = [None] * len(record.ROW)
    a = record.Row.read("a" * 24, header.record(b"{}"), absent)
    b = record.Row.read("a" * 24, None, [LEGACY[f] for f in record.ROW])
    assert a is not None and b is not None
    assert (a.legacy, b.legacy) == (False, True)
    assert a.header() == b.header() == header
    assert a.message(2000) == b.message(2000)
    assert a.message(2000).claim_id == "ef" * 12
    assert record.Row.read("a" * 24, None, absent) is None
    claim = record.OFFSETS["claim"]
    assert record.holder(header.record(b"{}")[claim], None) == "ef" * 12
    assert record.holder(b"", b"ef" * 12) == "ef" * 12
    assert record.holder(b" " * 24, None) == record.holder(b"", None) == ""
    assert record.summary(header.fixed(), [None] * 3) == (1000, 61000)
    assert record.summary(b"", [b"1000", b"61000", b"5"]) == (1000, 61000)
    assert record.summary(b"", [None, None, None]) is None
    # a write moves a legacy message to its record, in the same transaction
    keys = QueueKeys.of("p", "q")
    moved = record.release_commands(keys, b)
    assert ("DEL", keys.message("a" * 24)) in moved
    assert moved[0][:2] == ("SET", keys.record("a" * 24))
    assert record.release_commands(keys, a)[0][:3] == ("SETRANGE", keys.record("a" * 24), 0)


def test_unindexed_record_is_never_a_live_message() -> None:
    stored, absent = record.unindexed("me", b"{}"), [None] * len(record.ROW)
    raw = [stored, absent]
    row = record.Row.read("a" * 24, stored, absent)
    assert row is not None and row.seq is None and row.author == b"me" and row.body == b"{}"
    assert record.live_messages(["a" * 24], raw, now=0) == [None]


@pytest.mark.parametrize("author", ["", "me", "3381af92-2b9e-11e3-b191-71861300734c"])
def test_an_unindexed_record_is_a_header_of_zeros(author: str) -> None:
    body = b'{"event": "x"}'
    expected = record.Header(0, 0, 0, 0, 0, 0, 0, "", author).record(body)
    assert record.unindexed(author, body) == expected
    assert record.Header.decode(expected) == record.Header(0, 0, 0, 0, 0, 0, 0, "", author)


def test_row_decoder_hides_unindexed_and_expired_messages() -> None:
    # a legacy row: no record, a hash of fields
    row = [b"{}", b"60", b"1000", b"61000", None, b"", b"0", b"0", b"me", b"0"]
    replies: list[object] = [None, row]
    assert record.live_messages(["a" * 24], replies, now=2000) == [None]  # not indexed yet
    row[4] = b"5"
    assert record.live_messages(["a" * 24], replies, now=2000) != [None]
    assert record.live_messages(["a" * 24], replies, now=61000) == [None]  # expired
