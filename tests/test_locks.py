"""The image's lock files against pyproject.toml, the Makefile and the Dockerfile.

``make lock`` writes requirements/runtime.txt (pyproject.toml's
dependencies) and requirements/build.txt (its build-system requires) with
uv, for CPython 3.11 on Linux. Checked here, without PyPI: every dependency
that applies in the image is pinned to a version its specifier allows, with
hashes, and so is every package an extra of it asks for; every pin in a lock
is exact, has hashes and is wanted (by pyproject.toml or, by uv's ``# via``
notes, by another pin); the locks are for the image's Python; and the
Dockerfile's builder installs from them with ``--require-hashes``, builds
feedsvc's wheel with the pinned hatchling and installs it with
``--no-deps``. What needs PyPI is checked by pip when the image is built: a
dependency of a pin that the lock lacks fails ``--require-hashes``, and
``pip check`` fails on one that feedsvc's wheel needs.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name

from tests.conftest import REPO_ROOT
from tests.test_docker import DOCKERFILE, dockerfile_stages

RUNTIME_LOCK = REPO_ROOT / "requirements" / "runtime.txt"
BUILD_LOCK = REPO_ROOT / "requirements" / "build.txt"
VIA_PROJECT = "feedsvc (pyproject.toml)"
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


@dataclass
class Pin:
    version: str
    hashes: list[str] = field(default_factory=list)
    via: set[str] = field(default_factory=set)


def read_lock(path: Path) -> dict[NormalizedName, Pin]:
    """uv's requirements format: ``name==version \\``, its ``--hash`` lines,
    then ``# via x`` or ``# via`` and one ``#   x`` line per dependent."""
    pins: dict[NormalizedName, Pin] = {}
    current: Pin | None = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not line[0].isspace() and not line.startswith("#"):
            requirement = line.removesuffix("\\").strip()
            name, sep, version = requirement.partition("==")
            assert sep and re.fullmatch(r"[\w.+!-]+", version), (
                f"{path.name}: {line!r} is not exact"
            )
            current = pins[canonicalize_name(name)] = Pin(version)
        elif current is not None and stripped.startswith("--hash="):
            assert HASH.fullmatch(stripped.removesuffix("\\").strip()), f"{path.name}: {line!r}"
            current.hashes.append(stripped)
        elif current is not None and stripped.startswith("# via "):
            current.via.add(stripped.removeprefix("# via ").strip())
        elif current is not None and stripped.startswith("#   "):
            current.via.add(stripped.removeprefix("#   ").strip())
    return pins


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def image_python() -> str:
    """The image's Python version, from the base image's tag (python:3.11.15-...)."""
    found = re.fullmatch(
        r"python:(\d+\.\d+\.\d+)-.*", dockerfile_stages(DOCKERFILE.read_text())[-1].image
    )
    assert found, "the base image is python:X.Y.Z-..."
    return found.group(1)


def image_environment(extra: str = "") -> dict[str, str]:
    """Marker values in the image (CPython on Linux)."""
    full = image_python()
    return {
        "python_version": full.rsplit(".", 1)[0],
        "python_full_version": full,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "extra": extra,
    }


def applies(marker: Marker | None, extra: str = "") -> bool:
    return marker is None or marker.evaluate(image_environment(extra))


def assert_pinned(pins: dict[NormalizedName, Pin], requirement: Requirement, lock: str) -> None:
    name = canonicalize_name(requirement.name)
    assert name in pins, f"{requirement} is not in {lock}: run make lock"
    pin = pins[name]
    assert requirement.specifier.contains(pin.version, prereleases=True), (
        f"{lock} pins {name}=={pin.version}, outside {requirement}: run make lock"
    )
    assert pin.hashes, f"{lock}: {name} has no hashes"


