"""Running the app under uvicorn: bind early, say when ready, drain on SIGTERM.

- The port is bound before the model loads, so a busy port fails in a second, not after a load.
- Once listening, `on_ready(url)` runs (the CLI prints a ready-to-paste curl command).
- SIGTERM or Ctrl+C: the listening socket closes, /health answers 503, and in-flight requests run
  to completion for up to `shutdown_timeout` seconds; whatever is left is then cancelled, which
  aborts its engine requests. A second Ctrl+C quits at once. A drained server exits with status 0.
- `ServerThread` runs the same server in a background thread on a free port (tests, benchmarks).
"""
from __future__ import annotations

import json
import logging
import shlex
import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

log = logging.getLogger("tokenfab.server")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another with --port, "
                         "or --port 0 for any free port") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def curl_example(url: str, model: str, api_key_env: str | None = None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Write a haiku about tokens."}],
            "max_tokens": 48}
    lines = [f"curl {url}/v1/chat/completions", "-H 'Content-Type: application/json'"]
    if api_key_env:
        lines.append(f'-H "Authorization: Bearer ${api_key_env}"')
    lines.append(f"-d {shlex.quote(json.dumps(body))}")
    return " \\\n  ".join(lines)


class TokenfabServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, on_ready: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self.state = state              # ServerState: its `draining` flag turns /health to 503
        self.on_ready = on_ready
        self.url: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            self.url = base_url(sockets[0])
            if self.on_ready:
                self.on_ready(self.url)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.state.draining = True
            log.info("received %s: draining %d in-flight request(s) for up to %s s",
                     signal.Signals(sig).name if sig else "stop", self.state.client.num_requests,
                     self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)

    async def serve(self, sockets=None) -> None:
        serve_inner = getattr(self, "_serve", None)
        if serve_inner is None:           # another uvicorn layout: keep its behaviour
            return await super().serve(sockets)
        with self.capture_signals():
            await serve_inner(sockets)
            # uvicorn re-raises the caught SIGTERM once its handlers are restored, which kills the
            # process with 143; after a clean drain we would rather return and exit 0.
            getattr(self, "_captured_signals", []).clear()


def make_server(app, shutdown_timeout: float, on_ready: Callable[[str], None] | None = None) -> TokenfabServer:
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", ws="none",
                            timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=5)
    return TokenfabServer(config, app.state.tokenfab, on_ready)


class ServerThread:
    """The server in a background thread, on a free 127.0.0.1 port unless told otherwise."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 10.0) -> None:
        self.sock = bind_socket(host, port)
        self.url = base_url(self.sock)
        self.server = make_server(app, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tokenfab-server", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        return self

    def drain(self) -> None:
        """What SIGTERM does: stop accepting and let in-flight requests finish."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 30.0) -> None:
        self.drain()
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
