"""`tokenfab plan ...`: the planner's sub-commands and their flags.

Every command prints rich tables, or its result as JSON with `--json`; the ones with a picture
write a PNG with `--plot PATH`. Registering the parser imports nothing heavy (no torch).
"""
from __future__ import annotations

import argparse
import json
import sys


def _positive_int_one(text: str) -> int:
    vals = _positive_int_list(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return vals[0]


def _positive_int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _parents() -> dict[str, argparse.ArgumentParser]:
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    cat = argparse.ArgumentParser(add_help=False)
    cat.add_argument("--hardware-file", action="append", metavar="FILE",
                     help="extra hardware catalog (YAML, same format as the built-in one); repeatable")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("model", nargs="?", default=None,
                       help="preset name (see `plan models`), .gguf file, HF folder or config.json "
                            "(default: the bundled SmolLM2-135M GGUF)")
    model.add_argument("--weight-dtype", help="fp32|bf16|fp16|fp8|int8|int4|int4-gN[-asym]|q4_0|q4_1|q8_0|bpw:X "
                                              "(default: the model's own)")
    model.add_argument("--kv-dtype", help="KV cache dtype (default: the activation dtype)")
    model.add_argument("--act-dtype", help="activation/compute dtype: fp32|bf16|fp16|fp8|int8 "
                                           "(default: fp16 where the hardware lists it, else fp32)")
    model.add_argument("--bw-eff", type=float, help="bandwidth efficiency (default: calibrated, else 0.8)")
    model.add_argument("--compute-eff", type=float, help="compute efficiency (default: calibrated, else 0.5)")
    model.add_argument("--overhead-ms", type=float, help="fixed time per step (default: calibrated, else 0)")
    model.add_argument("--tp", type=int, help="tensor-parallel degree (default: 1; compare/capacity: the "
                                              "smallest that fits)")
    eng = argparse.ArgumentParser(add_help=False)
    eng.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (default 256)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="token budget per step, the prefill chunk size (default 2048)")
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    eng.add_argument("--memory-utilization", type=float, default=0.9, help="share of device memory used (default 0.9)")
    eng.add_argument("--runtime-overhead-gib", type=float, default=1.0,
                     help="memory for the runtime: CUDA context, graphs, fragmentation (default 1.0 GiB)")
    eng.add_argument("--max-tp", type=int, default=8, help="largest tensor-parallel degree considered (default 8)")
    cost = argparse.ArgumentParser(add_help=False)
    cost.add_argument("--years", type=float, default=3.0, help="amortization period (default 3)")
    cost.add_argument("--utilization", type=float, default=0.5,
                      help="share of hours serving at full throughput, for compare (default 0.5)")
    cost.add_argument("--usd-per-kwh", type=float, default=0.12, help="electricity price (default 0.12)")
    cost.add_argument("--pue", type=float, default=1.4, help="data-centre PUE (default 1.4)")
    cost.add_argument("--extra-usd-per-hour", type=float, default=0.0, help="per device: hosting etc. (default 0)")
    cost.add_argument("--pricing", choices=("auto", "own", "rent"), default="auto",
                      help="own: amortized price + power; rent: the catalog's $/h; auto: own when price is known")
    return {"out": out, "cat": cat, "model": model, "eng": eng, "cost": cost}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="roofline, memory, hardware comparison, cost and SLA capacity planning",
                              description="Plan hardware and deployments: arithmetic calibrated by measurement.")
    subs = p.add_subparsers(dest="plan_command", metavar="PLAN_COMMAND")
    par = _parents()
    o, c, m, e, k = par["out"], par["cat"], par["model"], par["eng"], par["cost"]
    plot = argparse.ArgumentParser(add_help=False)
    plot.add_argument("--plot", metavar="PATH", help="write a PNG chart")

    s = subs.add_parser("models", parents=[o], help="list model presets")
    s.set_defaults(func=_handler("models"))
    s = subs.add_parser("hardware", parents=[o, c], help="list the hardware catalog")
    s.set_defaults(func=_handler("hardware"))

    s = subs.add_parser("roofline", parents=[o, c, m, e, plot], help="FLOPs, bytes and bound per phase; decode vs batch")
    s.add_argument("--hardware", required=True, help="catalog name (see `plan hardware`)")
    s.add_argument("--batch", type=_positive_int_list, help="decode batch sizes to add to 1,2,4..256")
    s.add_argument("--context", type=int, default=1024, help="cached tokens per sequence at decode (default 1024)")
    s.add_argument("--prompt-len", type=int, default=512, help="prompt length for prefill/TTFT (default 512)")
    s.set_defaults(func=_handler("roofline"))

    s = subs.add_parser("memory", parents=[o, c, m, e, plot], help="what fits: weights, KV, activations; TP options")
    s.add_argument("--hardware", required=True)
    s.add_argument("--context", type=int, default=4096, help="tokens per request, prompt + output (default 4096)")
    s.set_defaults(func=_handler("memory"))

    s = subs.add_parser("compare", parents=[o, c, m, e, k, plot], help="tok/s, TTFT, tok/s/W and $/M tokens side by side")
    s.add_argument("--hardware", required=True, help="comma-separated catalog names")
    s.add_argument("--workload", default="prompt=512,output=256",
                   help="prompt=N,output=N[,batch=N] (default prompt=512,output=256; batch: memory's limit)")
    s.set_defaults(func=_handler("compare"))

    s = subs.add_parser("capacity", parents=[o, c, m, e, k, plot], help="replicas to meet an SLO at a request rate")
    s.add_argument("--hardware", required=True)
    s.add_argument("--rate", type=float, required=True, help="requests per second, online + offline")
    s.add_argument("--prompt-len", default="lognormal:512:0.8",
                   help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA | exp:MEAN | choice:A,B (default lognormal:512:0.8)")
    s.add_argument("--output-len", default="exp:256", help="same forms as --prompt-len (default exp:256)")
    s.add_argument("--slo", default="ttft_p99:1000,tpot_p99:100", help="METRIC_pPCT:MS,... (default ttft_p99:1000,tpot_p99:100)")
    s.add_argument("--offline-share", type=float, default=0.0, help="share of requests that are offline batch work")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    s.add_argument("--num-requests", type=int, default=1000, help="requests simulated per replica count")
    s.add_argument("--max-replicas", type=int, default=4096)
    s.add_argument("--spec-acceptance", type=float, metavar="A",
                   help="model speculative decoding: share of draft tokens accepted (tokenfab:spec_decode_num_"
                        "accepted_tokens / ..._num_draft_tokens); each decode then emits 1 + k*A tokens")
    s.add_argument("--spec-tokens", type=_positive_int_one, default=4, help="k drafts per decode (default 4)")
    s.add_argument("--spec-max-batch-size", type=_positive_int_one, default=4,
                   help="no speculation in steps with more decoding sequences, as the engine (default 4)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--step-table", metavar="FILE", help="measured step times (from calibrate --save-table) "
                                                        "to use instead of the roofline")
    s.add_argument("--no-step-noise", action="store_true",
                   help="cost every step at the table's fit, without its measured scatter")
    s.add_argument("--emit", nargs=2, metavar=("serve-config", "FILE"),
                   help="also write the answer as a Ray Serve config (autoscaling from the SLO and the step "
                        "costs) that `tokenfab serve --config FILE` runs (docs/scale_out.md)")
    s.set_defaults(func=_handler("capacity"))

    s = subs.add_parser("validate", parents=[o], help="the simulator's error against a measured bench run")
    s.add_argument("--bench", required=True, metavar="FILE", help="a `tokenfab bench serve --out` result")
    s.add_argument("--run", type=int, default=0, help="which run of the file (sweeps hold several)")
    s.add_argument("--step-table", required=True, metavar="FILE",
                   help="measured steps (`serve --step-log`, `calibrate --save-table`), ideally from another run")
    s.add_argument("--max-num-seqs", type=int, default=64, help="the server's setting (default: tokenfab's 64)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the server's setting (default 2048)")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, help="the server's KV pool in blocks (default: unlimited)")
    s.add_argument("--replicates", type=int, default=100,
                   help="replays with the table's measured step scatter, different seeds (default 100)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-step-noise", action="store_true",
                   help="one replay at the table's fitted step costs, without their scatter")
    s.set_defaults(func=_handler("validate"))

    s = subs.add_parser("probe", parents=[o], help="measure this machine's bandwidth and matmul peak")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--name", help="entry name (default local-DEVICE)")
    s.add_argument("--output", help="hardware file to write (default ~/.config/tokenfab/hardware.yaml)")
    s.add_argument("--buffer-mib", type=int, default=512, help="bandwidth test buffer (default 512 MiB)")
    s.add_argument("--seconds", type=float, default=0.5, help="time per measurement (default 0.5)")
    s.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    s.set_defaults(func=_handler("probe"))

    s = subs.add_parser("calibrate", parents=[o, c, m], help="time the engine and fit efficiencies for this machine")
    s.add_argument("--hardware", help="entry to calibrate (default local-DEVICE, written by `plan probe`)")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--engine-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    s.add_argument("--prompt-lens", type=_positive_int_list, default=[32, 128, 256, 512])
    s.add_argument("--batches", type=_positive_int_list, default=[1, 2, 4, 8])
    s.add_argument("--decode-tokens", type=_positive_int_list, default=[8, 40],
                   help="N1,N2: a decode step is (T(N2) - T(N1)) / (N2 - N1) (default 8,40)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    s.add_argument("--validate-batch", type=int, default=8, help="prompts in the held-out check")
    s.add_argument("--validate-output", type=int, default=24)
    s.add_argument("--no-validate", action="store_true")
    s.add_argument("--name", help="entry name to write (default: the hardware's)")
    s.add_argument("--output", help="hardware file to write (default ~/.config/tokenfab/hardware.yaml)")
    s.add_argument("--save-table", metavar="FILE", help="also write the timings as a step table (YAML)")
    s.add_argument("--dry-run", action="store_true")
    s.set_defaults(func=_handler("calibrate"))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _progress(label: str, total: int):
    """A rich progress bar for stderr, returned as (context manager, advance callback)."""
    from rich.console import Console
    from rich.progress import Progress
    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task(label, total=total)
    return bar, lambda: bar.advance(task)


def _handler(name: str):
    def handle(args) -> int:
        from tokenfab.plan import commands, render
        run = getattr(commands, f"run_{name}")
        if name in ("probe", "calibrate") and not args.json:
            total = 5 if name == "probe" else len(args.prompt_lens) + len(args.batches)
            bar, step = _progress(f"plan {name}", total)
            with bar:
                result = run(args, step)
        else:
            result = run(args)
        if getattr(args, "plot", None):
            result["plot"] = _plot(name, result, args.plot)
        if args.json:
            json.dump(result, sys.stdout, indent=2, default=str)
            print()
        else:
            getattr(render, name)(result)
            if result.get("plot"):
                print(f"plot written to {result['plot']}")
        return 0
    return handle


def _plot(name: str, r: dict, path: str) -> str:
    from tokenfab.plan import plots
    title = f"{r['model']['name']} on {r.get('hardware', '')}"
    if name == "roofline":
        p, e = r["prefill"], r["efficiency"]
        pts = [(f"prefill {p['prompt_len']}", p["intensity"], p["flops"] / p["step_s"])]
        pts += [(f"decode b={d['batch']}", d["intensity"], d["flops"] / d["step_s"]) for d in r["decode"]]
        return plots.roofline_plot(path, title, r["peak_flops"], r["bandwidth"], e["compute"], e["bandwidth"], pts,
                                   [d["batch"] for d in r["decode"]], [d["tok_s"] for d in r["decode"]],
                                   [d["step_s"] * 1e3 for d in r["decode"]])
    if name == "memory":
        return plots.memory_plot(path, title + f" at {r['settings']['context']} tokens",
                                 [{"tp": o["tp"], **o["memory"]} for o in r["tp_options"]])
    if name == "compare":
        return plots.compare_plot(path, r["model"]["name"], [row for row in r["rows"] if row["fits"]])
    if name == "capacity":
        from tokenfab.plan.workload import SLO
        return plots.capacity_plot(path, title + f", {r['traffic']['rate']:g} req/s", r.get("curve") or r["evaluations"],
                                   SLO.parse(r["slo"]).targets, r["replicas"])
    raise ValueError(f"plan {name} has no plot")