def test_runtime_lock_pins_every_dependency_of_pyproject() -> None:
    pins = read_lock(RUNTIME_LOCK)
    wanted = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    direct = set()
    for requirement in wanted:
        if not applies(requirement.marker):
            continue
        direct.add(canonicalize_name(requirement.name))
        assert_pinned(pins, requirement, RUNTIME_LOCK.name)
        # what an extra (redis[hiredis]) adds, by the installed distribution's metadata
        for extra in requirement.extras:
            for raw in importlib.metadata.requires(requirement.name) or []:
                needed = Requirement(raw)
                if applies(needed.marker, extra) and not applies(needed.marker):
                    assert_pinned(pins, needed, RUNTIME_LOCK.name)
    # and nothing claims to come from pyproject.toml that no longer does
    stale = {name for name, pin in pins.items() if VIA_PROJECT in pin.via} - direct
    assert not stale, f"{RUNTIME_LOCK.name} pins {stale} for pyproject.toml: run make lock"


def test_build_lock_pins_the_build_system() -> None:
    pins = read_lock(BUILD_LOCK)
    requires = [Requirement(r) for r in pyproject()["build-system"]["requires"]]
    assert requires
    for requirement in requires:
        assert_pinned(pins, requirement, BUILD_LOCK.name)


def test_every_pin_is_hashed_and_wanted() -> None:
    build_requires = {
        canonicalize_name(Requirement(r).name) for r in pyproject()["build-system"]["requires"]
    }
    for path in (RUNTIME_LOCK, BUILD_LOCK):
        text = path.read_text()
        assert text.startswith(
            "# This file was autogenerated by uv via the following command:\n#    make lock\n"
        ), f"{path.name}: write it with make lock"
        pins = read_lock(path)
        assert pins, path
        for name, pin in pins.items():
            assert pin.hashes, f"{path.name}: {name} has no hashes"
            dependents = {canonicalize_name(v) for v in pin.via if v != VIA_PROJECT}
            assert dependents <= set(pins), f"{path.name}: {name} is wanted by {pin.via}"
            assert pin.via or name in build_requires, f"{path.name}: nothing wants {name}"


def test_make_lock_resolves_for_the_image() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    [version] = re.findall(r"--python-version (\S+)", makefile)
    assert image_python().startswith(version + "."), (version, image_python())
    assert "--python-platform linux" in makefile
    assert "--generate-hashes" in makefile
    for path in (RUNTIME_LOCK, BUILD_LOCK):
        assert f"-o {path.relative_to(REPO_ROOT)}" in makefile


# -- the Dockerfile ------------------------------------------------------------------


def pip_installs(runs: list[str]) -> list[list[str]]:
    """The arguments after ``install`` of every ``pip ... install`` in RUN lines."""
    found = []
    for run in runs:
        for command in run.split("&&"):
            argv = shlex.split(command)
            if "pip" in argv and "install" in argv:
                found.append(argv[argv.index("install") + 1 :])
    return found


def test_dockerfile_installs_from_the_locks() -> None:
    builder = dockerfile_stages(DOCKERFILE.read_text())[0]
    runs = builder.args("RUN")
    installs = pip_installs(runs)
    for lock in (RUNTIME_LOCK, BUILD_LOCK):
        relative = str(lock.relative_to(REPO_ROOT))
        [install] = [a for a in installs if relative in a]
        assert install[install.index("-r") + 1] == relative
        assert "--require-hashes" in install and "--only-binary=:all:" in install, install
    # everything else pip installs brings no dependency with it
    for install in installs:
        assert "--require-hashes" in install or "--no-deps" in install, install
    # the runtime lock goes into the virtualenv the runtime stage copies
    [into_venv] = [r for r in runs if "requirements/runtime.txt" in r]
    assert "--python /opt/venv/bin/python install" in re.sub(r"\s+", " ", into_venv)
    # the wheel is built by the pinned hatchling, not one fetched for the build
    assert any("--no-build-isolation" in r and " wheel " in r for r in runs), runs
    # the locks are in the build context before they are used
    copies = builder.args("COPY")
    assert copies.index("requirements/ requirements/") == 0, copies
