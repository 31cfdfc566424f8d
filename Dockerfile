# feedsvc as a container image: `docker build -t feedsvc .`, then
# `docker run -p 8888:8888 feedsvc` (embedded Redis, data in /data) or, as in
# docker-compose.yml, with FEEDSVC_REDIS_URL pointing at a Redis server.
# Every setting is a FEEDSVC_* variable (docs/operations.md, "Configuration").
# tests/test_docker.py lints this file and runs its CMD, ENV and HEALTHCHECK
# as local processes.

# The builder installs feedsvc and its dependencies into a virtualenv; the
# runtime stage gets that virtualenv and nothing else. Every dependency has a
# manylinux wheel for CPython 3.11 (wheels only is enforced), so neither stage
# needs a compiler.
FROM python:3.11.15-slim-bookworm AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# The dependencies come from the lock files that `make lock` writes
# (docs/scaling.md, "Docker Compose"): exact versions, every file checked against its hash. This
# layer is rebuilt only when a lock file changes. No pip in the virtualenv:
# the base image's pip installs into it. hatchling (requirements/build.txt)
# goes into the builder's own Python, to build feedsvc's wheel.
COPY requirements/ requirements/
RUN python -m venv --without-pip /opt/venv \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir \
       --require-hashes --only-binary=:all: -r requirements/runtime.txt \
    && python -m pip install --no-cache-dir \
       --require-hashes --only-binary=:all: -r requirements/build.txt
COPY pyproject.toml README.md ./
COPY lua/ lua/
COPY feedsvc/ feedsvc/
# feedsvc's wheel, built by the pinned hatchling (build isolation would fetch
# whichever hatchling is newest), installed without dependencies (they are in
# already); pip check fails the build if the lock lacks one that feedsvc needs.
RUN python -m pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /tmp/wheels . \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --no-deps \
       /tmp/wheels/feedsvc-*.whl \
    && python -m pip --python /opt/venv/bin/python check

FROM python:3.11.15-slim-bookworm

# A fixed numeric id, so that `runAsNonRoot`-style checks can see it is not root.
RUN groupadd --system --gid 10001 feedsvc \
    && useradd --system --uid 10001 --gid feedsvc --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin feedsvc \
    && mkdir /data \
    && chown feedsvc:feedsvc /data

COPY --from=builder /opt/venv /opt/venv

# FEEDSVC_DATA_DIR is only used by the embedded Redis (no FEEDSVC_REDIS_URL);
# mount a volume on /data to keep its AOF files.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FEEDSVC_HOST=0.0.0.0 \
    FEEDSVC_PORT=8888 \
    FEEDSVC_DATA_DIR=/data

USER 10001:10001
WORKDIR /data
EXPOSE 8888

# GET /v2/ping (no headers needed) is 204 when Redis answers, 503 when it
# does not; urlopen raises on a 503 or a refused connection, so the exit code
# says healthy or not. Python, because slim images have no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/v2/ping' % os.environ['FEEDSVC_PORT'], timeout=4)"]

# feedsvc stops on SIGTERM (docker stop), giving requests in flight
# FEEDSVC_SHUTDOWN_GRACE seconds (default 30).
CMD ["feedsvc", "serve"]
