"""The diagnosis: measured numbers in, findings out. Pure: no I/O, no clock.

    findings = diagnose(window, bench=result_json, dep=deployment)

Each rule reads the `Measured` summary of a metrics window (and the bench result or the roofline
where it needs them) and either stays silent or returns one `Finding`: what limits the
deployment, the numbers that show it, and the flags to change. Thresholds are module constants so
the tests and the docs can name them. The symptom table follows the accelerator-deployment
troubleshooting guides: KV full with preemptions -> KV capacity; a growing queue -> capacity; high
TTFT with a normal TPOT -> prefill-bound; P99 far above P50 in the long-prompt bucket -> isolate
long prompts; decode at the bandwidth roofline -> fewer bytes per step; small-batch steps far
above the roofline -> host overhead.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tokenfab.doctor.scrape import Window

KV_FULL = 0.90              # usage at which admission starts to fail
KV_ROOMY = 0.80             # below this the pool is not what holds the batch back
QUEUE_GROWTH_MIN = 2        # waiting requests at the end that, growing, mean a queue
QUEUE_SHARE = 0.5           # TTFT mostly queue time
QUEUE_MIN_S = 0.05
PREFILL_SHARE = 0.5         # TTFT mostly prefill (not queue)
PREFILL_TTFT_OVER_ITL = 10  # "high TTFT with a normal TPOT": TTFT at least this many decode steps
PREFILL_MIN_S = 0.2
TAIL_RATIO = 3.0            # P99 / P50
TAIL_BUCKET_RATIO = 2.0     # longest bucket's P99 over every shorter bucket's
BW_BOUND_FRACTION = 0.5     # measured step within 2x of the bandwidth roofline
OVERHEAD_RATIO = 3.0        # measured step over 3x the roofline's ...
OVERHEAD_MAX_BATCH = 4      # ... at a batch this small
OFF_ROOFLINE_RATIO = 3.0    # a memory-bound decode step this many times its roofline: the step is the bottleneck
KERNEL_SHARE = 0.5          # ... and, at a small batch, the linear kernels' measured time is at least this share

ORDER = ("kv_capacity", "queueing", "prefill_compute", "long_tail", "decode_bandwidth", "decode_efficiency",
         "host_overhead")


@dataclass(slots=True)
class Finding:
    kind: str                  # one of ORDER
    title: str
    evidence: list[str]        # sentences with the numbers
    advice: list[str]          # what to change, each naming a flag or a command
    numbers: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Measured:
    """What one metrics window shows; None where the window had no observation of it."""
    seconds: float
    running: float                 # mean of the two scrapes
    waiting_before: float
    waiting_after: float
    kv_usage: float                # the higher of the two scrapes
    preemptions: float
    generation_tok_s: float
    prompt_tok_s: float
    finished_per_s: float
    first_tokens: float            # requests that got their first token in the window
    prompt_len_mean: float | None  # prompt tokens per first token
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    queue_mean_s: float | None
    itl_mean_s: float | None
    prefix_hit_rate: float | None
    config: dict                   # max_num_seqs, max_num_batched_tokens, num_kv_blocks, block_size, ...

    @classmethod
    def from_window(cls, w: Window) -> "Measured":
        first = w.count("time_to_first_token_seconds")
        queries = w.delta("prefix_cache_queries_total")
        return cls(
            seconds=w.seconds, running=(w.gauge("num_requests_running") + w.gauge_before("num_requests_running")) / 2,
            waiting_before=w.gauge_before("num_requests_waiting"), waiting_after=w.gauge("num_requests_waiting"),
            kv_usage=max(w.gauge("kv_cache_usage_perc"), w.gauge_before("kv_cache_usage_perc")),
            preemptions=w.delta("num_preemptions_total"), generation_tok_s=w.rate("generation_tokens_total"),
            prompt_tok_s=w.rate("prompt_tokens_total"), finished_per_s=w.rate("request_success_total"),
            first_tokens=first,
            prompt_len_mean=w.delta("prompt_tokens_total") / first if first else None,
            ttft_mean_s=w.mean("time_to_first_token_seconds"),
            ttft_p50_s=w.quantile("time_to_first_token_seconds", 0.5),
            ttft_p99_s=w.quantile("time_to_first_token_seconds", 0.99),
            queue_mean_s=w.mean("request_queue_time_seconds"), itl_mean_s=w.mean("inter_token_latency_seconds"),
            prefix_hit_rate=w.delta("prefix_cache_hits_total") / queries if queries else None,
            config=_config(w.after.info))

    def to_dict(self) -> dict:
        return asdict(self)


def _config(info: dict[str, str]) -> dict:
    out: dict = {}
    for k, v in info.items():
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = v
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


# -- the rules ----------------------------------------------------------------------------------
def kv_capacity(m: Measured) -> Finding | None:
    cap = m.config.get("max_num_seqs")
    slots_free = cap is None or m.running < cap
    # The scheduler preempts only when no KV block is free, so a preemption in the window is the pool
    # running out. The usage gauge is a point sample at each scrape and may catch the pool between bursts.
    preempting = m.preemptions > 0
    blocked = m.kv_usage >= KV_FULL and m.waiting_after > 0 and slots_free
    if not (preempting or blocked):
        return None
    ev = [f"KV cache usage reached {m.kv_usage:.0%}"
          + (f" of {m.config['num_kv_blocks']} blocks × {m.config.get('block_size', '?')} tokens"
             if "num_kv_blocks" in m.config else "") + "."]
    if m.preemptions:
        ev.append(f"{m.preemptions:.0f} sequence(s) were preempted in {m.seconds:.0f} s "
                  f"({m.preemptions / m.seconds:.2f}/s): each one's KV is thrown away and recomputed.")
    if m.waiting_after > 0:
        ev.append(f"{m.waiting_after:.0f} request(s) wait while {m.running:.1f} run"
                  + (f" of {cap} allowed by --max-num-seqs" if cap else "") + ": the pool, not the cap, "
                  "stops admission.")
    advice = ["give the KV pool more memory: --kv-cache-memory-bytes (or --num-kv-blocks)"]
    if m.config.get("kv_cache_dtype", "auto") != "int8":
        advice.append("--kv-cache-dtype int8 holds about twice the tokens in the same memory "
                      "(4x against float32)")
    advice.append("--quantization int8 or int4 shrinks the weights, leaving memory for KV where they share it")
    if m.preemptions:
        advice.append("or lower --max-num-seqs so that fewer sequences share the pool and none is recomputed")
    return Finding("kv_capacity", "KV-cache capacity limits the batch", ev, advice,
                   {"kv_usage": m.kv_usage, "preemptions": m.preemptions, "waiting": m.waiting_after})


def queueing(m: Measured) -> Finding | None:
    growing = m.waiting_after >= QUEUE_GROWTH_MIN and m.waiting_after > m.waiting_before
    share = m.queue_mean_s / m.ttft_mean_s if m.queue_mean_s is not None and m.ttft_mean_s else None
    queue_bound = share is not None and share >= QUEUE_SHARE and m.queue_mean_s >= QUEUE_MIN_S
    if not (growing or queue_bound):
        return None
    ev = []
    if growing or m.waiting_after > m.waiting_before:
        ev.append(f"the waiting queue grew from {m.waiting_before:.0f} to {m.waiting_after:.0f} in {m.seconds:.0f} s.")
    if share is not None:
        ev.append(f"queue time is {share:.0%} of TTFT (mean {_ms(m.queue_mean_s)} of {_ms(m.ttft_mean_s)}).")
    # Arrivals ≈ completions + growth of what is in the server.
    arrivals = m.finished_per_s + max(0.0, m.waiting_after - m.waiting_before) / m.seconds
    advice = []
    cap = m.config.get("max_num_seqs")
    if cap and m.running >= 0.9 * cap and m.kv_usage < KV_ROOMY:
        advice.append(f"the batch is at --max-num-seqs {cap} with the KV pool {m.kv_usage:.0%} full: "
                      "raise --max-num-seqs")
    if m.finished_per_s > 0:
        replicas = max(2, math.ceil(arrivals / m.finished_per_s))
        advice.append(f"requests arrive at about {arrivals:.2f}/s and finish at {m.finished_per_s:.2f}/s: about "
                      f"{replicas} replicas; size it with `tokenfab plan capacity --rate {arrivals:.2f} ...`")
    else:
        advice.append("more replicas: size them with `tokenfab plan capacity --rate RATE ...`")
    return Finding("queueing", "Requests queue: offered load exceeds capacity", ev, advice,
                   {"waiting_before": m.waiting_before, "waiting_after": m.waiting_after, "queue_share": share,
                    "arrivals_per_s": arrivals, "finished_per_s": m.finished_per_s})


def prefill_compute(m: Measured, dep=None) -> Finding | None:
    if m.ttft_mean_s is None or m.itl_mean_s is None:
        return None
    prefill_s = m.ttft_mean_s - (m.queue_mean_s or 0.0)
    if not (m.ttft_mean_s >= PREFILL_MIN_S and prefill_s >= PREFILL_SHARE * m.ttft_mean_s
            and m.ttft_mean_s >= PREFILL_TTFT_OVER_ITL * m.itl_mean_s):
        return None
    ev = [f"mean TTFT is {_ms(m.ttft_mean_s)}, {m.ttft_mean_s / m.itl_mean_s:.0f}x the mean inter-token latency "
          f"{_ms(m.itl_mean_s)}, and {prefill_s / m.ttft_mean_s:.0%} of it is prefill, not queue."]
    numbers = {"ttft_mean_s": m.ttft_mean_s, "prefill_s": prefill_s, "itl_mean_s": m.itl_mean_s}
    bound = None
    if dep is not None and m.prompt_len_mean:
        from tokenfab.plan import roofline
        n = max(1, round(m.prompt_len_mean))
        whole, ceiling_s = roofline.prefill(dep, n, m.config.get("max_num_batched_tokens"))
        bound = whole.bound
        ev.append(f"a {n}-token prompt is {bound}-bound on {dep.hardware.name} (roofline prefill "
                  f"{_ms(ceiling_s)}; measured about {_ms(prefill_s)}).")
        numbers.update(roofline_prefill_s=ceiling_s, bound=bound)
    if m.prompt_len_mean:
        ev.append(f"prompts average {m.prompt_len_mean:.0f} tokens; prefill runs {m.prompt_tok_s:.0f} tok/s.")
    advice = []
    if m.prefix_hit_rate is not None and m.prefix_hit_rate < 0.3:
        advice.append(f"prefix-cache hit rate is {m.prefix_hit_rate:.0%}: shared system prompts skip prefill "
                      "with --enable-prefix-caching (put the shared part first)")
    advice.append("--quantization w8a8 runs the prefill matmuls in int8 (faster where compute bounds them)")
    advice.append("a smaller --max-num-batched-tokens interleaves long prefills with decodes (protects TPOT, "
                  "not TTFT); faster hardware: compare with `tokenfab plan compare`")
    title = "Prefill bounds TTFT" + (" (compute-bound)" if bound == "compute" else "")
    return Finding("prefill_compute", title, ev, advice, numbers)


def long_tail(bench: dict | None) -> Finding | None:
    if not bench or not bench.get("runs"):
        return None
    run = bench["runs"][-1]
    s = run.get("summary", {})
    for metric in ("ttft", "e2el"):
        p50, p99 = s.get(f"median_{metric}_ms"), s.get(f"p99_{metric}_ms")
        if not p50 or not p99 or p99 < TAIL_RATIO * p50:
            continue
        buckets = [b for b in run.get("buckets", []) if b.get("completed") and b.get(f"p99_{metric}_ms") is not None]
        if len(buckets) < 2:
            continue
        longest, shorter = buckets[-1], buckets[:-1]
        worst_short = max(b[f"p99_{metric}_ms"] for b in shorter)
        if longest[f"p99_{metric}_ms"] < TAIL_BUCKET_RATIO * worst_short:
            continue
        name = {"ttft": "TTFT", "e2el": "end-to-end latency"}[metric]
        ev = [f"P99 {name} is {p99:.0f} ms, {p99 / p50:.1f}x the P50 of {p50:.0f} ms.",
              f"the tail sits in the longest prompts: bucket {longest['bucket']} tokens ({longest['completed']} "
              f"requests) has P99 {longest[f'p99_{metric}_ms']:.0f} ms against at most {worst_short:.0f} ms in "
              "the shorter buckets."]
        advice = [f"isolate prompts over {longest['low']} tokens on their own replicas (size each pool with "
                  "`tokenfab plan capacity`), or route them by length (--long-prompt-threshold where the "
                  "router has it)",
                  "a smaller --max-num-batched-tokens chunks long prefills finer, so they stall others less"]
        return Finding("long_tail", f"A long {name} tail from long prompts", ev, advice,
                       {"metric": metric, "p50_ms": p50, "p99_ms": p99, "bucket": longest["bucket"],
                        "bucket_p99_ms": longest[f"p99_{metric}_ms"], "other_buckets_p99_ms": worst_short})
    return None


def _decode_ceiling(m: Measured, dep):
    """(batch, roofline decode step) at the window's mean batch and context; None without decodes."""
    if dep is None or m.itl_mean_s is None or m.generation_tok_s <= 0:
        return None
    from tokenfab.plan import roofline
    batch = max(1, round(m.running))
    # Mean context during decode: the prompt plus half the output, guessed from the token rates.
    out_per_req = m.generation_tok_s / m.finished_per_s if m.finished_per_s else 0.0
    context = round((m.prompt_len_mean or 0) + out_per_req / 2)
    return batch, context, roofline.decode(dep, batch, context)


