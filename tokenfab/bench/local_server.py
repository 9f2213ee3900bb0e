"""`tokenfab serve` as a child process on a loopback port: for the tools that measure or hurt a real server
of their own (tune's points, the fault drills, which signal, kill and restart it on the same port and data
dir) and for the tests that need one."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerError(RuntimeError):
    """The server did not come up; the message carries the end of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`tokenfab serve FLAGS` on 127.0.0.1:`port` (a free one by default), its output appended to `log_path`."""

    def __init__(self, flags: list[str], log_path: str | os.PathLike, port: int | None = None) -> None:
        self.flags = list(flags)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Start the process without waiting for it (a restart's clock starts here)."""
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenfab", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-access-log", *self.flags], stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    async def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Seconds until /health answers 200; ServerError (with the log's tail) if the process exits first or
        stays unhealthy past `timeout_s`."""
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as c:
            while True:
                if not self.alive:
                    raise ServerError(f"tokenfab serve {' '.join(self.flags)} exited with "
                                      f"{self.proc.returncode if self.proc else None}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(f"{self.url}/health")).status_code == 200:
                        return time.perf_counter() - t0
                if time.perf_counter() - t0 > timeout_s:
                    raise ServerError(f"tokenfab serve {' '.join(self.flags)} was not healthy after {timeout_s:.0f} s")
                await asyncio.sleep(0.1)

    async def start(self, timeout_s: float = 300.0) -> float:
        self.launch()
        return await self.wait_healthy(timeout_s)

    def send(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None if it still runs after `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        while self.proc is not None and self.proc.poll() is None:
            if time.perf_counter() > deadline:
                return None
            await asyncio.sleep(0.05)
        return self.proc.returncode if self.proc is not None else None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it has not drained within `timeout_s`."""
        if not self.alive:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def serving(flags: list[str], log_path: str | Path, timeout_s: float = 300.0):
    """Yields the base URL once /health answers 200; stops the server afterwards (SIGTERM, then SIGKILL
    after 30 s). A server that exits or stays unhealthy past `timeout_s` raises ServerError."""
    Path(log_path).write_text("")
    proc = ServeProcess(flags, log_path)
    try:
        # on a thread of its own: the caller may be inside an event loop (a browser test's)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, proc.start(timeout_s)).result()
        yield proc.url
    finally:
        proc.stop()
