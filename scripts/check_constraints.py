"""Check that the environment holds exactly the tested set: every installed distribution is pinned in
constraints.txt at the version installed. CI runs it after `make install-test`, so a dependency added
to pyproject.toml without refreshing constraints.txt (scripts/refresh_constraints.sh) fails CI, not a
user. Exit 1 with the differences, 0 when they agree."""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Installed by the venv itself or the project's own editable install, never pinned.
UNPINNED = {"pip", "setuptools", "wheel", "tokenfab"}


def pins(path: Path) -> dict[str, Requirement]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def main(path: str = "constraints.txt") -> int:
    pinned = pins(Path(path))
    problems = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in UNPINNED:
            continue
        req = pinned.get(name)
        if req is None:
            problems.append(f"{name}=={dist.version} is installed but not pinned in {path}")
        elif not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{name}=={dist.version} is installed but {path} says {req}")
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} difference(s): run scripts/refresh_constraints.sh and commit {path}",
              file=sys.stderr)
        return 1
    print(f"{path}: the environment is the pinned set")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
