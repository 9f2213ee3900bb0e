"""`tokenfab quant MODEL --scheme ... --out DIR`: quantize a model file into a checkpoint folder.

The folder is an HF-style model folder that `LLM(model=DIR)` loads like any other:
    config.json          HF-style, read back by ModelConfig.from_hf (model_type = the architecture)
    model.safetensors    every tensor, quantized linears in the portable layout (see checkpoint.py)
    quant_config.json    scheme and per-layer types; its presence makes build_model apply the layers
    tokenizer files      from tokenizer.save_pretrained (chat template included)

The starting point is always the float model (GGUF blocks dequantized, quantization="none"), so the
scheme quantizes the same weights `tokenfab quant eval` compares against.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenfab.quant.schemes import parse_scheme

DEFAULT_CALIB_TOKENS = 1024     # AWQ only; two windows of 512 (measured: enough for a stable alpha per layer)
# mixed precision: every linear's sensitivity is two forward passes over these tokens (240 on the bundled model)
DEFAULT_MIXED_CALIB_TOKENS = 256
CALIB_CTX = 512


def hf_config_dict(cfg) -> dict:
    """An HF `config.json` dict for a ModelConfig; `ModelConfig.from_hf` reads it back unchanged."""
    eos = list(cfg.eos_token_ids)
    return {
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "_name_or_path": cfg.name,
        "torch_dtype": "float32",
        **(cfg.granite or {}),          # Granite: its multipliers and eps as stated (model/families/granite.py)
        **({"no_rope_layers": [int(not n) for n in cfg.nope_layers]} if any(cfg.nope_layers) else {}),   # SmolLM3
        **_moe_config(cfg),
    }


def _moe_config(cfg) -> dict:
    """A mixture-of-experts model's keys (model/families/qwen3_moe.py, mixtral.py, olmoe.py), under its HF
    `model_type`: a Llama GGUF file with experts is Mixtral."""
    if not cfg.num_experts:
        return {}
    from tokenfab.model import families
    model_type = "mixtral" if cfg.arch in ("llama", "mixtral") else families.for_gguf(cfg.arch).hf_model_types[0]
    if model_type != "qwen3_moe" and cfg.moe_intermediate_size != cfg.intermediate_size:
        raise ValueError(f"{model_type} configs have no moe_intermediate_size; this model's experts are "
                         f"{cfg.moe_intermediate_size} wide and its dense MLP {cfg.intermediate_size}")
    return {"model_type": model_type, "num_experts": cfg.num_experts, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe(i)]}


def build_float_model(files, max_positions: int, quantization: str = "none"):
    """The engine's decoder for already-read model files, float32 on the CPU, for offline tools."""
    from tokenfab.quant.load import build_model
    return build_model(files, torch.float32, "cpu", 16, max_positions, quantization)


def forward_windows(windows: Sequence[Sequence[int]]) -> Callable[[torch.nn.Module], None]:
    """A calibration callable for `quantize_model`: runs the model over each token window."""
    from tokenfab.model.llama import full_logits

    def run(model) -> None:
        for w in windows:
            full_logits(model, list(w))
    return run


