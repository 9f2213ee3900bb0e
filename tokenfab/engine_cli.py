"""`tokenfab generate`, `tokenfab chat` and `tokenfab info`: the engine from the terminal."""
from __future__ import annotations

import argparse
import sys
import time

from tokenfab.engine_args import add_engine_args, engine_config_from_args


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args):
    from tokenfab.sampling import SamplingParams
    if args.max_tokens < 1:   # SamplingParams takes 0 (score the prompt only); nothing to show here
        raise ValueError(f"--max-tokens (max_tokens) must be at least 1, got {args.max_tokens}")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def add_parser(subs) -> None:
    g = subs.add_parser("generate", help="generate text for a prompt, streamed to the terminal")
    g.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_engine_args(g, positional_model=False, exclude=("seed",))
    _add_sampling_args(g, 128)
    g.set_defaults(func=cmd_generate)

    c = subs.add_parser("chat", help="interactive chat with streaming output (empty line or Ctrl-D ends)")
    c.add_argument("--system", default=None, help="a system message")
    add_engine_args(c, positional_model=False, exclude=("seed",))
    _add_sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)

    i = subs.add_parser("info", help="architecture, parameter count, dtypes and KV bytes per token of a model")
    i.add_argument("model", nargs="?", default=None, help="a .gguf file or HF folder (default: the bundled model)")
    i.add_argument("--json", action="store_true")
    i.add_argument("--engine", action="store_true",
                   help="also load the engine: the kernels chosen for this CPU (the measured table), the attention "
                        "backend, and where the memory goes (weights, float copies, KV pool)")
    i.add_argument("--max-num-seqs", type=int, default=None, help="with --engine (default: the engine's)")
    i.add_argument("--max-model-len", type=int, default=None, help="with --engine (default: the model's)")
    i.set_defaults(func=cmd_info)


