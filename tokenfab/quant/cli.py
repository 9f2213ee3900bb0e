"""`tokenfab quant`: write a quantized checkpoint, or measure a candidate against full precision.

    tokenfab quant [MODEL] --scheme int4-g32 --out DIR [--calib FILE] [--keep-float lm_head,...]
    tokenfab quant eval [--base MODEL] --candidate int8|gguf|DIR [--text FILE] [--ctx 512] [--json]

One parser serves both forms (argparse cannot put an optional MODEL beside an `eval` sub-command):
the first word `eval` selects evaluation, and options of the other form are refused by name.
Registering the parser imports neither torch nor the quant modules.
"""
from __future__ import annotations

import argparse
import json
import sys

EVAL_WORD = "eval"
_WRITE_ONLY = ("scheme", "out", "calib", "calib_tokens", "max_kl")
_EVAL_ONLY = ("base", "candidate", "text", "ctx", "max_windows", "plot", "sensitivity", "sensitivity_by",
              "kv_cache_dtype", "kernel", "speed")


def add_parser(subs) -> None:
    p = subs.add_parser(
        "quant", add_help=False, help="quantize a model to a checkpoint folder, or evaluate quality against full precision",
        usage="tokenfab quant [MODEL] --scheme SCHEME --out DIR [--calib FILE] [--keep-float NAMES] [--max-kl KL]\n"
              "       tokenfab quant eval [--base MODEL] --candidate MODEL_OR_SCHEME [--text FILE] [--ctx N] "
              "[--json] [--plot PNG] [--sensitivity] [--speed [N]]",
        description="Write: quantize MODEL's float weights (default: the bundled model) with SCHEME into a folder "
                    "that `LLM(model=DIR)` and `tokenfab serve DIR` load. Eval: KL divergence, same top-1, Δp and "
                    "perplexity of a candidate against the float base, as llama.cpp's perplexity tool reports them.")
    p.add_argument("target", nargs="?", default=None, metavar="MODEL | eval",
                   help="a .gguf file or HF folder to quantize (default: the bundled model), or the word eval")
    w = p.add_argument_group("write a checkpoint")
    w.add_argument("--scheme", metavar="SCHEME", help="int8, int4-g32, int4-g64, int4-g128 or awq-int4-g128 (int4 = int4-g32)")
    w.add_argument("--out", metavar="DIR", help="folder to write (new, empty, or an earlier tokenfab checkpoint)")
    w.add_argument("--calib", metavar="FILE", help="calibration text for AWQ schemes "
                   "(default: the bundled text's calibration slice, disjoint from what eval scores)")
    w.add_argument("--calib-tokens", type=int, metavar="N", default=None,
                   help="calibration tokens for AWQ (default: 1024) or --max-kl (default: 256)")
    w.add_argument("--max-kl", type=float, metavar="KL", default=None,
                   help="automatic mixed precision: each decoder linear takes --scheme (default int4-g32), int8 or "
                        "float, the fewest bytes whose mean KL on the calibration text is at most KL")
    _eval_args(p.add_argument_group("eval"))
    _common_args(p.add_argument_group("both"))
    # `quant eval --help` shows eval's own help (one parser serves both forms, so argparse cannot).
    p.add_argument("-h", "--help", action=_Help, nargs=0, help="show this help message and exit")
    p.set_defaults(func=cmd_quant)


EVAL_DESCRIPTION = ("Measure a candidate (a scheme quantized now, the GGUF's own blocks, or a checkpoint folder) "
                    "against the full-precision base on held-out text: KL divergence, same top-1, Δp and perplexity, "
                    "as llama.cpp's perplexity tool reports them.")


