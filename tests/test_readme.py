"""Every example in README.md and in the guides under docs/ runs as
written, against a live feedsvc; every link between them leads somewhere.

The examples are the blocks fenced as ``sh``, ``bash``, ``console`` or
``python``. Each runs verbatim, in an empty directory, against a
``feedsvc serve`` of its own (default settings, its own embedded Redis, a
free port), the way a reader runs it after ``make run``:

* ``console``: a bash session. ``$ `` starts a command (``> `` continues it
  after a trailing backslash); the lines up to the next ``$ `` are what the
  command prints, where ``...`` stands for any text (as doctest's ELLIPSIS).
  Every command must exit 0 and print that; a command shown with no output
  must print nothing.
* ``sh`` (run by ``sh -e``: POSIX only), ``bash`` (``bash -e -o pipefail``)
  and ``python``: must exit 0. A ``text`` block that is the next block with
  no heading between is what the example prints (``...`` as above).

The README tells the reader (and each guide repeats) that the examples take
the service's address from ``FEEDSVC_URL`` (default ``http://127.0.0.1:8888``, where ``make run``
serves), so this test sets it to the service it started; an example that
names a local address and not FEEDSVC_URL fails here rather than talk to
whatever listens there, and one that names any other machine's address
fails without running.

A block that cannot run here (``make test``, a container engine, a cluster
elsewhere) has the comment ``<!-- tests/test_readme.py skips this block:
REASON -->`` on the line before its fence; keep those rare. A block that
needs the service started with a setting the README asks the reader for
has ``<!-- tests/test_readme.py serves this block with FEEDSVC_NAME=VALUE
... -->`` there instead: its service gets those variables. A test's id names
the file and the line of the block's fence, e.g. ``docs/security.md:40
console``.

The links of these documents (``[text](target)``, not in a code block) to
files of this repository must name a file that exists and, after ``#``, a
heading of that file (as GitHub makes anchors of headings).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from feedsvc.testing import ServiceProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.process  # feedsvc serve, bash, curl, python

README = REPO_ROOT / "README.md"
#: Documents whose fenced blocks are not examples of the service, and why.
NOT_EXAMPLES = {
    "docs/RELIABILITY.md": "its blocks run parts of the test suite and read what they print",
}
RUNNABLE = ("console", "sh", "bash", "python")
SKIP = re.compile(r"<!-- tests/test_readme\.py skips this block: (?P<reason>\S.*?) -->")
SERVE = re.compile(
    r"<!-- tests/test_readme\.py serves this block with "
    r"(?P<env>FEEDSVC_\w+=\S+(?: FEEDSVC_\w+=\S+)*) -->"
)
FENCE = re.compile(r"^```(?P<info>\S*)\s*$")
#: Set while an example runs: a README example that runs the test suite
#: must not run the examples again.
NESTED = "README_EXAMPLE_RUNNING"
URL_VARIABLE = "FEEDSVC_URL"
LOCAL_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost|0\.0\.0\.0):\d+")
# An IPv4 address or a URL's host: an example run here may reach this machine only.
ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b|://(?:[^@/\s]*@)?([\w.-]+)")
LOOPBACK = re.compile(r"127(?:\.\d{1,3}){3}|localhost")
EXAMPLE_TIMEOUT = 90
# A line no example prints: it ends each console command's output.
DONE = "@@readme-example-command-done@@"


def documents() -> list[Path]:
    """README.md and every Markdown file in docs/, in that order."""
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


@dataclass
class Block:
    language: str
    line: int  # of the opening fence, 1-based
    code: str
    skip_reason: str | None = None
    output: str | None = None  # the text block that shows what it prints
    serve_env: dict[str, str] = field(default_factory=dict)  # the service's settings
    document: str = "README.md"  # relative to the repository

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line} {self.language}"


def readme_blocks(text: str, document: str = "README.md") -> list[Block]:
    """Every fenced block of a document, with its skip marker and, for a
    runnable block, the text block that shows its output."""
    lines = text.splitlines()
    blocks: list[Block] = []
    heading_since_last = False
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            heading_since_last |= lines[i].startswith("#")
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{document}:{i + 1}: a fence that is never closed"
        above = lines[i - 1] if i else ""
        marker = SKIP.fullmatch(above.strip())
        serve = SERVE.fullmatch(above.strip())
        assert marker or serve or "test_readme" not in above, (
            f"{document}:{i}: write the marker as "
            "'<!-- tests/test_readme.py skips this block: REASON -->' or "
            "'<!-- tests/test_readme.py serves this block with FEEDSVC_NAME=VALUE -->'"
        )
        block = Block(
            opening.group("info"),
            i + 1,
            "\n".join(lines[i + 1 : end]) + "\n",
            marker.group("reason") if marker else None,
            document=document,
        )
        if serve:
            block.serve_env = dict(pair.split("=", 1) for pair in serve.group("env").split())
        previous = blocks[-1] if blocks else None
        if (
            block.language == "text"
            and previous is not None
            and previous.language in RUNNABLE
            and previous.language != "console"
            and not heading_since_last
        ):
            previous.output = block.code
        blocks.append(block)
        heading_since_last = False
        i = end + 1
    return blocks


def examples() -> list[Block]:
    return [
        block
        for path in documents()
        if relative(path) not in NOT_EXAMPLES
        for block in readme_blocks(path.read_text(), relative(path))
        if block.language in RUNNABLE
    ]


def remote_addresses(code: str) -> list[str]:
    """Addresses in code that are not this machine's loopback."""
    found = [m.group(1) or m.group(0) for m in ADDRESS.finditer(code)]
    return [a for a in found if not LOOPBACK.fullmatch(a)]


