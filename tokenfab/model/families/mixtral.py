"""Mixtral: the Llama decoder with mixture-of-experts MLPs (model/moe.py) of width `intermediate_size`, a
softmax router whose top `num_experts_per_tok` of `num_local_experts` are always renormalised. HF names them
`block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1 / w2 / w3` (gate, down, up), renamed on load to
the names every MoE family shares. llama.cpp writes Mixtral as arch `llama` with `llama.expert_count` and
stacked `ffn_*_exps` tensors, Q/K permuted as for Llama: the llama family reads those files."""
from tokenfab.model.families import Family, register

_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _from_hf(cfg: dict, out) -> None:
    if cfg.get("sliding_window"):
        raise ValueError(f"unsupported sliding_window={cfg['sliding_window']} in a Mixtral config (tokenfab runs "
                         "Mixtral without a window; set it null)")
    out.set_experts(int(cfg.get("num_local_experts", 0)), int(cfg.get("num_experts_per_tok", 0)),
                    out.intermediate_size, True)


def rename(cfg, weights, raw) -> None:
    """`block_sparse_moe.*` -> `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (HF folders; GGUF files
    come with these names from the loader)."""
    for name in [n for n in weights if ".block_sparse_moe." in n]:
        new = name.replace(".block_sparse_moe.", ".mlp.")
        parts = new.split(".")
        if len(parts) == 8 and parts[4] == "experts":      # model.layers.i.mlp.experts.e.w1.weight
            parts[6] = _EXPERT_NAMES.get(parts[6], parts[6])
        weights[".".join(parts)] = weights.pop(name)


register(Family("mixtral", ("mixtral",), from_hf=_from_hf, rope_permuted=True, split_weights=rename))