def _eval_args(e) -> None:
    e.add_argument("--base", default=None, metavar="MODEL", help="the full-precision model (default: the bundled model, run as float)")
    e.add_argument("--candidate", metavar="MODEL_OR_SCHEME", help="a scheme name (quantizes the base now), gguf (the base file's blocks as "
                   "shipped), none (float weights; with --kv-cache-dtype int8), or a model path such as a folder "
                   "written by `tokenfab quant`")
    e.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default=None,
                   help="int8: the candidate attends over the int8 KV cache (default: auto, float)")
    e.add_argument("--kernel", choices=("auto", "qgemm", "qmadd", "qdot", "qtile", "packed", "float", "bf16", "dequant"), default=None,
                   help="quantized layers' path: auto (by token count; whole windows dequantize, so the numbers "
                        "are the weights' error), qdot (int8 activation blocks, integer dot products), packed "
                        "(torch's packed CPU kernels, bf16 activations), bf16 (a bfloat16 oneDNN copy; CPUs with bf16 units) or dequant. Decode's C kernel (qgemm) "
                        "computes in float32, as dequant does; qtile is the same on AMX int8 tiles (CPUs with amx_int8), qmadd "
                        "the same with the outputs in the vector lanes (big batches on AVX2)")
    e.add_argument("--text", metavar="FILE", help="evaluation text (default: the bundled human-written English)")
    e.add_argument("--ctx", type=int, metavar="N", default=None, help="tokens per window (default: 512)")
    e.add_argument("--max-windows", type=int, metavar="N", default=None,
                   help="windows to score, 0 = all of the text (default: 2, about 1,000 tokens)")
    e.add_argument("--plot", metavar="PNG", help="write a histogram of per-token KL")
    e.add_argument("--sensitivity", action="store_true",
                   help="add the per-layer table: KL on the first window when only that layer is quantized")
    e.add_argument("--speed", type=int, nargs="?", const=32, default=None, metavar="TOKENS",
                   help="also time both models' single-stream greedy decode of TOKENS tokens (default 32), "
                        "alternately in this run, and report tokens/s beside the KL")
    e.add_argument("--sensitivity-by", choices=("block", "linear", "kind"), default=None,
                   help="what one row quantizes: a decoder block (default), one linear, or one kind (q/k/v...)")


def _common_args(c) -> None:
    c.add_argument("--keep-float", metavar="NAMES", default=None,
                   help="comma-separated layer names or patterns kept in float, e.g. lm_head,layers.0 "
                        "(replaces the default: embeddings and LM head)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.add_argument("--num-threads", type=int, metavar="N", default=None,
                   help="torch intra-op threads (default: 1 while the machine is busy, i.e. its load average "
                        "is at least its core count; otherwise torch's choice)")


