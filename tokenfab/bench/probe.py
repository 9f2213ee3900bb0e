"""What a soak samples of the server between its windows: memory, threads, descriptors, KV blocks in use.

Two sources, either or both:
- the server's Prometheus `/metrics`: the standard `process_resident_memory_bytes` and `process_open_fds`,
  `process_threads`, and the engine's `*:num_requests_running` / `*:num_requests_waiting` /
  `*:kv_cache_used_blocks` / `*:kv_cache_usage_perc` under any prefix (`tokenfab:`, `vllm:`), summed
  over label sets;
- a local process (`--pid`), read from /proc: VmRSS, Threads, and the entries of /proc/PID/fd. Its
  figures win over the scraped ones, which a proxy or another process could stand behind.

`wait_idle` polls until nothing runs or waits, so the KV blocks it reads are the ones nobody should hold.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_ENGINE = {"num_requests_running": "running", "num_requests_waiting": "waiting",
           "kv_cache_used_blocks": "kv_used_blocks", "kv_cache_usage_perc": "kv_usage",
           "kv_cache_touched_bytes": "kv_resident_bytes"}
_PROCESS = {"process_resident_memory_bytes": "rss_bytes", "process_open_fds": "open_fds",
            "process_threads": "threads"}


@dataclass(slots=True)
class ServerSample:
    """One look at the server; None where the source did not say."""
    t_s: float = 0.0                     # seconds since the soak started
    rss_bytes: int | None = None
    threads: int | None = None
    open_fds: int | None = None
    kv_used_blocks: int | None = None
    kv_resident_bytes: int | None = None  # the KV pool's pages in use at least once (tokenfab's kv_cache_touched_bytes)
    kv_usage: float | None = None        # share of the KV pool in use, 0–1
    running: int | None = None
    waiting: int | None = None
    idle: bool | None = None             # nothing ran or waited when sampled (None: the server does not say)
    source: str = "none"                 # metrics | pid | metrics+pid | none

    @property
    def busy(self) -> bool:
        return bool(self.running) or bool(self.waiting)


def parse_metrics(text: str) -> ServerSample:
    """The figures a soak needs from Prometheus text exposition."""
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        short = fam.name.split(":", 1)[-1] if ":" in fam.name else fam.name
        field = _ENGINE.get(short) if ":" in fam.name else _PROCESS.get(fam.name)
        if field is None:
            continue
        for s in fam.samples:
            if s.name == fam.name:       # not a _created or _total companion
                values[field] = values.get(field, 0.0) + s.value
    sample = ServerSample(source="metrics" if values else "none")
    for field, v in values.items():
        setattr(sample, field, v if field == "kv_usage" else int(v))
    return sample


def read_proc(pid: int) -> tuple[int | None, int | None, int | None]:
    """(RSS bytes, threads, open descriptors) of a local process; ValueError when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        raise ValueError(f"process {pid} is gone (no /proc/{pid}); did the server exit?") from None
    except PermissionError:
        raise ValueError(f"cannot read /proc/{pid}: it belongs to another user; run as that user or "
                         "leave out --pid to read the server's /metrics") from None
    rss = int(status["VmRSS"].split()[0]) * 1024 if "VmRSS" in status else None
    threads = int(status["Threads"]) if "Threads" in status else None
    return rss, threads, fds


def check_pid(pid: int) -> None:
    """ValueError unless `pid` is a live local process whose /proc can be read."""
    if pid <= 0:
        raise ValueError(f"--pid {pid}: not a process id")
    if not os.path.isdir("/proc"):
        raise ValueError("--pid needs Linux's /proc; leave it out to read the server's /metrics")
    read_proc(pid)


async def sample(client: httpx.AsyncClient, base_url: str, api_key: str | None = None,
                 pid: int | None = None) -> ServerSample:
    """One sample: /metrics when the server answers it, then the local process when `pid` is given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    s = ServerSample()
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
        if r.status_code == 200:
            s = parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        pass                             # no /metrics: the process figures may still come from --pid
    if pid is not None:
        s.rss_bytes, s.threads, s.open_fds = read_proc(pid)
        s.source = "pid" if s.source == "none" else "metrics+pid"
    return s


async def wait_idle(client: httpx.AsyncClient, base_url: str, api_key: str | None, pid: int | None,
                    timeout_s: float, since: float, clock=time.perf_counter,
                    poll_s: float = 0.2) -> ServerSample:
    """Sample once nothing runs or waits (an abort lands at the engine's next turn), or when `timeout_s`
    has passed (then `idle` is False). A server that does not report its queue is given one poll."""
    deadline = clock() + timeout_s
    while True:
        s = await sample(client, base_url, api_key, pid)
        known = s.running is not None or s.waiting is not None
        if not known:
            await asyncio.sleep(poll_s)
            s = await sample(client, base_url, api_key, pid)
            s.idle = None
            break
        if not s.busy or clock() >= deadline:
            s.idle = not s.busy
            break
        await asyncio.sleep(poll_s)
    s.t_s = clock() - since
    return s
