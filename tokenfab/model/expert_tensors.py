"""Mixture-of-experts weights in the decoder's per-expert names (`model.layers.{i}.mlp.experts.{e}.gate_proj
.weight` ...), from the stacked forms files hold them in: llama.cpp's 3-D GGUF tensors, one per projection and
layer ([experts, rows, columns]: `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, or gate and up fused as
`ffn_gate_up_exps`), and transformers 5's own state-dict layout. The loader (model/loader.py) reads each
expert's slice from these; model/moe.py runs them.
"""
from __future__ import annotations

from collections.abc import Iterator

from tokenfab.model import families


def stacked_experts(gguf_name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, HF projections) of a llama.cpp stacked expert tensor (`blk.3.ffn_up_exps.weight`, or its
    `.bias` [experts, rows]: gpt-oss), else None."""
    parts = gguf_name.split(".")
    if (len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias")
            and parts[2] in families.STACKED_EXPERT_NAMES):
        return int(parts[1]), families.STACKED_EXPERT_NAMES[parts[2]]
    return None


def expert_slices(num_experts: int, layer: int, projs: tuple[str, ...], intermediate_size: int,
                  suffix: str = "weight") -> Iterator[tuple[str, int, slice]]:
    """(HF name, expert, rows of that expert's matrix, or of its bias) for each expert and projection of a
    stacked tensor; a fused gate/up splits its rows at the experts' width, gate first."""
    rows = [slice(None)] if len(projs) == 1 else [slice(j * intermediate_size, (j + 1) * intermediate_size)
                                                  for j in range(len(projs))]
    for e in range(num_experts):
        for proj, r in zip(projs, rows):
            yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}", e, r


def split_stacked_hf_experts(cfg, weights) -> None:
    """transformers 5's layout of a layer's experts, `mlp.experts.gate_up_proj` [E, 2 I, H] and
    `mlp.experts.down_proj` [E, H, I] (its save_pretrained writes the per-expert names back; a state dict
    saved as it is keeps these), as the per-expert names, in place."""
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        for stacked, pieces in (("gate_up_proj", (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))),
                                ("down_proj", (("down_proj", 0, None),))):
            name = next((n for n in (p + stacked, p + stacked + ".weight") if n in weights), None)
            if name is None:
                continue
            full = weights.pop(name)
            for e in range(full.shape[0]):
                for proj, a, b in pieces:
                    weights[f"{p}{e}.{proj}.weight"] = full[e, a:b].contiguous()
