"""The results file of a tune run: JSON lines, one per measurement, appended as each one ends.

    {"kind": "header", "model": ..., "workload": [bench flags]}
    {"kind": "quality", "weights": "int8", "kv_cache_dtype": "auto", "kl_mean": ..., "same_top1_pct": ...}
    {"kind": "measured", "point": {...}, "run": {"requests": [[ttft_ms, tpot_ms, tokens], ...], ...},
     "bench": "bench/3.json", "step_log": "steps/3.jsonl", "seconds": ...}
    {"kind": "failed", "point": {...}, "error": "..."}

A run that stops (Ctrl-C, a crash, the budget) leaves every finished measurement in the file; the
next run with the same output folder reads them back and measures only what is missing. The
header guards against mixing: the same folder with another model or workload is refused. Targets
may change between runs: a measurement keeps its requests, so its metrics are computed again.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenfab.tune.space import Point


class Results:
    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.quality: dict[tuple[str, str], dict] = {}
        self.measured: dict[Point, dict] = {}
        self.failed: dict[Point, str] = {}
        self.resumed = 0
        if self.path.exists() and self.path.stat().st_size:
            self._read(header)
        else:
            self._append({"kind": "header", **header})

    def _read(self, header: dict) -> None:
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if i == len(lines) - 1:     # a line cut short by an interruption: the rest is intact
                    break
                raise ValueError(f"{self.path}: line {i + 1} is not JSON; is it a tune results file?") from None
        first = rows[0] if rows else {}
        if first.get("kind") != "header":
            raise ValueError(f"{self.path} is not a tune results file (no header line)")
        for key in ("model", "workload"):
            if first.get(key) != header[key]:
                raise ValueError(f"{self.path} holds results for {key} {first.get(key)!r}, not {header[key]!r}; "
                                 "give another --out-dir (or delete the file) to start over")
        for row in rows[1:]:
            kind = row.get("kind")
            if kind == "quality":
                self.quality[(row["weights"], row["kv_cache_dtype"])] = row
            elif kind == "measured":
                self.measured[Point.from_dict(row["point"])] = row
                self.resumed += 1
            elif kind == "failed":
                self.failed[Point.from_dict(row["point"])] = row["error"]

    def _append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def add_quality(self, weights: str, kv: str, row: dict) -> dict:
        row = {"kind": "quality", "weights": weights, "kv_cache_dtype": kv, **row}
        self._append(row)
        self.quality[(weights, kv)] = row
        return row

    def add_measured(self, point: Point, row: dict) -> dict:
        row = {"kind": "measured", "point": _point_json(point), **row}
        self._append(row)
        self.measured[point] = row
        return row

    def add_failed(self, point: Point, error: str) -> None:
        self._append({"kind": "failed", "point": _point_json(point), "error": error})
        self.failed[point] = error


def _point_json(point: Point) -> dict:
    return json.loads(point.key())
