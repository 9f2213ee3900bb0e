"""SmolLM3: the Llama decoder without RoPE on every 4th layer (ModelConfig.nope_layers). config.json says
which (`no_rope_layers`: 1 where a layer uses RoPE); GGUF files carry no key for it, and llama.cpp's
constant step of 4 is used."""
from tokenfab.model.families import Family, register

NOPE_STEP = 4           # HF's default interval, llama.cpp's constant


def _from_hf(cfg: dict, out) -> None:
    step = cfg.get("no_rope_layer_interval", NOPE_STEP)
    use = cfg.get("no_rope_layers") or [int((i + 1) % step != 0) for i in range(out.num_layers)]
    out.nope_layers = [not u for u in use]
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ValueError("unsupported: SmolLM3 with use_sliding_window")


def _from_gguf(field, out) -> None:
    out.nope_layers = [(i + 1) % NOPE_STEP == 0 for i in range(out.num_layers)]


register(Family("smollm3", ("smollm3",), from_hf=_from_hf, from_gguf=_from_gguf, rope_permuted=True))