# -- comparing output ----------------------------------------------------------------


def normalized(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def matches(expected: str, actual: str) -> bool:
    """doctest's ELLIPSIS: '...' in expected stands for any text."""
    expected, actual = normalized(expected), normalized(actual)
    pieces = expected.split("...")
    if len(pieces) == 1:
        return expected == actual
    first, *middle, last = pieces
    if len(first) + len(last) > len(actual):
        return False
    if not (actual.startswith(first) and actual.endswith(last)):
        return False
    position, stop = len(first), len(actual) - len(last)
    for piece in middle:
        found = actual.find(piece, position, stop)
        if found < 0:
            return False
        position = found + len(piece)
    return True


# -- console blocks ------------------------------------------------------------------


@dataclass
class Command:
    line: int
    text: str
    expected: str


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    continuing = False
    for offset, line in enumerate(block.code.splitlines(), start=1):
        if continuing:
            assert line.startswith("> "), (
                f"{block.document}:{block.line + offset}: continue a command with '> '"
            )
            commands[-1].text += "\n" + line[2:]
        elif line.startswith("$ "):
            commands.append(Command(block.line + offset, line[2:], ""))
        else:
            assert commands, (
                f"{block.document}:{block.line + offset}: output before any '$ ' command"
            )
            commands[-1].expected += line + "\n"
        continuing = (line.startswith(("$ ", "> "))) and line.endswith("\\")
    return commands


def run(argv: list[str], env: dict[str, str], cwd: Path, stderr: int) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of argv, run in a session of its own whose
    processes are all killed if it is still running after EXAMPLE_TIMEOUT."""
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=stderr, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=EXAMPLE_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{argv[:3]} still ran after {EXAMPLE_TIMEOUT} s; it printed:\n{out[-3000:]}{err or ''}"
        ) from None
    return proc.returncode, out, err or ""


def run_console(block: Block, env: dict[str, str], cwd: Path) -> None:
    commands = console_commands(block)
    script = "".join(f'{c.text}\n__rc=$?; printf "\\n{DONE} %d\\n" "$__rc"\n' for c in commands)
    _, stdout, _ = run(["bash", "-c", script], env, cwd, stderr=subprocess.STDOUT)
    outputs = re.split(rf"\n{DONE} (\d+)\n", stdout)
    for n, command in enumerate(commands):
        where = f"{block.document}:{command.line}: $ {command.text}"
        assert 2 * n + 1 < len(outputs), (
            f"{where}\nnever finished; the session printed:\n{stdout[-3000:]}"
        )
        printed, code = outputs[2 * n], int(outputs[2 * n + 1])
        assert code == 0, f"{where}\nexited {code}, printing:\n{printed}"
        assert matches(command.expected, printed), (
            f"{where}\n{block.document} shows:\n{command.expected}\nit printed:\n{printed}"
        )


# -- the other blocks ----------------------------------------------------------------


def run_program(block: Block, env: dict[str, str], cwd: Path) -> None:
    if block.language == "python":
        program = cwd / "example.py"
        program.write_text(block.code)
        argv = [sys.executable, str(program)]
    elif block.language == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        argv = ["sh", "-e", "-c", block.code]
    code, stdout, stderr = run(argv, env, cwd, stderr=subprocess.PIPE)
    assert code == 0, f"{block.name} exited {code}:\n{stdout}\n{stderr}"
    if block.output is not None:
        assert matches(block.output, stdout), (
            f"{block.name} shows:\n{block.output}\nit printed:\n{stdout}\n{stderr}"
        )


# -- the tests -----------------------------------------------------------------------


@pytest.fixture
def service(block: Block) -> Iterator[ServiceProcess]:
    """A fresh feedsvc with its own embedded Redis, and default settings but
    for those the block's serve marker names."""
    with ServiceProcess(env=block.serve_env) as svc:
        yield svc


def example_env(url: str) -> dict[str, str]:
    """The caller's environment without a developer's FEEDSVC_* settings, the
    venv's scripts first on PATH (as after `make run`), FEEDSVC_URL set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEEDSVC_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env[URL_VARIABLE] = url
    env[NESTED] = "1"
    return env


def test_readme_has_examples_and_every_skip_says_why() -> None:
    blocks = examples()
    run = [b for b in blocks if b.skip_reason is None]
    assert {b.language for b in run} >= {"console", "python"}, [b.name for b in blocks]
    assert "README.md" in {b.document for b in run}
    for block in run:
        # 'make run' serves on 127.0.0.1:8888; an example aimed there must
        # let the reader (and this test) point it elsewhere
        if LOCAL_ADDRESS.search(block.code):
            assert URL_VARIABLE in block.code, f"{block.name}: read the address from {URL_VARIABLE}"
        assert not remote_addresses(block.code), (
            f"{block.name} would reach {remote_addresses(block.code)}: skip it (see above)"
        )
    for block in blocks:
        if block.language == "console":
            assert console_commands(block), f"{block.name}: no '$ ' command"


def test_a_serve_marker_names_the_services_settings() -> None:
    text = (
        "<!-- tests/test_readme.py serves this block with FEEDSVC_A=1 FEEDSVC_B_C=x=y -->\n"
        "```console\n$ true\n```\n```console\n$ true\n```\n"
    )
    marked, plain = readme_blocks(text)
    assert marked.serve_env == {"FEEDSVC_A": "1", "FEEDSVC_B_C": "x=y"}
    assert plain.serve_env == {}
    with pytest.raises(AssertionError, match="write the marker"):
        readme_blocks("<!-- tests/test_readme.py serves it with A=1 -->\n```sh\ntrue\n```\n")


def test_remote_addresses() -> None:
    assert remote_addresses("feedsvc serve --redis-url redis+cluster://10.0.0.5:6379") == [
        "10.0.0.5"
    ]
    assert remote_addresses("redis-cli -h 192.168.1.2 ping") == ["192.168.1.2"]
    assert remote_addresses("curl https://user:pw@example.org/x") == ["example.org"]
    assert remote_addresses('B=${FEEDSVC_URL:-http://127.0.0.1:8888}; curl "$B/v2"') == []
    assert remote_addresses("url = 'http://localhost:8888'") == []


def test_ellipsis_matching() -> None:
    assert matches('{"a":...,"b":2}', '{"a":[1, 2],"b":2}')
    assert matches("HTTP/1.1 201 Created\n...", "HTTP/1.1 201 Created\r\nDate: x\r\n\r\n")
    assert not matches('{"a":...,"b":2}', '{"a":1,"b":3}')
    assert not matches("[1, 2]", "[1, 2, 3]")
    assert not matches("ab...ba", "aba")  # the two ends may not overlap
    assert matches("", "\n")


# -- links ---------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
EXTERNAL = re.compile(r"^(?:[a-z][a-z+.-]*:|//)")  # http:, https:, mailto:, ...


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading line: its text lowercased, punctuation
    other than '-' and '_' dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.lstrip("#").strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for _, line in prose_lines(path.read_text()):
        if re.match(r"#{1,6} ", line):
            name = anchor(line)
            # GitHub numbers repeated headings: name, name-1, name-2, ...
            n = 0
            while (f"{name}-{n}" if n else name) in found:
                n += 1
            found.add(f"{name}-{n}" if n else name)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(path.read_text()):
        for link in LINK.finditer(line):
            target = link.group("target")
            if EXTERNAL.match(target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{relative(path)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{where} (no such heading)")
    return broken


def test_anchors_are_githubs() -> None:
    assert anchor("## Live following") == "live-following"
    assert anchor("### Why POST and GET stay under 0.5: the ladder") == (
        "why-post-and-get-stay-under-05-the-ladder"
    )
    assert anchor("### `--workers 2` against one process (`workers`)") == (
        "--workers-2-against-one-process-workers"
    )
    assert anchor("## Read modes (`python -m loadtest follow`)") == (
        "read-modes-python--m-loadtest-follow"
    )


def test_links_lead_to_files_and_headings_that_exist() -> None:
    assert [b for path in documents() for b in broken_links(path)] == []


def test_a_broken_link_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## One two\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#one-two) [ok](#b) [no](a.md#three) [no](c.md) [ok](https://x.org/c.md)\n"
        "# B\n```\n[in code](nowhere.md)\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    assert [b.split(": ", 1)[1] for b in broken_links(doc)] == [
        "a.md#three (no such heading)",
        "c.md (no such file)",
    ]


def test_the_readme_names_every_guide_and_stays_short() -> None:
    readme = README.read_text()
    unnamed = [relative(path) for path in documents()[1:] if f"]({relative(path)})" not in readme]
    assert unnamed == []
    # the newcomer's page: each feature's full guide lives in docs/
    assert len(readme.splitlines()) <= 350


def test_the_benchmarks_stay_a_reference_not_a_diary() -> None:
    """Each goal's current result, not every session's (git keeps those)."""
    benchmarks = (REPO_ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(benchmarks.splitlines()) <= 500
    assert "## The goals at a glance" in benchmarks


def example_params() -> list[object]:
    return [
        pytest.param(
            block,
            id=block.name,
            marks=[pytest.mark.skip(reason=block.skip_reason)] if block.skip_reason else [],
        )
        for block in examples()
    ]


@pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="already inside a README example")
@pytest.mark.parametrize("block", example_params())
def test_readme_example_runs_verbatim(
    block: Block, service: ServiceProcess, tmp_path: Path
) -> None:
    # never run an example that reaches beyond this machine
    assert not remote_addresses(block.code), f"{block.name}: {remote_addresses(block.code)}"
    env = example_env(service.url)
    if block.language == "console":
        run_console(block, env, tmp_path)
    else:
        run_program(block, env, tmp_path)
