"""Validation: the written config, loaded by `tokenfab serve --config`, must meet the targets in
N consecutive bench runs, each with fresh prompts (seeds apart from the search's)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenfab.tune.measure import bench_once, compact_run, run_metrics, serving
from tokenfab.tune.targets import Targets

SEED_BASE = 1000


def validate(config_path: str | Path, workload, targets: Targets, runs: int, out_dir: Path,
             say: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """One server started from the config file; `runs` bench runs against it, stopping at the first
    that misses. Each entry: the run's metrics and its checks."""
    out = []
    slos = targets.slos()
    with serving(None, ["--config", str(config_path)], out_dir / "validation.log") as url:
        for i in range(runs):
            say(f"validation run {i + 1}/{runs}")
            m = run_metrics(compact_run(bench_once(url, workload, slos, seed=SEED_BASE + i)), slos)
            checks = targets.speed_checks(m)
            out.append({"metrics": m, "checks": checks})
            if not all(c.ok for c in checks):
                break
    return out