def decode_bandwidth(m: Measured, dep=None) -> Finding | None:
    got = _decode_ceiling(m, dep)
    if got is None:
        return None
    batch, context, st = got
    achieved = st.total_s / m.itl_mean_s
    if st.bound != "memory" or achieved < BW_BOUND_FRACTION:
        return None
    hw = dep.hardware
    ev = [f"decode steps take {_ms(m.itl_mean_s)} at a batch of {batch} ({m.generation_tok_s:.0f} tok/s); the "
          f"roofline on {hw.name} is {_ms(st.total_s)}, memory-bound: {st.bytes / 1e9:.2f} GB per step at "
          f"{hw.bandwidth / 1e9:.0f} GB/s × {dep.eff.bandwidth:.2f}.",
          f"that is {achieved:.0%} of the bandwidth ceiling: little is left but moving fewer bytes."]
    advice = [f"--quantization int8 or int4: the weights ({dep.weight_dtype.name} now) are most of the bytes"]
    cap = m.config.get("max_num_seqs")
    if cap is None or batch < cap:
        advice.append(f"a bigger batch costs almost nothing per step while memory-bound: more concurrent "
                      f"requests, and --max-num-seqs above {batch}")
    advice.append("--kv-cache-dtype int8 where long contexts make KV reads a large share")
    return Finding("decode_bandwidth", "Decode is memory-bandwidth-bound", ev, advice,
                   {"batch": batch, "context": context, "step_s": m.itl_mean_s, "roofline_step_s": st.total_s,
                    "fraction_of_roofline": achieved})


