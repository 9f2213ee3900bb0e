"""`tokenfab doctor`: scrape a server's /metrics twice (and read a bench result) and name the bottleneck.

Registering the parser imports nothing heavy; the handler imports httpx and the planner.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="say what limits a running deployment, with the numbers and the flags to change",
        description="Scrape a tokenfab server's /metrics twice, some seconds apart, optionally read a "
                    "`tokenfab bench serve --out` result, compare with the hardware's roofline, and say in "
                    "sentences what limits the deployment (KV capacity, queueing, prefill, the long-prompt "
                    "tail, decode bandwidth, host overhead) and which flag to change. Run it while load is on.")
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between the two scrapes (default: 5)")
    p.add_argument("--bench", metavar="RESULT.json", help="a `tokenfab bench serve --out` result")
    p.add_argument("--hardware", help="a `tokenfab plan hardware` name (or one saved by `tokenfab plan probe`); "
                                      "enables the roofline findings")
    p.add_argument("--hardware-file", action="append", default=None, metavar="FILE",
                   help="extra hardware entries (same format as the catalog)")
    p.add_argument("--model", help="the served model, for the roofline: a .gguf, an HF folder or a preset "
                                   "(default: what the server's /v1/models names, when that is a local file)")
    p.add_argument("--api-key", default=None, help="key for /v1/models when the server has --api-key "
                                                   "(default: $TOKENFAB_API_KEY; /metrics needs none)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    from tokenfab.cli_errors import CLIError
    from tokenfab.doctor import report
    from tokenfab.doctor.scrape import Scrape, Window
    if not args.url and not args.bench:
        raise CLIError("give --url (a running server) and/or --bench RESULT.json")
    if args.interval <= 0:
        raise CLIError(f"--interval must be positive seconds, got {args.interval}")
    bench = _read_bench(args.bench) if args.bench else None
    window, model = None, args.model
    if args.url:
        import httpx
        url = args.url.rstrip("/")
        with httpx.Client(timeout=10.0) as client:
            before = Scrape.parse(_get(client, url + "/metrics"), time.monotonic())
            if not args.json:
                print(f"watching {url} for {args.interval:g} s ...", file=sys.stderr, flush=True)
            time.sleep(args.interval)
            window = Window(before, Scrape.parse(_get(client, url + "/metrics"), time.monotonic()))
            if model is None and args.hardware:
                model = _served_model_path(client, url, args.api_key or os.environ.get("TOKENFAB_API_KEY"))
    dep = None
    if args.hardware:
        config = window.after.info if window else {}
        dep = report.deployment_for(args.hardware, model, config, tuple(args.hardware_file or ()))
    doc = report.run(window, bench, dep)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        report.render(doc)
    return 0


def _get(client, url: str) -> str:
    from tokenfab.cli_errors import CLIError
    try:
        r = client.get(url)
    except Exception as e:  # noqa: BLE001 - any transport failure is the same advice
        raise CLIError(f"cannot reach {url} ({type(e).__name__}: {e}); is `tokenfab serve` running there?") from None
    if r.status_code != 200:
        raise CLIError(f"{url} answered {r.status_code}; expected a tokenfab server's /metrics")
    if "tokenfab:" not in r.text:
        raise CLIError(f"{url} has no tokenfab: metrics; `tokenfab doctor` reads tokenfab servers")
    return r.text


def _served_model_path(client, url: str, key: str | None) -> str | None:
    """The model file the server runs, when it is on this machine; else None (the bundled model)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        data = client.get(url + "/v1/models", headers=headers).json()["data"][0]
    except Exception:  # noqa: BLE001 - without it the default model is used, and said
        return None
    root = data.get("root")
    return root if root and os.path.exists(root) else None


def _read_bench(path: str) -> dict:
    from tokenfab.bench.schema import SCHEMA, load_result
    result = load_result(path)
    if result.get("schema") != SCHEMA:
        raise ValueError(f"{path} is a `bench offline` result; the doctor reads `bench serve --out` results")
    return result
