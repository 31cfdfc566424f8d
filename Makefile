# The two commands a newcomer needs:
#   make run    install feedsvc into .venv and serve it (embedded Redis by default)
#   make test   install the test tools into .venv and run lint, types and tests
# Extra flags for serve go in ARGS, e.g. make run ARGS="--driver watch --port 9000".

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: run test check lint types pytest clean

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

test: $(VENV)/.installed-test
	$(MAKE) --no-print-directory check

check: lint types pytest

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types:
	$(BIN)/mypy

pytest:
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build dist *.egg-info