class _Help(argparse.Action):
    """-h/--help: after the word `eval`, the help of `tokenfab quant eval` alone."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "target", None) == EVAL_WORD:
            parser = argparse.ArgumentParser(
                prog="tokenfab quant eval", description=EVAL_DESCRIPTION,
                usage="tokenfab quant eval [--base MODEL] --candidate MODEL_OR_SCHEME [--text FILE] [--ctx N] "
                      "[--json] [--plot PNG] [--sensitivity]")
            _eval_args(parser.add_argument_group("eval"))
            _common_args(parser.add_argument_group("options"))
        parser.print_help()
        parser.exit()

def _given(args, names) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]


def _keep_float(args) -> list[str] | None:
    if args.keep_float is None:
        return None
    names = [n.strip() for n in args.keep_float.split(",") if n.strip()]
    return names   # an empty list means: keep nothing float


def cmd_quant(args) -> int:
    from tokenfab.cli_errors import CLIError

    if args.target == EVAL_WORD:
        wrong = _given(args, _WRITE_ONLY)
        if wrong:
            raise CLIError(f"{', '.join(wrong)} belong(s) to `tokenfab quant MODEL --scheme ... --out DIR`, not to eval")
        return cmd_eval(args)
    wrong = _given(args, _EVAL_ONLY)
    if wrong:
        raise CLIError(f"{', '.join(wrong)} belong(s) to `tokenfab quant eval`; write `tokenfab quant eval {wrong[0]} ...`")
    return cmd_write(args)


def _validate_scheme(name: str) -> str:
    from tokenfab.quant.schemes import parse_scheme
    return parse_scheme(name).name


def _status():
    """A spinner on stderr (stdout stays clean for --json) whose text the work updates."""
    from rich.console import Console
    return Console(stderr=True).status("starting", spinner="dots")


def cmd_write(args) -> int:
    from tokenfab.cli_errors import CLIError
    mixed = args.max_kl is not None
    if mixed and not args.scheme:
        args.scheme = "int4-g32"
    if not args.scheme or not args.out:
        raise CLIError("writing a checkpoint needs --scheme (int8, int4-g32, int4-g64, int4-g128, awq-int4-g128) "
                       "or --max-kl, and --out DIR; to evaluate, use `tokenfab quant eval --candidate ...`")
    scheme = _validate_scheme(args.scheme)
    if args.calib_tokens is not None and args.calib_tokens < 2:
        raise CLIError(f"--calib-tokens must be at least 2, got {args.calib_tokens}")
    if mixed and not args.max_kl > 0:
        raise CLIError(f"--max-kl must be a positive KL in nats, e.g. 0.01, got {args.max_kl}")
    if mixed and args.keep_float is not None:
        raise CLIError("--max-kl chooses which decoder linears stay float; --keep-float does not apply to it "
                       "(embeddings and LM head stay float)")
    _threads(args)
    from tokenfab.quant.export import DEFAULT_CALIB_TOKENS, DEFAULT_MIXED_CALIB_TOKENS, quantize_to_folder
    from tokenfab.quant.schemes import parse_scheme
    if args.calib and not parse_scheme(scheme).awq and not mixed:
        print(f"note: --calib is only used by AWQ schemes and --max-kl; {scheme} is plain round-to-nearest",
              file=sys.stderr)
    tokens = args.calib_tokens or (DEFAULT_MIXED_CALIB_TOKENS if mixed else DEFAULT_CALIB_TOKENS)
    with _status() as status:
        res = quantize_to_folder(args.target, scheme, args.out, calib_path=args.calib, calib_tokens=tokens,
                                 keep_float=_keep_float(args), progress=status.update, max_kl=args.max_kl)
    info = {"out": res.out, "scheme": res.scheme, "quantized_linears": res.quantized, "kept_float": res.kept_float,
            "weight_bytes_before": res.float_bytes, "weight_bytes_after": res.quant_bytes,
            "calib_tokens": res.calib_tokens, "seconds": round(res.seconds, 1)}
    if res.mixed is not None:
        info["mixed"] = res.mixed
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    Console().print(f"[bold]{res.scheme}[/]: {res.quantized} linears quantized "
                    f"({res.float_bytes / 2**20:,.1f} MiB → {res.quant_bytes / 2**20:,.1f} MiB), kept float: "
                    f"{_kept_text(res)}; {res.seconds:.0f} s\nwrote {res.out} "
                    f"(load it with LLM(model={res.out!r}) or `tokenfab serve {res.out}`)")
    return 0


def _kept_text(res) -> str:
    if res.mixed is None:
        return ", ".join(res.kept_float) or "none"
    m = res.mixed
    counts = ", ".join(f"{n} {f}" for f, n in m["counts"].items())
    return (f"{counts} (mean KL {m['measured_kl']:.5f} on the calibration text, budget {m['max_kl']}; all-int8 "
            f"would be {m['bytes_by_format']['int8'] / 2**20:,.1f} MiB)")


def _threads(args) -> None:
    """Set torch's threads. On a busy machine (other jobs on every core) torch's parallel regions
    wait for descheduled threads: on the shared 2-core dev machine at load 3-5, `quant eval` ran
    3-7x faster with 1 thread than with torch's default of 2 (measured), so 1 is the busy default."""
    import os

    import torch
    n = args.num_threads
    if n is not None and n < 1:
        raise ValueError(f"--num-threads must be a positive integer, got {n}")
    if n is None:
        cores = os.cpu_count() or 1
        busy = hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores
        n = 1 if busy and cores > 1 else None
    if n is not None:
        torch.set_num_threads(n)