def _stream(engine, prompt, params, out=sys.stdout) -> tuple[str, int, float]:
    """Run one request, printing text as it comes. Returns (text, output tokens, seconds)."""
    rid = f"cli-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    shown, text, ntok = 0, "", 0
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                text = o.outputs[0].text
                ntok = len(o.outputs[0].token_ids)
                out.write(text[shown:])
                out.flush()
                shown = len(text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        raise
    return text, ntok, time.perf_counter() - t0


def _engine(args):
    from tokenfab.engine.engine import LLMEngine
    return LLMEngine(engine_config_from_args(args))


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # Checked before the model loads (which takes seconds), not by the engine after it.
    if not prompt or (args.chat and not prompt.strip()):
        from tokenfab.cli_errors import CLIError
        what = "standard input was empty" if args.prompt == "-" else "the prompt is empty"
        raise CLIError(f"{what}; give the text to {'answer' if args.chat else 'continue'}, e.g. "
                       "tokenfab generate " + ('--chat "Why is the sky blue?"' if args.chat else '"Once upon a time"'))
    params = _sampling_params(args)
    engine = _engine(args)
    if args.chat:
        from tokenfab.llm import chat_token_ids
        prompt = chat_token_ids(engine.tokenizer, [{"role": "user", "content": prompt}])
    _, ntok, secs = _stream(engine, prompt, params)
    print(f"\n[{ntok} tokens in {secs:.2f} s, {ntok / max(secs, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from tokenfab.llm import chat_token_ids
    params = _sampling_params(args)
    engine = _engine(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("tokenfab chat: type a message; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        try:
            ids = chat_token_ids(engine.tokenizer, history)
            reply, _, _ = _stream(engine, ids, params)
        except ValueError as e:          # e.g. the conversation outgrew max_model_len
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": reply})


def _engine_info(files, args) -> dict:
    """What an engine with these options chose on this CPU, and what it holds."""
    from tokenfab.config import EngineConfig
    from tokenfab.engine.engine import LLMEngine
    kw = {k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len)) if v}
    # The engine reads the file itself, as `serve` does, so that the RSS it reports after load is
    # what a server holds, not that plus this command's float copy of every weight.
    files.weights.clear()
    files.gguf_raw.clear()
    engine = LLMEngine(EngineConfig(model=args.model, **kw))
    r, m = engine.kernel_report, engine.memory
    return {
        "attention_backend": engine.model.attention_backend.describe(),
        "c_kernels_isa": kernels_isa(),
        "linear_kernels": {f"{k} (x{r.layers[k]})": v for k, v in r.plans.items()},
        "kernel_table": r.table_path or "none (built-in rules)",
        "memory_mib": {"weights": round(m["weights"] / 2**20, 1), "float copies": round(m["float_copies"] / 2**20, 1),
                       "KV pool (reserved)": round(m["kv_pool"] / 2**20, 1), "total": round(m["total"] / 2**20, 1),
                       **({"process RSS after load": round(m["rss_after_load"] / 2**20, 1),
                           "process RSS peak during load": round(m["rss_peak_load"] / 2**20, 1)}
                          if m.get("rss_after_load") else {})},
        "float_copies": engine.float_budget_from,
        "kv_pool": f"{engine.block_manager.num_blocks * engine.config.block_size} tokens, sized from "
                   f"{engine.kv_sized_from}; pages become resident as blocks are used"
                   + (f"; the sliding-window layers hold {sliding.num_blocks - 1} blocks of their own "
                      f"({(sliding.num_blocks - 1) * engine.config.block_size} tokens)"
                      if (sliding := engine.block_manager.sliding) else ""),
        "threads": torch_threads(),
    }


def kernels_isa() -> str:
    from tokenfab import kernels
    return kernels.describe()


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def cmd_info(args) -> int:
    import json

    from tokenfab.model.attention import kv_int8_bytes_per_token
    from tokenfab.model.loader import load_model_files
    files = load_model_files(args.model)
    cfg = files.config
    fp32 = cfg.kv_bytes_per_token(4)
    kv_bytes = {"float32": fp32, "bfloat16": cfg.kv_bytes_per_token(2), "int8": kv_int8_bytes_per_token(cfg)}
    from tokenfab.files.bundled import model_display_name
    name = model_display_name(files.path)
    info = {
        "path": files.path, "name": name, "gguf_general_name": cfg.name or None, "architecture": cfg.arch, "parameters": cfg.num_params(),
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling and {k: v for k, v in cfg.rope_scaling.items() if k != "factors"},
        "tied_embeddings": cfg.tie_word_embeddings, "file_tensor_types": files.file_dtypes,
        "kv_bytes_per_token": kv_bytes,
        # what a --kv-cache-memory-bytes of 1 GiB holds (the engine sizes its block pool the same way)
        "kv_tokens_per_gib": {d: (1 << 30) // b for d, b in kv_bytes.items()},
    }
    if cfg.num_experts:         # mixture of experts (model/moe.py): what one token reads of the whole
        info["experts"] = {"experts": cfg.num_experts, "per_token": cfg.experts_per_token,
                           "expert_intermediate_size": cfg.moe_intermediate_size,
                           "moe_layers": sum(map(cfg.is_moe, range(cfg.num_layers))),
                           "active_parameters": cfg.num_active_params()}
    if cfg.sliding_window:      # Gemma 3: what the sliding layers' own pool saves (engine/sliding_kv.py)
        from tokenfab.config import EngineConfig
        from tokenfab.worker.kv_sizing import sliding_savings
        info["sliding_window"] = {
            "window": cfg.sliding_window, "sliding_layers": sum(map(cfg.is_sliding, range(cfg.num_layers))),
            "layers": cfg.num_layers, "local_rope_theta": cfg.rope_local_theta,
            **sliding_savings(cfg, EngineConfig(model=args.model), fp32)}
    if args.engine:
        info.update(_engine_info(files, args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{name} ({files.path})", show_header=False)
    for k, v in info.items():
        if k == "path" or v is None:
            continue
        if k == "parameters":
            v = f"{v:,} ({v / 1e6:.1f} M)"
        elif k == "kv_bytes_per_token":
            v = ", ".join(f"{d}: {b:,} B" for d, b in v.items())
        elif k == "kv_tokens_per_gib":
            v = ", ".join(f"{d}: {n:,}" for d, n in v.items())
        elif k == "experts":
            v = (f"{v['per_token']} of {v['experts']} per token, {v['expert_intermediate_size']} wide, on "
                 f"{v['moe_layers']} layers; {v['active_parameters']:,} parameters active per token")
        elif k in ("memory_mib", "linear_kernels"):
            v = ", ".join(f"{d}: {n}" for d, n in v.items())
        elif k == "file_tensor_types":
            v = ", ".join(f"{d} x{n}" for d, n in v.items())
        t.add_row(k.replace("_", " "), str(v))
    Console().print(t)
    return 0

