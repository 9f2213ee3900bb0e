"""`tokenfab serve` in a subprocess on a free loopback port, for tests that need a real server."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(log_path, *flags: str, timeout_s: float = 300):
    """Yields the base URL once /health answers; stops the server (SIGTERM, then kill) afterwards."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--no-access-log", *flags], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"tokenfab serve exited with {proc.returncode}: {log.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"tokenfab serve did not become healthy within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
