"""`tokenfab serve` in a subprocess on a free loopback port, for tests that need a real server."""
from __future__ import annotations

import contextlib

import pytest

from tokenfab.bench.local_server import ServerError, free_port, serving  # noqa: F401  (free_port: tests' import)


@contextlib.contextmanager
def serve(log_path, *flags: str, timeout_s: float = 300):
    """Yields the base URL once /health answers; stops the server (SIGTERM, then kill) afterwards."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(serving(list(flags), log_path, timeout_s))
        except ServerError as e:
            pytest.fail(str(e))
        yield url
