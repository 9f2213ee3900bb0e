"""Tensor parallelism on this machine: TP=1 against TP=2 step times, the all-reduce share of a step,
and the planner's communication model against the all-reduces measured, for each CPU all-reduce
backend (tokenfab's shared-memory one and gloo).

    python benchmarks/tensor_parallel.py                  # ~40 s on the 2-core VM
    python benchmarks/tensor_parallel.py --layers 16 --batch 1 8 32 --new-tokens 48 --allreduce shm

1. An all-reduce micro-benchmark per backend (2 spawned ranks, float32 messages of 1..512 tokens x
   hidden): a least-squares fit of time = latency + bytes x 2(t-1)/t / bandwidth, the planner's ring
   formula (tokenfab/plan/comm.py), on the bare link.
2. A random-weight Llama (built from a transformers config; nothing downloaded) generates greedily at
   each batch size under TP=1 (1 thread, then all) and TP=2 (the threads split between the ranks), once
   per backend: median decode step times, rank 0's all-reduce seconds per decode step with the ranks
   aligned first, and its wait for the slower rank.
3. The planner's predicted all-reduce time per decode step (2 x layers x allreduce_s(batch x hidden x
   4 bytes)) against that measurement: with the backend's default (comm.BACKEND_DEFAULTS), the bare
   link's fit, and the engine's own all-reduces with that batch size held out.

Numbers are noisy on a shared machine: compare ratios from one run, and look at the load average it
prints at the start and the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -------------------------------------------------------------------------- 1. the link
def _allreduce_rank(rank: int, size: int, backend: str, meet, sizes: list[int], reps: int, out) -> None:
    """One rank of the micro-benchmark. `meet`: the shared buffer (shm) or the store's port (gloo)."""
    import torch.distributed as dist
    from tokenfab.distributed import group, shm
    torch.set_num_threads(1)
    if backend == "shm":
        g = shm.ShmGroup(meet, rank, size)
    else:
        store = dist.TCPStore("127.0.0.1", meet, size, is_master=False, timeout=group.COLLECTIVE_TIMEOUT)
        g = group.make_group(store, "cpu", rank, size)
    res = {}
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(5):
            g.all_reduce(x)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            g.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        res[n] = statistics.median(ts)
    if rank == 0:
        out.put(res)


def measure_allreduce(hidden: int, backend: str, reps: int = 50, size: int = 2) -> dict[int, float]:
    """Median seconds of one float32 all-reduce per message size in bytes (2 spawned ranks)."""
    import torch.distributed as dist
    from tokenfab.distributed import shm
    ctx = torch.multiprocessing.get_context("spawn")
    if backend == "shm":
        store, meet = None, shm.allocate(size)
    else:       # the ranks' group has `size` members; this process only hosts the store
        store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False)
        meet = store.port
    sizes = [hidden * 4 * n for n in (1, 4, 16, 64, 256, 512)]
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, size, backend, meet, sizes, reps, q)) for r in range(size)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(30)
    return res


def fit_link(res: dict[int, float], tp: int = 2) -> tuple[float, float]:
    """(latency µs, bandwidth GB/s) of the planner's ring formula fitted to the bare link (comm.fit_allreduce)."""
    from tokenfab.plan.comm import fit_allreduce
    f = fit_allreduce(list(res.items()), tp)
    return f.latency_us, f.gb_s


# -------------------------------------------------------------------------- 2. the engine
def make_model(folder: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from tokenfab.files.bundled import bundled_model_path
    from tokenfab.files.tokenizer import load_tokenizer
    tok = load_tokenizer(bundled_model_path())
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=True,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)


