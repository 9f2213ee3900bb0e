#!/usr/bin/env bash
# Rewrite constraints.txt from what the version ranges in pyproject.toml resolve to today: a new
# virtual environment, installed without the old pins, then the whole test suite (slow tests too);
# only a passing set is written. Commit constraints.txt with the pyproject.toml change that needed it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
make test-all PY="$venv/bin/python" CONSTRAINTS=
{
  echo "# The tested set: what \`make test\` installs (pip -c). Written by scripts/refresh_constraints.sh"
  echo "# on $(date -u +%F) with $("$venv/bin/python" -V) on $(uname -m); do not edit by hand."
  "$venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | sed -E 's/^(torch==[^+]+)\+.*/\1/' | grep -viE '^(pip|setuptools|wheel)=='
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