def decode_efficiency(m: Measured, dep=None, kernels: list | None = None) -> Finding | None:
    """Memory-bound decode steps several times their roofline: the step, not the load, is the bottleneck.
    `kernels`: (shape, linears, kernel, seconds) per linear shape at this batch (kernels/select.py's step_time, from the
    server's kernel table), slowest first, when the doctor could read them. At a small batch without
    them, or with the kernels a minor share, the time is the host's (host_overhead) instead."""
    got = _decode_ceiling(m, dep)
    if got is None:
        return None
    batch, context, st = got
    ratio = m.itl_mean_s / st.total_s
    if st.bound != "memory" or ratio < OFF_ROOFLINE_RATIO:
        return None
    kernel_s = sum(k[3] for k in kernels or ())
    if batch <= OVERHEAD_MAX_BATCH and kernel_s < KERNEL_SHARE * m.itl_mean_s:
        return None
    hw = dep.hardware
    ev = [f"decode steps take {_ms(m.itl_mean_s)} at a batch of {batch}; reading the step's {st.bytes / 1e9:.2f} GB "
          f"once at {hw.bandwidth * dep.eff.bandwidth / 1e9:.1f} GB/s on {hw.name} takes {_ms(st.total_s)}: the "
          f"steps run at {1 / ratio:.0%} of their roofline ({ratio:.1f}x off it)."]
    if kernels:
        top = ", ".join(f"{key} x{n} on {kernel} ({_ms(s)}, {s / m.itl_mean_s:.0%})" for key, n, kernel, s in kernels[:3])
        ev.append(f"the linear kernels take about {_ms(kernel_s)} of the step by the kernel table's measurements at "
                  f"{batch} rows ({kernel_s / m.itl_mean_s:.0%}); the most: {top}.")
    advice = []
    if kernels:
        key, _, kernel, _ = kernels[0]
        advice.append(f"{key} runs {kernel}: another weight type whose kernels stream faster on this CPU "
                      "(`python benchmarks/kernel_bandwidth.py` measures each GGUF type's GB/s; Q4_0 and Q8_0 run "
                      "the integer kernels directly), or force another kernel with --linear-kernel NAME")
    advice.append("--int8-activations lets the table take llama.cpp's int8-activation dot products (qdot) where "
                  "they measure faster (lossy: `tokenfab quant eval` reports the KL)")
    advice.append("fewer threads (--num-threads) when other processes share the cores: a thread that waits for "
                  "a descheduled one costs every step")
    return Finding("decode_efficiency", "Decode steps run far below their bandwidth roofline", ev, advice,
                   {"batch": batch, "step_s": m.itl_mean_s, "roofline_step_s": st.total_s,
                    "fraction_of_roofline": 1 / ratio, "kernel_s": kernel_s,
                    "kernels": [list(k) for k in kernels or ()]})


