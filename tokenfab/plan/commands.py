"""What each `tokenfab plan` command computes, as plain dicts (the `--json` output).

`cli.py` parses flags and calls these; `render.py` turns their results into tables. Keeping the
arithmetic here, free of printing, lets tests call a command and check its numbers.
"""
from __future__ import annotations

import math
from dataclasses import replace

from tokenfab.plan import roofline
from tokenfab.plan.cost import CostAssumptions, hourly_cost, usd_per_million_tokens
from tokenfab.plan.hardware import Hardware, get_hardware, load_catalog
from tokenfab.plan.memory import MemorySettings, kv_blocks, plan_memory, smallest_fitting_tp, tp_options
from tokenfab.plan.models import PRESETS, ModelSpec, resolve_model
from tokenfab.plan.roofline import Deployment, Efficiency, RooflineCost
from tokenfab.plan.simulate import SchedulerConfig

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def model_summary(m: ModelSpec, dep: Deployment | None = None) -> dict:
    d = {"name": m.name, "source": m.source, "params": m.total_params, "active_params": m.active_params,
         "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
         "intermediate": m.intermediate, "vocab": m.vocab, "context_length": m.context_length,
         "experts": m.num_experts, "experts_per_token": m.experts_per_token, "sliding_window": m.sliding_window,
         "flops_per_token": m.flops_per_token()}
    if dep is not None:
        d.update(weight_dtype=dep.weight_dtype.name, kv_dtype=dep.kv_dtype.name, act_dtype=dep.act_dtype.name,
                 weight_bytes=m.weight_bytes(dep.weight_dtype), kv_bytes_per_token=m.kv_bytes_per_token(dep.kv_dtype))
    return d


def deployment(args, hw: Hardware, tp: int = 1) -> Deployment:
    model = resolve_model(args.model)
    eff = Efficiency.resolve(hw, args.bw_eff, args.compute_eff, args.overhead_ms)
    return Deployment.make(model, hw, args.weight_dtype, args.kv_dtype, args.act_dtype, tp=tp, eff=eff)


def catalog(args) -> dict[str, Hardware]:
    return load_catalog(args.hardware_file or ())


def hardware_list(names: str, cat: dict[str, Hardware]) -> list[Hardware]:
    out = [get_hardware(n, cat) for n in names.split(",") if n.strip()]
    if not out:
        raise ValueError("give at least one hardware name, e.g. --hardware rtx-3090,h100-sxm")
    return out


def _eff_dict(e: Efficiency) -> dict:
    return {"bandwidth": e.bandwidth, "compute": e.compute, "step_overhead_ms": e.step_overhead_s * 1e3,
            "source": e.source}


def _step_dict(st: roofline.StepTime) -> dict:
    return {"flops": st.flops, "bytes": st.bytes, "intensity": st.intensity, "bound": st.bound,
            "compute_s": st.compute_s, "memory_s": st.memory_s, "comm_s": st.comm_s, "step_s": st.total_s}


def memory_settings(args, context: int) -> MemorySettings:
    return MemorySettings(context=context, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          memory_utilization=args.memory_utilization,
                          runtime_overhead_gib=args.runtime_overhead_gib, block_size=args.block_size)


def cost_assumptions(args) -> CostAssumptions:
    return CostAssumptions(years=args.years, utilization=args.utilization, usd_per_kwh=args.usd_per_kwh,
                           pue=args.pue, extra_usd_per_hour=args.extra_usd_per_hour, pricing=args.pricing)


def run_roofline(args) -> dict:
    hw = get_hardware(args.hardware, catalog(args))
    dep = deployment(args, hw, args.tp or 1)
    m = dep.model
    whole, ttft = roofline.prefill(dep, args.prompt_len, args.max_num_batched_tokens)
    batches = sorted(set(DEFAULT_BATCHES) | set(args.batch or []))
    decode = []
    for b in batches:
        st = roofline.decode(dep, b, args.context)
        decode.append({"batch": b, "context": args.context, **_step_dict(st), "tok_s": b / st.total_s})
    return {
        "command": "roofline", "label": "ceilings: spec-sheet peaks × efficiencies, no queueing",
        "model": model_summary(m, dep), "hardware": hw.name, "tp": dep.tp, "efficiency": _eff_dict(dep.eff),
        "peak_flops": dep.peak_flops, "bandwidth": hw.bandwidth, "ridge_intensity": dep.ridge_intensity,
        "weights_read_per_decode_step": m.weight_bytes_read(dep.weight_dtype, 1) / dep.tp,
        "prefill": {"prompt_len": args.prompt_len, **_step_dict(whole), "ttft_s": ttft,
                    "chunk": args.max_num_batched_tokens},
        "decode": decode,
        "crossover_batch": {str(c): roofline.crossover_batch(dep, c) for c in sorted({0, args.context})},
    }


