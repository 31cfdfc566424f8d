# The two commands a newcomer needs:
#   make run    install feedsvc into .venv and serve it (embedded Redis by default)
#   make test   install the test tools into .venv and run lint, types and tests
# And the loop while you work:
#   make test-fast  lint, types and the tests that need one redis-server and nothing else
# Extra flags for serve go in ARGS, e.g. make run ARGS="--driver watch --port 9000".

PYTHON ?= python3
VENV ?= .venv
# the real Keystone's venv (see the keystone target below): defined before any
# rule names it, as make reads a rule's prerequisites when it reads the rule
KEYSTONE_VENV ?= .venv-keystone
BIN := $(VENV)/bin
ARGS ?=

.PHONY: run test test-fast check lint types pytest pytest-fast lock clean keystone

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/feedsvc serve $(ARGS)

test: $(VENV)/.installed-test $(KEYSTONE_VENV)/.installed
	$(MAKE) --no-print-directory check

# A real OpenStack Keystone for the tests marked keystone and bench/auth.py,
# in a venv of its own (its ~95 pinned packages never meet feedsvc's). Built
# once: measured 2026-11-27 on a busy 2-core machine, 3 min 51 s with a cold
# pip cache, 2 min 37 s with a warm one; the first test that starts a
# Keystone then bootstraps its template (about a minute, kept in the venv).
# tests/test_keystone.py with a fresh template, -n 2, load 10: 3 min 20 s.
keystone: $(KEYSTONE_VENV)/.installed

$(KEYSTONE_VENV)/.installed: requirements/keystone.txt
	$(PYTHON) -m venv $(KEYSTONE_VENV)
	$(KEYSTONE_VENV)/bin/python -m pip install -q --upgrade pip
	$(KEYSTONE_VENV)/bin/python -m pip install -q -r requirements/keystone.txt
	touch $@

check: lint types pytest

# The fast loop leaves out the tests marked (pyproject.toml, tests/conftest.py)
# cluster (the local Redis Cluster), process (feedsvc serve, redis-servers of
# their own, pip, docker tools, locust), slow (real time: expiry end to end,
# slow clients, streams and long polls that run out, background sweeps: each
# test of 0.6 s or more), full_driver (the contract suites on watch-naive,
# the driver no client is meant to run) and keystone (a real Keystone); a
# test that starts a process without its mark fails here and says so. make test runs them all. It runs on
# FAST_WORKERS pytest-xdist workers: its tests compute (about 50 CPU-s in
# one process), and two workers use both cores. Measured with
# /usr/bin/time make test-fast on 2 cores, venv built, quiet machine,
# 2026-11-27 06:27 UTC: 55.9-57.1 s wall, 94-97 CPU-s, 1,972 tests.
test-fast: $(VENV)/.installed-test
	$(MAKE) --no-print-directory lint types pytest-fast

FAST_TESTS = not cluster and not process and not slow and not full_driver and not keystone
FAST_WORKERS ?= 2

pytest-fast:
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) --dist worksteal -m "$(FAST_TESTS)"

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types:
	$(BIN)/mypy

# The full suite runs on PYTEST_WORKERS pytest-xdist workers, twice the 2
# cores it is measured on: most of its time is spent waiting for processes
# (redis-servers, feedsvc serve, Sentinel and Cluster failovers, Chromium,
# locust), not computing. worksteal hands a worker that runs dry tests from
# another's queue, so the long tests do not pile up at the end. Each worker
# has a session redis-server (and Cluster) of its own; a test that must not
# share one still starts its own. Every worker collects the suite itself,
# so parameters must come in a fixed order (lists, not sets). Measured in a
# fresh clone with CI=true bash .ci/run on 2 cores (AMD EPYC), 2026-11-27
# 14:55 UTC: pytest 14 min 36 s for 6,905 tests (the whole run 17.5 min).
# The run keeps both cores busy: with 6 workers it took 13 min 20 s and two
# tests timed out connecting to Redis, so 4 it stays.
PYTEST_WORKERS ?= 4

pytest:
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

# The image's lock files, requirements/runtime.txt (pyproject.toml's
# dependencies) and requirements/build.txt (its build-system requires): every
# package pinned, with the hashes of all its files, resolved for the image's
# Python (CPython 3.11 on Linux) by uv, which this installs into the venv.
# Needs PyPI. Pins that still fit are kept; LOCK_ARGS=--upgrade takes the newest.
LOCK_ARGS ?=
LOCK = $(BIN)/uv pip compile --quiet --python-version 3.11 --python-platform linux \
	--generate-hashes --custom-compile-command "make lock" $(LOCK_ARGS)

lock: | $(BIN)/python
	$(BIN)/python -m pip install -q 'uv>=0.9,<1'
	$(LOCK) pyproject.toml -o requirements/runtime.txt
	$(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
		| $(LOCK) - -o requirements/build.txt

clean:
	rm -rf $(VENV) $(KEYSTONE_VENV) build dist *.egg-info