def cmd_eval(args) -> int:
    import os

    from tokenfab.cli_errors import CLIError
    if not args.candidate:
        raise CLIError("eval needs --candidate: a scheme (int8, int4-g32, ...), gguf, or a model path")
    from tokenfab.quant.compare import DEFAULT_CTX, DEFAULT_MAX_WINDOWS, candidate_kind, evaluate
    if candidate_kind(args.candidate) == "path" and not os.path.exists(os.path.expanduser(args.candidate)):
        from tokenfab.quant.schemes import SCHEMES
        raise CLIError(f"--candidate {args.candidate!r} is not a scheme ({', '.join(SCHEMES)}), not gguf or none, "
                       "and not an existing model path")
    ctx = DEFAULT_CTX if args.ctx is None else args.ctx
    if ctx < 2:
        raise CLIError(f"--ctx must be at least 2 tokens, got {ctx}")
    max_windows = DEFAULT_MAX_WINDOWS if args.max_windows is None else args.max_windows
    if max_windows < 0:
        raise CLIError(f"--max-windows must be 0 (all) or positive, got {max_windows}")
    if args.text and not os.path.isfile(args.text):
        raise CLIError(f"--text {args.text}: no such file")
    if args.speed is not None and args.speed < 2:
        raise CLIError(f"--speed needs at least 2 tokens to time, got {args.speed}")
    _threads(args)
    with _status() as status:
        res = evaluate(args.base, args.candidate, text=args.text, ctx=ctx, max_windows=max_windows,
                       sensitivity=args.sensitivity, sensitivity_by=args.sensitivity_by or "block",
                       keep_float=_keep_float(args), kv_cache_dtype=args.kv_cache_dtype or "auto",
                       kernel=args.kernel or "auto", speed_tokens=args.speed or 0, progress=status.update)
    if args.plot:
        from tokenfab.quant.eval import kl_histogram_png
        kl_histogram_png(res.stats.kl, args.plot, title=f"KL(base ‖ {args.candidate}) per token, "
                                                        f"{res.report.tokens} tokens")
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
        return 0
    _print_eval(res, args.plot)
    return 0


def _print_eval(res, plot: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    kv = (" with the int8 KV cache" if res.kv_cache_dtype == "int8" else "") + \
        (f", {res.kernel} kernels" if res.kernel != "auto" else "")
    con.print(f"[bold]{res.candidate}[/]{kv} against the float base {res.base}: {res.windows} windows of {res.ctx} "
              f"tokens, {res.seconds:.0f} s")
    t = Table()
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in res.report.rows():
        t.add_row(k, v)
    con.print(t)
    if res.speed is not None:
        sp = res.speed
        con.print(f"decode speed ({sp.tokens} greedy tokens, one stream): base {sp.base_tokens_per_s:.1f} tok/s, "
                  f"candidate {sp.candidate_tokens_per_s:.1f} tok/s ({sp.speedup:.2f}x)")
    if res.sensitivity is not None:
        s = Table(title=f"per-layer sensitivity: {res.sensitivity_scheme} on one group at a time (first window)")
        for col in ("layers", "mean KL", "max KL", "same top-1"):
            s.add_column(col, justify="left" if col == "layers" else "right")
        for r in res.sensitivity:
            s.add_row(r.name, f"{r.kl_mean:.6f}", f"{r.kl_max:.4f}", f"{r.same_top1_pct:.1f} %")
        con.print(s)
        con.print("the top rows are the candidates for --keep-float")
    if plot:
        con.print(f"KL histogram: {plot}")