def run_memory(args) -> dict:
    hw = get_hardware(args.hardware, catalog(args))
    dep = deployment(args, hw, args.tp or 1)
    s = memory_settings(args, args.context)
    plan = plan_memory(dep, s)
    degrees = tuple(t for t in (1, 2, 4, 8, 16) if t <= args.max_tp)
    warn = []
    if dep.model.context_length and args.context > dep.model.context_length:
        warn.append(f"context {args.context} exceeds the model's {dep.model.context_length}")
    return {"command": "memory", "model": model_summary(dep.model, dep), "hardware": hw.name,
            "settings": {k: getattr(s, k) for k in s.__dataclass_fields__}, "plan": plan.as_dict(),
            "kv_blocks": kv_blocks(plan, s.block_size), "warnings": warn,
            "tp_options": [o.as_dict() for o in tp_options(dep, s, degrees)]}


def parse_workload(spec: str) -> dict:
    """'prompt=512,output=256[,batch=64]' → {'prompt': 512, 'output': 256, 'batch': 64 | None}."""
    out = {"prompt": 512, "output": 256, "batch": None}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, val = part.partition("=")
        if key not in out or not val.isdigit() or int(val) < 1:
            raise ValueError(f"bad workload item {part!r}; use prompt=N,output=N[,batch=N] with positive integers")
        out[key] = int(val)
    return out


def spec_settings(args) -> dict:
    """Speculative decoding for the simulator, from `--spec-acceptance` / `--spec-tokens` (capacity)."""
    acceptance = getattr(args, "spec_acceptance", None)
    if acceptance is None:
        return {}
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--spec-acceptance must be in [0, 1] (accepted / drafted tokens), got {acceptance}")
    return {"spec_tokens": args.spec_tokens, "spec_acceptance": acceptance,
            "spec_max_batch_size": args.spec_max_batch_size}


def _scheduler_for(dep: Deployment, args, context: int, policy: str = "fcfs") -> tuple[SchedulerConfig, dict]:
    plan = plan_memory(dep, memory_settings(args, context))
    if not plan.fits:
        raise ValueError(f"{dep.model.name} does not fit on {dep.tp}× {dep.hardware.name}: {plan.reason}")
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            block_size=args.block_size, num_kv_blocks=kv_blocks(plan, args.block_size),
                            policy=policy, **spec_settings(args))
    return sched, plan.as_dict()


def run_compare(args) -> dict:
    from tokenfab.plan.capacity import Traffic, saturation_rate
    from tokenfab.plan.workload import parse_length

    cat = catalog(args)
    w = parse_workload(args.workload)
    a = cost_assumptions(args)
    context = w["prompt"] + w["output"]
    rows = []
    for hw in hardware_list(args.hardware, cat):
        dep = deployment(args, hw)
        tp = args.tp or smallest_fitting_tp(dep, memory_settings(args, context), args.max_tp)
        row = {"hardware": hw.name, "tp": tp, "fits": tp is not None}
        if tp is None:
            row["reason"] = plan_memory(dep, memory_settings(args, context)).reason
            rows.append(row)
            continue
        dep = replace(dep, tp=tp)
        sched, plan = _scheduler_for(dep, args, context)
        if w["batch"]:
            sched = replace(sched, max_num_seqs=w["batch"])
        traffic = Traffic(rate=1.0, prompt=parse_length(w["prompt"]), output=parse_length(w["output"]),
                          num_requests=max(100, 3 * sched.max_num_seqs))
        sat = saturation_rate(RooflineCost(dep), sched, traffic)
        tok_s = sat * w["output"]
        _, ttft = roofline.prefill(dep, w["prompt"], args.max_num_batched_tokens)
        row.update(ttft_s=ttft, single_stream_tok_s=1 / roofline.decode(dep, 1, context).total_s,
                   requests_per_s=sat, tok_s=tok_s, total_tok_s=sat * context,
                   max_concurrent=min(plan["max_seqs"], sched.max_num_seqs),
                   power_w=hw.tdp_w * tp if hw.tdp_w else None,
                   tok_s_per_w=tok_s / (hw.tdp_w * tp) if hw.tdp_w else None)
        try:
            hc = hourly_cost(hw, a, devices=tp)
            row.update(usd_per_hour=hc.total, pricing=hc.pricing,
                       usd_per_m_output=usd_per_million_tokens(hc.total, tok_s, a.utilization),
                       usd_per_m_total=usd_per_million_tokens(hc.total, sat * context, a.utilization))
        except ValueError as e:
            row["cost_unavailable"] = str(e)
        rows.append(row)
    first = deployment(args, hardware_list(args.hardware, cat)[0])
    return {"command": "compare", "model": model_summary(first.model, first), "workload": w,
            "assumptions": {**a.as_dict(), "bw_eff": args.bw_eff, "compute_eff": args.compute_eff,
                            "throughput": "saturated replica in the simulator (the engine's scheduler)"},
            "rows": rows}


