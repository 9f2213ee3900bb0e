"""The Ray Serve drill of `tokenfab bench drills`: `tokenfab serve --replicas 2` under the soak mix, and
one replica's worker process SIGKILLed, as a crashed or OOM-killed replica would die.

Ray Serve starts a replacement. The ingress (serve_ray/pool.py) re-sends a request that had no text yet
to a live replica, and ends one whose text had started with a clear error: an error event in a stream,
a 503 without one. The drill checks that nothing is lost, that the pool is back to two replicas (a new
one in place of the killed one, from /metrics' per-replica series), and that the load is served after.
It needs the optional extra tokenfab[ray]; without it the drill is skipped.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import time

from tokenfab.bench.drill_load import outcome
from tokenfab.bench.drills import DrillContext, DrillResult

_REPLICA_LABEL = re.compile(r'^tokenfab:replica_num_requests_running\{[^}]*replica="([^"]+)"', re.M)
_RETRIES = re.compile(r'^tokenfab:router_retries_total\{[^}]*\} ([0-9.e+]+)', re.M)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def replica_pids(root: int) -> list[int]:
    """Processes under `root` (the serve process: it started the local Ray cluster) that run a Ray Serve
    replica actor, found by their process title."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"ServeReplica" not in cmd or b"tokenfab-" not in cmd:
            continue
        pid, seen = int(name), 0
        while pid not in (None, 0, 1) and seen < 64:
            if pid == root:
                found.append(int(name))
                break
            pid, seen = _parent(pid), seen + 1
    return sorted(found)


async def _replicas(ctx: DrillContext) -> tuple[set[str], int]:
    """The replicas /metrics has series for, and the requests the ingress re-sent to another replica."""
    r = await ctx.client.get(f"{ctx.server.url}/metrics")
    if r.status_code != 200:
        return set(), 0
    return set(_REPLICA_LABEL.findall(r.text)), int(sum(float(x) for x in _RETRIES.findall(r.text)))


async def ray_replica(ctx: DrillContext) -> DrillResult:
    result = DrillResult("ray_replica", "a Ray Serve replica SIGKILLed (2 replicas)")
    if importlib.util.find_spec("ray") is None:
        result.skipped = "Ray Serve is the optional extra tokenfab[ray]"
        return result
    server = ctx.new_server("ray", "--replicas", "2")
    try:
        await server.start(600.0)
        await ctx.use(server)
        before, retries0 = await _replicas(ctx)
        pids = replica_pids(server.pid)
        result.check("two replicas, each a process under the server", len(before) == 2 and len(pids) == 2,
                     f"replicas {sorted(before)}, processes {pids}")
        if len(pids) < 1:
            return result
        async with ctx.load(seed=9) as load:
            await asyncio.sleep(ctx.cfg.load_s / 2)
            t_kill = time.perf_counter()
            os.kill(pids[0], signal.SIGKILL)
            back = None
            while time.perf_counter() - t_kill < 240:
                now, _ = await _replicas(ctx)
                if len(now) == 2 and now != before:
                    back = now
                    break
                await asyncio.sleep(0.25)
            result.recovery_s = time.perf_counter() - t_kill
            t_back = time.perf_counter()
            await asyncio.sleep(ctx.cfg.load_s / 2)
        load.tally(into=result.tally)
        after, retries = await _replicas(ctx)
        result.check("Ray Serve replaced the killed replica", back is not None,
                     f"{sorted(before)} → {sorted(back or after)} in {result.recovery_s:.1f} s; {retries - retries0} "
                     f"requests re-sent to the other replica, {result.tally['failed']} ended with a clear error")
        result.check("the load was served after the replacement",
                     any(raw.sent > t_back and outcome(raw) == "completed" for _, raw in load.results))
        result.kv_idle_blocks = await ctx.idle_kv()
    finally:
        server.stop()
    return result