def calibration_windows(tokenizer, path: str | None, tokens: int, ctx: int = CALIB_CTX) -> list[list[int]]:
    """Windows of `path`'s text, or of the bundled text's calibration slice (disjoint from evaluation)."""
    from tokenfab.quant.text import split_eval_calib, text_token_ids, token_windows
    ids = text_token_ids(tokenizer, path)
    if path is None:
        ids = split_eval_calib(ids)[1]
    ctx = min(ctx, len(ids), tokens)
    return token_windows(ids, ctx, max(1, tokens // ctx))


def _check_out_dir(out: str) -> None:
    from tokenfab.quant.checkpoint import is_quantized_checkpoint
    if os.path.isfile(out):
        raise ValueError(f"--out {out} is a file; give a folder to write the checkpoint into")
    if os.path.isdir(out) and os.listdir(out) and not is_quantized_checkpoint(out):
        # the loader reads every *.safetensors in the folder: never mix ours with someone else's files
        raise ValueError(f"--out {out} is not empty and not a tokenfab checkpoint; give a new or empty folder")


@dataclass
class ExportResult:
    out: str
    scheme: str
    quantized: int            # linears replaced
    kept_float: list[str]
    float_bytes: int          # of the quantized linears' weights, before
    quant_bytes: int          # and after
    calib_tokens: int
    seconds: float
    mixed: dict | None = None     # with max_kl: the plan (quant/mixed.py), measured KL and formats included


def quantize_to_folder(model: str | None, scheme: str, out: str, *, calib_path: str | None = None,
                       calib_tokens: int = DEFAULT_CALIB_TOKENS, keep_float: Sequence[str] | None = None,
                       progress: Callable[[str], None] | None = None, files=None,
                       max_kl: float | None = None) -> ExportResult:
    """Load `model` (None: the bundled one) as float, quantize with `scheme`, write the folder.

    `max_kl`: automatic mixed precision (quant/mixed.py): each decoder linear takes `scheme`, int8 or
    float, the fewest bytes whose measured KL on the calibration windows is at most `max_kl`.
    `files`: `model`'s files already read by `load_model_files` (tests reuse one read)."""
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.apply import quantize_model
    from tokenfab.quant.checkpoint import is_quantized_checkpoint, save_quantized

    spec = parse_scheme(scheme)
    _check_out_dir(out)
    t0 = time.perf_counter()
    files = files or load_model_files(model)
    if files.config.rotary_dim:
        raise ValueError(f"{files.path}: tokenfab quant does not write {files.config.arch} checkpoints yet (its q / k "
                         "rows are held in the decoder's partial-rotary order); quantize it at load instead "
                         "(--quantization)")
    if is_quantized_checkpoint(files.path):
        raise ValueError(f"{files.path} is already a quantized checkpoint; quantize its float source instead")
    windows: list[list[int]] = []
    if spec.awq or max_kl is not None:
        windows = calibration_windows(files.tokenizer, calib_path, calib_tokens)
    fmodel = build_float_model(files, max(CALIB_CTX, max((len(w) for w in windows), default=1)) + 1)
    if max_kl is not None:
        return _mixed_to_folder(files, fmodel, spec.name, out, windows, max_kl, progress, t0)
    if progress:
        progress(f"quantizing to {spec.name}" + (f", calibrating on {sum(map(len, windows))} tokens" if windows else ""))
    summary = quantize_model(fmodel, spec.name, keep_float, forward_windows(windows) if spec.awq else None,
                             progress=progress)
    save_quantized(fmodel, out, scheme=spec.name, model_config=hf_config_dict(files.config),
                   extra={"source": files.path, "calib_tokens": sum(map(len, windows))})
    files.tokenizer.save_pretrained(out)
    return ExportResult(out, spec.name, len(summary.quantized), summary.kept_float, summary.float_bytes,
                        summary.quant_bytes, sum(map(len, windows)), time.perf_counter() - t0)


def _mixed_to_folder(files, fmodel, low: str, out: str, windows: list[list[int]], max_kl: float,
                     progress: Callable[[str], None] | None, t0: float) -> ExportResult:
    from tokenfab.quant.checkpoint import save_quantized
    from tokenfab.quant.mixed import FLOAT, apply_formats, plan_mixed_precision

    plan = plan_mixed_precision(fmodel, windows, max_kl, low, progress)
    quantized = [n for n, f in plan.formats.items() if f != FLOAT]
    if not quantized:
        raise ValueError(f"a KL budget of {max_kl} kept every linear float; raise --max-kl to quantize")
    apply_formats(fmodel, plan.formats)
    tokens = sum(map(len, windows))
    save_quantized(fmodel, out, scheme="mixed", model_config=hf_config_dict(files.config),
                   extra={"source": files.path, "calib_tokens": tokens, "mixed": plan.as_dict()})
    files.tokenizer.save_pretrained(out)
    kept = [n for n, f in plan.formats.items() if f == FLOAT]
    return ExportResult(out, "mixed", len(quantized), kept, plan.bytes_by_format[FLOAT], plan.bytes, tokens,
                        time.perf_counter() - t0, plan.as_dict())