def host_overhead(m: Measured, dep=None) -> Finding | None:
    got = _decode_ceiling(m, dep)
    if got is None:
        return None
    batch, context, st = got
    ratio = m.itl_mean_s / st.total_s
    if batch > OVERHEAD_MAX_BATCH or ratio < OVERHEAD_RATIO:
        return None
    ev = [f"at a batch of {batch}, decode steps take {_ms(m.itl_mean_s)}, {ratio:.1f}x the roofline's "
          f"{_ms(st.total_s)} on {dep.hardware.name}: the time goes to the host (Python, scheduling, kernel "
          "launches), not to moving weights."]
    advice = ["on a shared machine, other processes' load looks the same: check the load average first",
              "measure the fixed per-step cost with `tokenfab plan calibrate` and plan with it",
              "check --num-threads against the cores you have; more concurrent requests amortise the fixed cost "
              "over more tokens"]
    return Finding("host_overhead", "Host overhead dominates small-batch steps", ev, advice,
                   {"batch": batch, "step_s": m.itl_mean_s, "roofline_step_s": st.total_s, "ratio": ratio})


def diagnose(window: Window | None, bench: dict | None = None, dep=None,
             kernels: list | None = None) -> tuple[list[Finding], Measured | None]:
    """Findings in ORDER, and the measured summary they came from. `kernels`: decode_efficiency's.

    KV pressure makes requests wait too; when it is the cause, the queue is its evidence, not a
    second finding. A step the kernels explain is not also blamed on the host."""
    findings: list[Finding] = []
    m = Measured.from_window(window) if window is not None else None
    if m is not None:
        kv = kv_capacity(m)
        slow = decode_efficiency(m, dep, kernels)
        findings += [f for f in (kv, None if kv else queueing(m), prefill_compute(m, dep),
                                 decode_bandwidth(m, dep), slow, None if slow else host_overhead(m, dep)) if f]
    tail = long_tail(bench)
    if tail:
        findings.append(tail)
    findings.sort(key=lambda f: ORDER.index(f.kind))
    return findings, m