def run_engine(folder: str, tp: int, threads: int, batches: list[int], prompt_len: int, new_tokens: int,
               allreduce: str = "auto") -> dict:
    """Per batch size: greedy tokens, median decode step and rank 0's all-reduce time per decode step
    (`decode_comm_s`, ranks aligned first) and wait for the other rank (`decode_wait_s`), prefill totals."""
    from tokenfab import LLM, SamplingParams
    os.environ["TOKENFAB_TP_MEASURE_WAIT"] = "1"
    llm = LLM(folder, tensor_parallel_size=tp, num_threads=threads, adaptive_threads=False, max_model_len=prompt_len + new_tokens + 8,
              num_kv_blocks=max(batches) * (-(-(prompt_len + new_tokens + 8) // 16)) + 8,
              kernel_autotune=False, enable_prefix_caching=False, tp_allreduce=allreduce,
              kv_cache_dtype="float32")   # TP=1 would take float16 pools under auto; compare like with like
    eng = llm.engine
    comm = eng.runner.comm if tp > 1 else None
    # (prefill?, tokens, seconds, all-reduce seconds, wait seconds, all-reduce calls, all-reduce bytes)
    steps: list[tuple] = []
    last = [0.0, 0.0, 0, 0]
    counters = lambda: [comm.seconds, comm.wait_seconds, comm.calls, comm.bytes] if comm else [0.0, 0.0, 0, 0]  # noqa: E731

    def observe(shapes, start, end, busy):
        now = counters()
        d = [a - b for a, b in zip(now, last)]
        steps.append((any(n > 1 for _, n in shapes), sum(n for _, n in shapes), end - start, d[0], d[1], d[2], d[3]))
        last[:] = now
    eng.step_observer = observe
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = {}
    llm.generate([list(range(100, 100 + prompt_len))], params, use_tqdm=False)       # warm-up
    for b in batches:
        prompts = [[(7 * i + j) % 30000 + 50 for j in range(prompt_len)] for i in range(b)]
        del steps[:]
        last[:] = counters()
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        dec = [s for s in steps if not s[0]]
        pre = [s for s in steps if s[0]]
        out[b] = dict(tokens=toks, decode_s=statistics.median(s[2] for s in dec),
                      decode_comm_s=statistics.median(s[3] for s in dec),
                      decode_wait_s=statistics.median(s[4] for s in dec),
                      prefill_s=sum(s[2] for s in pre), prefill_comm_s=sum(s[3] for s in pre),
                      prefill_tokens=sum(s[1] for s in pre),
                      # per step: (all-reduce calls, bytes, seconds): the calibration samples
                      decode_deltas=[(s[5], s[6], s[3]) for s in dec], prefill_deltas=[(s[5], s[6], s[3]) for s in pre])
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--allreduce", nargs="+", choices=("shm", "gloo"), default=["shm", "gloo"],
                    help="the TP=2 engine's all-reduce backends (tp_allreduce), each against its planner default; "
                         "the first one's in-engine fit is what --save-hardware writes (default: shm gloo)")
    ap.add_argument("--save-hardware", metavar="FILE",
                    help="write the in-engine link fit into entry --hardware-name of this YAML hardware file "
                         "(the calibration hook: `tokenfab plan memory --hardware-file FILE` then uses it)")
    ap.add_argument("--hardware-name", default="dev-vm-2core", help="entry to copy and update (default dev-vm-2core)")
    args = ap.parse_args()
    t_start = time.monotonic()
    print(f"benchmarks/tensor_parallel.py {' '.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} "
          f"UTC, load average {os.getloadavg()[0]:.1f})")

    links = {}
    for b in args.allreduce:
        print(f"{b} all-reduce, 2 ranks in a tight loop, float32 (hidden {args.hidden}):")
        res = measure_allreduce(args.hidden, b)
        lat_us, gb_s = links[b] = fit_link(res)
        for n, sec in res.items():
            fit = lat_us * 1e-6 + n / (gb_s * 1e9)      # 2(t-1)/t = 1 at t = 2
            print(f"  {n // (4 * args.hidden):4d} tokens ({n / 1024:7.1f} KiB): {sec * 1e6:8.1f} µs measured, "
                  f"{fit * 1e6:8.1f} µs fitted ({(fit - sec) / sec:+.0%})")
        print(f"  fit (the planner's ring formula): interconnect_latency_us {lat_us:.0f}, interconnect_gb_s {gb_s:.2f}")

    folder = tempfile.mkdtemp(prefix="tokenfab-tp-bench-")
    make_model(folder, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    cores = os.cpu_count() or 1
    one_1 = run_engine(folder, 1, 1, args.batch, args.prompt_len, args.new_tokens)
    one = run_engine(folder, 1, cores, args.batch, args.prompt_len, args.new_tokens) if cores > 1 else one_1
    two = {b: run_engine(folder, 2, max(1, cores // 2), args.batch, args.prompt_len, args.new_tokens, b)
           for b in args.allreduce}

    from dataclasses import replace
    from tokenfab.plan import roofline
    from tokenfab.plan.comm import BACKEND_DEFAULTS, fit_allreduce, step_samples
    from tokenfab.plan.hardware import get_hardware, load_catalog, save_entry
    from tokenfab.plan.models import resolve_model
    catalog_hw = get_hardware(args.hardware_name, load_catalog(include_user=False))
    spec = resolve_model(folder)

    def comm_per_step(hw, batch: int) -> float:
        dep = roofline.Deployment.make(spec, hw, weight_dtype="fp32", act_dtype="fp32", tp=2)
        return 2 * spec.layers * roofline.allreduce_s(dep, dep.act_dtype.nbytes(batch * spec.hidden))

    print(f"\nrandom Llama: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV, "
          f"MLP {args.intermediate}; prompts of {args.prompt_len} tokens, {args.new_tokens} new; "
          f"TP=2: {max(1, cores // 2)} thread(s) per rank; {catalog_hw.name} uses {catalog_hw.interconnect_backend}")
    print("| all-reduce | batch | TP=1 decode ms (1 thread / {0}) | TP=2 decode ms | TP=2 / TP=1 (1 thread / {0}) "
          "| all-reduce share | wait share | all-reduce ms/step | planner ms/step: backend default "
          "| link fit | engine fit, this batch held out | TP=2 / TP=1 prefill (1 thread) |".format(cores))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fits = {}
    for b in args.allreduce:
        samples = {n: step_samples(two[b][n]["decode_deltas"] + two[b][n]["prefill_deltas"]) for n in args.batch}
        default_hw = replace(catalog_hw, **BACKEND_DEFAULTS[b])
        link_hw = replace(catalog_hw, interconnect_latency_us=links[b][0], interconnect_gb_s=links[b][1])
        for n in args.batch:
            a1, a, t = one_1[n], one[n], two[b][n]
            same = a["tokens"] == t["tokens"] == a1["tokens"]
            meas = t["decode_comm_s"]
            others = [x for o in args.batch if o != n for x in samples[o]]
            preds = [comm_per_step(default_hw, n), comm_per_step(link_hw, n)]
            if others:
                f = fit_allreduce(others)
                preds.append(comm_per_step(replace(catalog_hw, interconnect_gb_s=f.gb_s,
                                                   interconnect_latency_us=f.latency_us), n))
            cells = " | ".join(f"{p * 1e3:.2f} ({(p - meas) / meas:+.0%})" for p in preds) + (" | n/a" if not others else "")
            print(f"| {b} | {n} | {a1['decode_s'] * 1e3:.1f} / {a['decode_s'] * 1e3:.1f} | {t['decode_s'] * 1e3:.1f} "
                  f"| {t['decode_s'] / a1['decode_s']:.2f}x / {t['decode_s'] / a['decode_s']:.2f}x | {meas / t['decode_s']:.0%} "
                  f"| {t['decode_wait_s'] / t['decode_s']:.0%} | {meas * 1e3:.2f} | {cells} "
                  f"| {t['prefill_s'] / a1['prefill_s']:.2f}x |" + ("" if same else " (greedy tokens differ!)"))
        fits[b] = fit_allreduce([x for n in args.batch for x in samples[n]])
    print("all-reduce: rank 0's time in the all-reduces once both ranks are there; wait: rank 0's time "
          "waiting for the other rank first. Both include the step's Python and pickling skew, not "
          "just the link. Planner columns: predicted ms/step (error against the measured all-reduce ms/step); "
          "backend default: plan/comm.py BACKEND_DEFAULTS.")
    for b, fit in fits.items():
        by_size: dict[float, list[float]] = {}
        for n in args.batch:
            for nbytes, sec in step_samples(two[b][n]["decode_deltas"] + two[b][n]["prefill_deltas"]):
                by_size.setdefault(nbytes, []).append(sec)
        print(f"{b} in the engine, median µs per all-reduce by message size: " + ", ".join(
            f"{k / 1024:.0f} KiB {statistics.median(v) * 1e6:.0f} ({len(v)})" for k, v in sorted(by_size.items())))
        print(f"{b} in-engine fit over every step: interconnect_latency_us {fit.latency_us:.0f}, interconnect_gb_s "
              f"{fit.gb_s:.2f} (mean error {fit.mean_abs_rel_error:.0%} over {fit.samples} steps; the bare link: "
              f"{links[b][0]:.0f} µs, {links[b][1]:.2f} GB/s)")
    if args.save_hardware:
        b = args.allreduce[0]
        entry = {**catalog_hw.to_entry(), **fits[b].entry(), "interconnect_backend": b}
        path = save_entry(args.save_hardware, catalog_hw.name, entry)
        print(f"wrote {catalog_hw.name} with the {b} in-engine link fit to {path}")
    print(f"took {time.monotonic() - t_start:.0f} s; load average at the end {os.getloadavg()[0]:.1f} (this "
          "benchmark itself keeps it near 1-2; more means other work shared the cores and the numbers with it)")


if __name__ == "__main__":
    main()
