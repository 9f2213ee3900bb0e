"""Quantized checkpoints: one safetensors file with every tensor, plus a JSON quant config.

Layout of a checkpoint folder:
    model.safetensors    the model's full state_dict after quantization: float tensors under their
                         usual names, and for each quantized linear its buffers (`<name>.qweight`,
                         `<name>.scales`, ...) in a portable layout (never the machine-specific packed one).
                         A tied parameter (lm_head = embed_tokens) is stored once, under its first name
    quant_config.json    {"format": "tokenfab-quant", "version": 1, "scheme": ..., "layers":
                         {name: {"type": "Int4Linear", "in_features", "out_features", "bias", ...}},
                         "tied": [[stored name, other names...]], ...}
    config.json          the model config, when the caller passes one (opaque to this module)

Loading, for an engine that builds its model from config.json first:
    if is_quantized_checkpoint(path):
        apply_checkpoint(model, path)             # swaps in the quantized linears, loads every tensor
or, piece by piece: `load_quantized(path)` → (linears by name, all tensors, configs).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tokenfab.quant.apply import set_submodule
from tokenfab.quant.linear import QuantLinear, empty_from_config

FORMAT = "tokenfab-quant"
VERSION = 1
WEIGHTS_FILE = "model.safetensors"
QUANT_CONFIG_FILE = "quant_config.json"
MODEL_CONFIG_FILE = "config.json"


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one parameter (e.g. [embed_tokens.weight, lm_head.weight])."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _portable_state(model: nn.Module, tied: list[list[str]]) -> dict[str, torch.Tensor]:
    # a tied parameter is saved once, under its first name (quant_config "tied" lists the others);
    # safetensors refuses any other tensors that share storage, so those get their own copy
    skip = {n for names in tied for n in names[1:]}
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if name in skip:
            continue
        t = t.detach().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[name] = t.clone().contiguous() if key in seen or not t.is_contiguous() else t
        seen.add(key)
    return out


def save_quantized(model: nn.Module, out_dir: str, *, scheme: str | None = None,
                   model_config: dict | Any | None = None, extra: dict | None = None) -> str:
    """Write model.safetensors + quant_config.json (+ config.json) into out_dir; returns out_dir."""
    from safetensors.torch import save_file

    layers = quantized_layers(model)
    if not layers:
        raise ValueError("model has no quantized linears; run quantize_model(...) before save_quantized")
    os.makedirs(out_dir, exist_ok=True)
    tied = _tied_parameter_names(model)
    save_file(_portable_state(model, tied), os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": FORMAT})
    qcfg = {"format": FORMAT, "version": VERSION, "scheme": scheme,
            "layers": {n: m.config() for n, m in layers.items()}, "tied": tied, **(extra or {})}
    with open(os.path.join(out_dir, QUANT_CONFIG_FILE), "w") as f:
        json.dump(qcfg, f, indent=1)
    if model_config is not None:
        if dataclasses.is_dataclass(model_config):
            model_config = dataclasses.asdict(model_config)
        with open(os.path.join(out_dir, MODEL_CONFIG_FILE), "w") as f:
            json.dump(model_config, f, indent=1)
    return out_dir


def is_quantized_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, QUANT_CONFIG_FILE))


def read_quant_config(path: str) -> dict:
    file = os.path.join(path, QUANT_CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} is not a tokenfab quantized checkpoint (no {QUANT_CONFIG_FILE})")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("format") != FORMAT or cfg.get("version") != VERSION:
        raise ValueError(f"{file}: expected format {FORMAT!r} version {VERSION}, "
                         f"got {cfg.get('format')!r} version {cfg.get('version')!r}")
    return cfg


@dataclass
class QuantizedCheckpoint:
    linears: dict[str, QuantLinear]       # ready-to-use modules, by qualified name
    tensors: dict[str, torch.Tensor]      # every tensor in the file, the linears' own included
    quant_config: dict
    model_config: dict | None


def load_quantized(path: str, device: str | torch.device = "cpu") -> QuantizedCheckpoint:
    from safetensors.torch import load_file

    qcfg = read_quant_config(path)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE), device=str(device))
    linears = {}
    for name, cfg in qcfg["layers"].items():
        mod = empty_from_config(cfg)
        prefix = name + "."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        mod.load_state_dict(own, strict=True)
        linears[name] = mod.to(device)
    model_config = None
    mfile = os.path.join(path, MODEL_CONFIG_FILE)
    if os.path.isfile(mfile):
        with open(mfile) as f:
            model_config = json.load(f)
    return QuantizedCheckpoint(linears, tensors, qcfg, model_config)


def load_quantized_linears(path: str, device: str | torch.device = "cpu") -> dict[str, QuantLinear]:
    return load_quantized(path, device).linears


def apply_checkpoint(model: nn.Module, path: str, strict: bool = True,
                     device: str | torch.device | None = None) -> QuantizedCheckpoint:
    """Swap the checkpoint's quantized linears into `model` by name, then load every tensor.

    `model` is the float model built from the same config; its weights are overwritten. It may
    have been built on the meta device (no wasted init): the tensors are then assigned, not copied,
    and tied parameters (lm_head = embed_tokens) are tied again afterwards.
    """
    real = [p.device for p in model.parameters() if not p.is_meta]
    device = device or (real[0] if real else "cpu")
    on_meta = len(real) < sum(1 for _ in model.parameters())
    ckpt = load_quantized(path, device)
    # ties the file recorded (saved once) and ties the model has: both are restored after loading
    ties = [list(g) for g in ckpt.quant_config.get("tied", [])] + _tied_parameter_names(model)
    saved_once = {n for names in ckpt.quant_config.get("tied", []) for n in names[1:]}
    for name, mod in ckpt.linears.items():
        set_submodule(model, name, mod)
    missing, unexpected = model.load_state_dict(ckpt.tensors, strict=False, assign=on_meta)
    missing = [m for m in missing if m not in saved_once]
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint {path} does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for names in ties:
        owner_name = next((n for n in names if n in ckpt.tensors), names[0])
        owner, _, attr = owner_name.rpartition(".")
        shared = getattr(model.get_submodule(owner) if owner else model, attr, None)
        if not isinstance(shared, nn.Parameter):     # the tie's owner was quantized: nothing to share
            continue
        for other in names:
            mod_name, _, attr = other.rpartition(".")
            try:
                mod = model.get_submodule(mod_name) if mod_name else model
            except AttributeError:
                continue
            if other != owner_name and isinstance(getattr(mod, attr, None), nn.Parameter):
                setattr(mod, attr, shared)
    return ckpt