def run_capacity(args) -> dict:
    from tokenfab.plan.capacity import Traffic, plan_capacity
    from tokenfab.costmodel.measured import MeasuredStepCost, NoisyStepCost
    from tokenfab.plan.workload import SLO, parse_length

    hw = get_hardware(args.hardware, catalog(args))
    dep = deployment(args, hw)
    prompt, output = parse_length(args.prompt_len), parse_length(args.output_len)
    slo = SLO.parse(args.slo)
    # KV pool sized for a long request of this mix (the pool itself does not depend on it).
    context = math.ceil(prompt.mean + output.mean)
    tp = args.tp or smallest_fitting_tp(dep, memory_settings(args, context), args.max_tp)
    if tp is None:
        raise ValueError(f"{dep.model.name} does not fit on up to {args.max_tp}× {hw.name}: "
                         + plan_memory(dep, memory_settings(args, context)).reason)
    dep = replace(dep, tp=tp)
    sched, plan = _scheduler_for(dep, args, context, policy="priority" if args.offline_share > 0 else "fcfs")
    if args.step_table:
        m = dep.model
        cost = MeasuredStepCost.from_file(args.step_table, m.sliding_window, m.global_layer_fraction)
        cost_model = {"kind": "measured step table", "file": args.step_table, **cost.as_dict()}
        if cost.noise and not args.no_step_noise:
            cost = NoisyStepCost(cost, args.seed)
        else:
            cost_model.pop("noise", None)
    else:
        cost = RooflineCost(dep)
        cost_model = {"kind": "roofline", **_eff_dict(dep.eff)}
    traffic = Traffic(rate=args.rate, prompt=prompt, output=output, offline_share=args.offline_share,
                      num_requests=args.num_requests, seed=args.seed, burstiness=args.burstiness)
    res = plan_capacity(cost, sched, traffic, slo, args.max_replicas)
    a = cost_assumptions(args)
    out = {"command": "capacity", "model": model_summary(dep.model, dep), "hardware": hw.name, "tp": tp,
           "traffic": {"rate": args.rate, "prompt_len": str(prompt), "output_len": str(output),
                       "offline_share": args.offline_share, "burstiness": args.burstiness,
                       "simulated_requests": args.num_requests, "routing": "random (Poisson split)"},
           "slo": str(slo), "scheduler": {k: getattr(sched, k) for k in sched.__dataclass_fields__},
           "cost_model": cost_model, "saturation_rate_per_replica": res.saturation_rate,
           "replicas": res.replicas, "devices": res.replicas * tp if res.replicas else None,
           "unloaded": res.unloaded.online, "evaluations": [e.as_dict() for e in res.evaluations]}
    if getattr(args, "plot", None) and res.replicas:
        # A latency curve for the chart: replica counts from the first that keeps up to twice the answer.
        from tokenfab.plan.capacity import evaluate
        first = max(1, math.floor(args.rate / res.saturation_rate) + 1)
        counts = sorted(set(range(first, 2 * res.replicas + 1, max(1, (2 * res.replicas - first) // 10))))
        out["curve"] = [evaluate(cost, sched, traffic, slo, r, res.saturation_rate).as_dict() for r in counts]
    if res.best is not None:
        best = res.best
        out.update(utilization=best.utilization, online=best.online, offline=best.offline)
        try:
            hc = hourly_cost(hw, a, devices=tp * res.replicas)
            fleet_out = args.rate * output.mean
            fleet_total = args.rate * (output.mean + prompt.mean)
            out["cost"] = {**hc.as_dict(), "assumptions": a.as_dict(),
                           "usd_per_m_output": usd_per_million_tokens(hc.total, fleet_out),
                           "usd_per_m_total": usd_per_million_tokens(hc.total, fleet_total),
                           "note": "traffic assumed steady at this rate around the clock"}
        except ValueError as e:
            out["cost"] = {"unavailable": str(e)}
        if args.offline_share > 0:
            out["separate_pools"] = _separate_pools(cost, sched, traffic, slo, args.max_replicas, res.replicas)
    if getattr(args, "emit", None):
        from tokenfab.plan import serve_config
        out["emitted"] = serve_config.write(args.emit[0], args.emit[1], out)
    return out


def _separate_pools(cost, sched, traffic, slo, max_replicas: int, combined: int) -> dict:
    """Replicas if online and offline traffic each had their own pool: the sum of two peaks."""
    from tokenfab.plan.capacity import plan_capacity, saturation_rate
    online = plan_capacity(cost, replace(sched, policy="fcfs"),
                           replace(traffic, rate=traffic.rate * (1 - traffic.offline_share), offline_share=0.0),
                           slo, max_replicas).replicas
    off_traffic = replace(traffic, rate=traffic.rate * traffic.offline_share, offline_share=0.0)
    offline = math.floor(off_traffic.rate / saturation_rate(cost, replace(sched, policy="fcfs"), off_traffic)) + 1
    total = online + offline if online else None
    return {"online_replicas": online, "offline_replicas": offline, "total": total, "combined": combined,
            "saved": total - combined if total else None}


def run_models(args) -> dict:
    return {"command": "models", "presets": [model_summary(m) for m in PRESETS.values()]}


def run_hardware(args) -> dict:
    return {"command": "hardware", "entries": [{"name": k, **hw.to_entry(), "origin": hw.origin}
                                               for k, hw in catalog(args).items()]}


def run_probe(args, progress=None) -> dict:
    from tokenfab.plan.hardware import save_entry, user_hardware_file
    from tokenfab.plan.probe import ProbeSettings, probe

    s = ProbeSettings(device=args.device, buffer_mib=args.buffer_mib, seconds_per_test=args.seconds)
    entry = probe(s, progress)
    name = args.name or f"local-{args.device}"
    written = None
    if not args.dry_run:
        written = str(save_entry(args.output or user_hardware_file(), name, entry))
    return {"command": "probe", "name": name, "entry": entry, "written": written}


def _engine_quantization(weight_dtype: str | None) -> str:
    """The engine's weight path for the weight dtype being calibrated (default: float, as described)."""
    if weight_dtype in ("q4_0", "q4_1", "q8_0", "q5_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"):
        return "gguf"
    if weight_dtype == "int8" or (weight_dtype or "").startswith("int4"):
        return weight_dtype.removesuffix("-asym")
    return "none"


def run_calibrate(args, progress=None) -> dict:
    """Time the engine, fit efficiencies, write them into the hardware entry, and check the fitted
    model on a held-out mixed batch."""
    import datetime

    from tokenfab.plan.calibrate import fit_efficiency, measure_engine, measure_mixed
    from tokenfab.plan.hardware import save_entry, user_hardware_file
    from tokenfab.plan.simulate import simulate
    from tokenfab.plan.workload import Request

    try:
        from tokenfab.llm import LLM
    except ImportError as e:
        raise ValueError(f"calibration needs the engine (tokenfab.llm), which failed to import: {e}") from None
    cat = catalog(args)
    hw_name = args.hardware or f"local-{args.device}"
    if hw_name not in cat:
        if args.hardware:
            get_hardware(hw_name, cat)      # raises with the known names
        raise ValueError(f"no {hw_name!r} entry yet: run `tokenfab plan probe --device {args.device}` first, "
                         "or name a catalog entry with --hardware")
    hw = cat[hw_name]
    engine_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.engine_dtype]
    llm = LLM(model=args.model, dtype=engine_dtype, device=args.device, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(max(args.prompt_lens), args.max_num_batched_tokens),
              enable_prefix_caching=False, quantization=_engine_quantization(args.weight_dtype))
    model = resolve_model(args.model)
    base = Deployment.make(model, replace(hw, efficiency=None, step_overhead_ms=None),
                           args.weight_dtype or args.engine_dtype, args.kv_dtype or args.engine_dtype,
                           args.act_dtype or args.engine_dtype)
    if len(args.decode_tokens) != 2 or args.decode_tokens[0] >= args.decode_tokens[1]:
        raise ValueError(f"--decode-tokens takes two increasing counts N1,N2, got {args.decode_tokens}")
    timings = measure_engine(llm, args.prompt_lens, args.batches, model.vocab, repeats=args.repeats,
                             decode_tokens=tuple(args.decode_tokens), progress=progress)
    shapes = [t.shape(model.sliding_window, model.global_layer_fraction) for t in timings]
    fit = fit_efficiency(base, shapes, [t.step_s for t in timings])
    rows = [{**t.row(), "batch": t.batch, "prompt_len": t.prompt_len, "predicted_s": p, "bound": b}
            for t, p, b in zip(timings, fit.predicted_s, fit.bound)]
    warnings = []
    if max(fit.bandwidth, fit.compute) >= 1.0:
        warnings.append("a fitted efficiency is at or above 100% of the entry's peak: the entry understates this "
                        "machine (re-run `plan probe`), or the timings are mostly per-step overhead")
    if fit.mean_abs_rel_error > 0.15:
        warnings.append(f"the fit misses the timings by {fit.mean_abs_rel_error:.0%} on average: timings this noisy "
                        "usually mean other load on the machine; re-run on a quiet machine with more --repeats")
    out = {"command": "calibrate", "hardware": hw.name, "model": model_summary(model, base),
           "engine": {"dtype": engine_dtype, "device": args.device}, "fit": fit.as_dict(), "rows": rows,
           "warnings": warnings}
    if not args.no_validate:
        # Held-out: a mixed offline batch the fit never saw, simulated with the engine's own limits.
        lens = [16 + (i * 97) % 240 for i in range(args.validate_batch)]
        measured = measure_mixed(llm, lens, args.validate_output, model.vocab)
        dep = replace(base, eff=Efficiency(fit.bandwidth, fit.compute, fit.overhead_s, "calibrated"))
        reqs = [Request(i, 0.0, p, args.validate_output) for i, p in enumerate(lens)]
        sched = SchedulerConfig(max_num_seqs=max(args.batches),
                                max_num_batched_tokens=max(max(args.prompt_lens), args.max_num_batched_tokens))
        predicted = simulate(RooflineCost(dep), reqs, sched).end_s
        out["validation"] = {"prompt_lens": lens, "output_len": args.validate_output, "measured_s": measured,
                             "predicted_s": predicted, "error": predicted / measured - 1}
    entry = {**hw.to_entry(), "efficiency": {"bandwidth": round(fit.bandwidth, 4), "compute": round(fit.compute, 4)},
             "step_overhead_ms": round(fit.overhead_s * 1e3, 4),
             "calibrated": {"date": datetime.date.today().isoformat(), "model": model.name,
                            "engine_dtype": engine_dtype, "mean_abs_rel_error": round(fit.mean_abs_rel_error, 4)}}
    name = args.name or hw.name
    if not args.dry_run:
        out["written"] = str(save_entry(args.output or user_hardware_file(), name, entry))
    if args.save_table:
        import yaml
        with open(args.save_table, "w") as f:
            yaml.safe_dump({"hardware": name, "model": model.name, "rows": rows}, f, sort_keys=False)
        out["table"] = args.save_table
    return out


def run_validate(args) -> dict:
    from tokenfab.plan.simulate import SchedulerConfig
    from tokenfab.costmodel.measured import MeasuredStepCost
    from tokenfab.plan.validate import validate

    cost = MeasuredStepCost.from_file(args.step_table)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             block_size=args.block_size, num_kv_blocks=args.num_kv_blocks)
    if args.replicates < 1:
        raise ValueError("--replicates must be at least 1")
    v = validate(args.bench, cost, config, args.run, 1 if args.no_step_noise else args.replicates, args.seed)
    cost_model = {"kind": "measured step table", "file": args.step_table, **cost.as_dict()}
    if v.replicates == 1:
        cost_model.pop("noise", None)
    return {"command": "validate", **v.as_dict(), "cost_model": cost_model,
            "scheduler": {k: getattr(config, k) for k in config.__dataclass_fields__}}
