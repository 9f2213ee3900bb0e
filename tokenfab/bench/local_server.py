"""`tokenfab serve` in a subprocess on a free loopback port, for the tools that measure a real server of
their own (tune's points, the fault drills) and for the tests that need one."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


class ServerError(RuntimeError):
    """The server did not come up; the message carries the end of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(flags: list[str], log_path: str | Path, timeout_s: float = 300.0):
    """Yields the base URL once /health answers 200; stops the server afterwards (SIGTERM, then SIGKILL
    after 30 s). A server that exits or stays unhealthy past `timeout_s` raises ServerError."""
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "tokenfab", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", *flags]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read()[-2000:].strip()
                    raise ServerError(f"tokenfab serve {' '.join(flags)} exited with {proc.returncode}: {tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerError(f"tokenfab serve {' '.join(flags)} was not healthy after {timeout_s:.0f} s")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
