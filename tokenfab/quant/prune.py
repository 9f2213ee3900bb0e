"""Structured pruning: remove whole decoder layers and FFN channels, chosen on calibration text.

Both criteria come from one pass of the float model over calibration windows:

- **Layers**: the angular distance between a layer's input and output hidden states,
  `arccos(cos(x_in, x_out)) / pi` per token (0: the layer leaves the residual stream's direction as
  it found it; 1: it reverses it), averaged over every calibration token. The layers with the
  smallest distance change the stream least and are removed (Gromov et al., "The Unreasonable
  Ineffectiveness of the Deeper Layers", 2024, score blocks of layers the same way). Each layer is
  scored once, on the unpruned model.
- **FFN channels**: the mean magnitude of the intermediate activation `act(gate) * up` per channel
  (the down projection's input, `awq.collect_activations`'s `abs_mean`). Each layer keeps its own
  strongest channels; every layer keeps the same number, since config.json has one
  `intermediate_size`, rounded to a multiple of 32 (the int4 group size, so the pruned down
  projection still quantizes without padding).

The result is an HF folder (config.json with the new `num_hidden_layers` / `intermediate_size`,
model.safetensors under HF's tensor names, tokenizer files, and pruning.json with the scores) that
tokenfab and transformers both load, from an HF folder or a GGUF file (read as float weights).

    res = prune_to_folder(None, "out/pruned", layers_fraction=0.2, ffn_fraction=0.1)
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

CHANNEL_MULTIPLE = 32
DEFAULT_PRUNE_CALIB_TOKENS = 1024
PRUNING_FILE = "pruning.json"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# config.json keys that hold one entry per layer (Gemma 3, Qwen: layer_types; SmolLM3: no_rope_layers)
_PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


@dataclass
class PruneScores:
    layer_distance: list[float]              # per layer: mean angular distance, input to output
    channel_importance: list[torch.Tensor]   # per layer: mean |act(gate) * up| per FFN channel
    tokens: int


def _angular_distance(x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor:
    """arccos(cos(x_in, x_out)) / pi per row, in float64 (near-identical rows give cosines near 1)."""
    cos = torch.nn.functional.cosine_similarity(x_in.double(), x_out.double(), dim=-1, eps=1e-12)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi


@torch.no_grad()
def prune_scores(model, windows: Sequence[Sequence[int]]) -> PruneScores:
    """Both criteria on `windows` of calibration tokens, from forward hooks on the float decoder."""
    from tokenfab.model.llama import full_logits
    from tokenfab.quant.awq import collect_activations

    n = len(model.layers)
    sums, counts = [0.0] * n, [0] * n

    def hook(i):
        def record(_module, args, out):
            d = _angular_distance(args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1]))
            sums[i] += d.sum().item()
            counts[i] += d.numel()
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    names = [f"layers.{i}.mlp.down_proj" for i in range(n)]
    try:
        stats = collect_activations(model, names, lambda m: [full_logits(m, list(w)) for w in windows], max_rows=1)
    finally:
        for h in handles:
            h.remove()
    if min(counts) == 0:
        raise ValueError("calibration never ran every decoder layer")
    return PruneScores([s / c for s, c in zip(sums, counts)], [stats[nm].abs_mean for nm in names], counts[0])


def layers_to_drop(distances: Sequence[float], count: int) -> list[int]:
    """The `count` layers with the smallest distance (ties: the earlier layer first), ascending."""
    if not 0 <= count < len(distances):
        raise ValueError(f"can remove 0 to {len(distances) - 1} of {len(distances)} layers, not {count}")
    order = sorted(range(len(distances)), key=lambda i: (distances[i], i))
    return sorted(order[:count])


def kept_channel_count(intermediate: int, fraction: float) -> int:
    """Channels each layer keeps when `fraction` of them go, rounded to a multiple of 32 (at least 32,
    and never more than the layer has)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the FFN fraction to remove must be in [0, 1), got {fraction}")
    keep = intermediate * (1 - fraction)
    if intermediate <= CHANNEL_MULTIPLE:
        return max(1, round(keep))
    return min(intermediate, max(CHANNEL_MULTIPLE, round(keep / CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE))


def channels_to_keep(importance: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` most important channels, in their original order."""
    return torch.sort(torch.topk(importance.float(), keep).indices).values


def prune_weights(weights: Mapping[str, torch.Tensor], num_layers: int, drop: Sequence[int],
                  keep_channels: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """HF-named float weights without the dropped layers (the rest renumbered in order) and, per kept
    layer, only its `keep_channels` rows of gate_proj / up_proj and columns of down_proj."""
    kept = [i for i in range(num_layers) if i not in set(drop)]
    new_index = {old: new for new, old in enumerate(kept)}
    out = {}
    for name in weights:
        m = _LAYER_NAME.match(name)
        if m is None:
            out[name] = weights[name].contiguous()
            continue
        old, rest = int(m.group(1)), m.group(2)
        if old not in new_index:
            continue
        t = weights[name]
        ch = None if keep_channels is None else keep_channels.get(old)
        if ch is not None and rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            t = t[ch]
        elif ch is not None and rest == "mlp.down_proj.weight":
            t = t[:, ch]
        out[f"model.layers.{new_index[old]}.{rest}"] = t.contiguous()
    return out


def pruned_config(config: dict, kept_layers: Sequence[int], intermediate: int) -> dict:
    """config.json for the pruned model: layer count, FFN width and per-layer lists follow the cut."""
    out = dict(config)
    out["num_hidden_layers"] = len(kept_layers)
    out["intermediate_size"] = intermediate
    for key in _PER_LAYER_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [out[key][i] for i in kept_layers]
    return out


def _source_config(files) -> dict:
    """The model's config.json as a dict: the folder's own (every family key kept), or for a GGUF file
    the HF config tokenfab quant writes (export.hf_config_dict)."""
    from tokenfab.quant.export import hf_config_dict
    if os.path.isdir(files.path):
        with open(os.path.join(files.path, "config.json")) as f:
            return json.load(f)
    cfg = files.config
    if cfg.sandwich_norms or cfg.granite or cfg.sliding_window or any(cfg.nope_layers):
        raise ValueError(f"{files.path}: pruning writes GGUF files of the plain Llama-style families only; "
                         "prune this model's HF folder instead")
    return hf_config_dict(cfg)


def check_prunable(files) -> None:
    """ValueError for models whose HF tensors the pruned folder could not reproduce."""
    from tokenfab.quant.checkpoint import is_quantized_checkpoint
    cfg = files.config
    if is_quantized_checkpoint(files.path):
        raise ValueError(f"{files.path} is a quantized checkpoint; prune its float source, then quantize")
    if cfg.num_experts:
        raise ValueError(f"{files.path}: pruning handles dense models; this one has {cfg.num_experts} experts per layer")
    if cfg.rotary_dim:
        raise ValueError(f"{files.path}: pruning does not write {cfg.arch} folders (its HF tensors are fused "
                         "qkv / gate_up, held split here)")


@dataclass
class PruneResult:
    out: str
    dropped_layers: list[int]
    layer_distance: list[float]
    num_layers_before: int
    num_layers_after: int
    intermediate_before: int
    intermediate_after: int
    params_before: int
    params_after: int
    calib_tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["layer_distance"] = [round(x, 6) for x in self.layer_distance]
        d["seconds"] = round(self.seconds, 1)
        return d


def layer_count(num_layers: int, drop_layers: int | None, layers_fraction: float | None) -> int:
    """Layers to remove: `drop_layers`, or `layers_fraction` of them rounded to the nearest whole layer."""
    if drop_layers is not None and layers_fraction is not None:
        raise ValueError("give the layers to remove as a count or as a fraction, not both")
    if layers_fraction is not None:
        if not 0 <= layers_fraction < 1:
            raise ValueError(f"the layer fraction must be in [0, 1), got {layers_fraction}")
        drop_layers = round(layers_fraction * num_layers)
    return drop_layers or 0


def prune_to_folder(model: str | None, out: str, *, drop_layers: int | None = None,
                    layers_fraction: float | None = None, ffn_fraction: float = 0.0, calib_path: str | None = None,
                    calib_tokens: int = DEFAULT_PRUNE_CALIB_TOKENS, files=None,
                    progress: Callable[[str], None] | None = None) -> PruneResult:
    """Score `model` (None: the bundled one) on calibration text, prune it, write the HF folder `out`.

    `files`: `model`'s files already read by `load_model_files` (tests reuse one read)."""
    from safetensors.torch import save_file

    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.export import build_float_model, calibration_windows

    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out)):
        raise ValueError(f"--out {out} exists and is not an empty folder; give a new or empty folder")
    files = files or load_model_files(model)
    check_prunable(files)
    cfg = files.config
    n_drop = layer_count(cfg.num_layers, drop_layers, layers_fraction)
    if not 0 <= n_drop < cfg.num_layers:
        raise ValueError(f"the model has {cfg.num_layers} layers; at most {cfg.num_layers - 1} can be removed, "
                         f"not {n_drop}")
    keep = kept_channel_count(cfg.intermediate_size, ffn_fraction)
    if n_drop == 0 and keep == cfg.intermediate_size:
        raise ValueError("nothing to prune: give --drop-layers / --layers-fraction and/or an --ffn-fraction that "
                         f"removes at least one group of {CHANNEL_MULTIPLE} channels")
    source_config = _source_config(files)
    windows = calibration_windows(files.tokenizer, calib_path, calib_tokens)
    say(f"scoring {cfg.num_layers} layers on {sum(map(len, windows))} calibration tokens")
    fmodel = build_float_model(files, max(len(w) for w in windows) + 1)
    scores = prune_scores(fmodel, windows)
    del fmodel
    drop = layers_to_drop(scores.layer_distance, n_drop)
    channels = None
    if keep < cfg.intermediate_size:
        channels = {i: channels_to_keep(imp, keep) for i, imp in enumerate(scores.channel_importance)}
    kept_layers = [i for i in range(cfg.num_layers) if i not in drop]
    say(f"writing {out}")
    weights = prune_weights(files.weights, cfg.num_layers, drop, channels)
    if source_config.get("tie_word_embeddings") and "lm_head.weight" in weights:
        del weights["lm_head.weight"]       # tied: stored once, as HF saves it
    os.makedirs(out, exist_ok=True)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    new_config = pruned_config(source_config, kept_layers, keep)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(new_config, f, indent=1)
    files.tokenizer.save_pretrained(out)
    before = cfg.num_params()
    from tokenfab.model.config import ModelConfig
    after = ModelConfig.from_hf(new_config).num_params()
    res = PruneResult(out, drop, scores.layer_distance, cfg.num_layers, len(kept_layers), cfg.intermediate_size, keep,
                      before, after, sum(map(len, windows)), time.perf_counter() - t0,
                      {"source": files.path, "ffn_fraction": ffn_fraction,
                       "criterion": {"layers": "mean angular distance between a layer's input and output",
                                     "ffn_channels": "mean |act(gate) * up| per channel"}})
    with open(os.path.join(out, PRUNING_FILE), "w") as f:
        json.dump(res.as_dict(), f, indent=1)
    return res
