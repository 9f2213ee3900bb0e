"""Load a model: a GGUF file or an HF folder (config.json + *.safetensors + tokenizer.json).

Returns a `ModelConfig`, float weights keyed by HF names (`model.layers.0.self_attn.q_proj.weight` ...)
and the tokenizer. Quantized GGUF tensors (Q4_0/Q4_1/Q8_0/...) are dequantized when a weight is read
(`LazyWeights`), so a build that runs them natively (tokenfab.quant) never makes their float copies.
Every failure is one line naming the file and the problem.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenfab.model import expert_tensors, families
from tokenfab.model import rope as rope_scalings
from tokenfab.files.bundled import resolve_model_path
from tokenfab.model.config import ModelConfig
from tokenfab.files.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model file or folder cannot be used; the message names it and says why."""


class LazyWeights(MutableMapping):
    """HF name -> float32 tensor, read from the file each time it is asked for and not kept.

    A GGUF file's tensors are dequantized on access, so loading holds only the mapped file: a build
    that runs the file's blocks natively never makes a float copy of the layers it replaces (the
    bundled model's load peaked at 1.4 GiB when every tensor was dequantized up front). Tensors set
    by assignment are held as given. `reads` counts the dequantizations, for tests."""

    def __init__(self):
        self._items: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = {}
        self.reads = 0

    def defer(self, name: str, read: Callable[[], torch.Tensor]) -> None:
        self._items[name] = read

    def reader(self, name: str) -> Callable[[], torch.Tensor]:
        """What reads `name` (a held tensor: returns it), for a deferred tensor built from it."""
        v = self._items[name]
        return (lambda: v) if isinstance(v, torch.Tensor) else v

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._items[name]
        if isinstance(v, torch.Tensor):
            return v
        self.reads += 1
        return v()

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._items[name] = value

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __contains__(self, name: object) -> bool:   # Mapping's would read the tensor
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:      # MutableMapping's would read every tensor on the way out
        self._items.clear()


@dataclass
class LoadedModel:
    path: str
    config: ModelConfig
    weights: MutableMapping[str, torch.Tensor]   # HF names, float32 tensors (GGUF: LazyWeights)
    tokenizer: object
    file_dtypes: dict[str, int]        # tensor type name -> count, as stored in the file (for `info`)
    # GGUF block-quantized tensors as shipped (HF name -> (type name, raw uint8 [rows, bytes])), with
    # llama.cpp's Q/K row permutation already undone, for running them natively (quantization="gguf").
    gguf_raw: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)


_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        family = families.for_gguf(arch)
        names = family.gguf_layer_names if family is not None else families.LLAMA_LAYER_NAMES
        if part not in names:
            raise KeyError(name)
        return f"model.layers.{idx}.{names[part]}.{suffix}"
    if base not in _GGUF_TOP_NAMES:
        raise KeyError(name)
    return f"{_GGUF_TOP_NAMES[base]}.{suffix}"


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves the two RoPE halves of each Q/K head's rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """`gguf.GGUFReader` slicing a plain ndarray view of the mapped file instead of the `np.memmap`:
        numpy runs Python code for each view of a memmap, and the metadata parse makes ~1M of them for a
        49k-token vocabulary (the bundled file's parse: 2.0 -> 0.8 s). The file stays mapped, not read."""

        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, value):
            self._mapped = np.asarray(value)

        def _get_field_parts(self, orig_offs, raw_type):
            """Arrays without a parse per element (the vocabulary's ~100k strings and 49k scores took 1.4 s
            of a 1B file's start): a string array's parts are its strings' length and byte views, as gguf's
            (`contents()` reads them the same); a number array is one part, all its values."""
            if raw_type != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            buf = self._mapped
            itype = gguf.GGUFValueType(int(buf[orig_offs:orig_offs + 4].view(np.uint32)[0]))
            n = int(buf[orig_offs + 4:orig_offs + 12].view(np.uint64)[0])
            parts = [buf[orig_offs:orig_offs + 4].view(np.uint32), buf[orig_offs + 4:orig_offs + 12].view(np.uint64)]
            offs = orig_offs + 12
            kinds = [gguf.GGUFValueType.ARRAY] + ([itype] if n else [])
            if itype == gguf.GGUFValueType.STRING:
                raw, idxs = memoryview(buf), []
                for _ in range(n):
                    slen = int.from_bytes(raw[offs:offs + 8], "little")
                    parts += (buf[offs:offs + 8].view(np.uint64), buf[offs + 8:offs + 8 + slen])
                    idxs.append(len(parts) - 1)
                    offs += 8 + slen
                return offs - orig_offs, parts, idxs, kinds
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:              # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            size = n * np.dtype(nptype).itemsize
            parts.append(buf[offs:offs + size].view(nptype))
            return 12 + size, parts, [2] if n else [], kinds

    return Reader


def open_gguf(path: str):
    try:
        return _gguf_reader_class()(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt "
                             f"({type(e).__name__}: {e})") from None


def gguf_config(reader, path: str) -> ModelConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return v

    arch = field("general.architecture")
    family = families.for_gguf(arch)
    if family is None:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(families.supported())}")
    try:
        heads = int(field(f"{arch}.attention.head_count"))
        hidden = int(field(f"{arch}.embedding_length"))
        names = {t.name for t in reader.tensors}
        vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
        head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.rope.dimension_count") or hidden // heads
        eos = field("tokenizer.ggml.eos_token_id")
        cfg = ModelConfig(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_layers=int(field(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            name=str(field("general.name", "")),
        )
        experts = field(f"{arch}.expert_count")
        if experts:         # llama.cpp's keys; a layer with a router tensor is a mixture-of-experts layer
            used = int(field(f"{arch}.expert_used_count", 0))
            if not 0 < used <= int(experts):
                raise ModelLoadError(f"{path}: {arch}.expert_used_count={used} must be between 1 and "
                                     f"{arch}.expert_count={int(experts)}")
            cfg.set_experts(int(experts), used,
                            int(field(f"{arch}.expert_feed_forward_length") or cfg.intermediate_size), True,
                            [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(cfg.num_layers)])
        cfg.rope_scaling = _gguf_rope_scaling(reader, field, arch, cfg, path)
        family.from_gguf(field, cfg)        # may set its own routing normalisation (OLMoE: none)
        if field(f"{arch}.expert_weights_norm") is not None:      # the file's own word wins
            cfg.norm_topk_prob = bool(field(f"{arch}.expert_weights_norm"))
        return cfg
    except (TypeError, KeyError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata is missing a required field ({e})") from None
    except ModelLoadError:
        raise
    except ValueError as e:         # numbers that do not fit together, e.g. more experts per token than experts
        raise ModelLoadError(f"{path}: {e}") from None


def _gguf_rope_scaling(reader, field, arch: str, cfg: ModelConfig, path: str) -> dict | None:
    """RoPE scaling as llama.cpp's converter writes it: Llama 3.x's as per-frequency divisors (the tensor
    `rope_freqs.weight`), linear and YaRN as `{arch}.rope.scaling.*` metadata (model/rope.py)."""
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}
    if "rope_factors_long.weight" in tensors:      # Phi-3's longrope: both factor sets, the original context
        factors = {k: [float(v) for v in np.asarray(tensors[f"rope_factors_{k.split('_')[0]}.weight"].data).reshape(-1)]
                   for k in ("long_factor", "short_factor")}
        orig = field(f"{arch}.rope.scaling.original_context_length")
        attn = field(f"{arch}.rope.scaling.attn_factor")      # the converter's sqrt(1 + ln(s) / ln(original))
        s = {"rope_type": "longrope", **factors,
             "original_max_position_embeddings": int(orig) if orig else cfg.max_position_embeddings,
             **({"attention_factor": float(attn)} if attn is not None else {})}
        try:
            return rope_scalings.normalize(s, cfg.max_position_embeddings)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        return rope_scalings.normalize({"rope_type": "freq_factors",
                                        "factors": [float(v) for v in np.asarray(freqs.data).reshape(-1)]}, 0)
    kind = field(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r}; supported: linear, yarn, and Llama 3's "
                             "rope_freqs tensor")
    factor = field(f"{arch}.rope.scaling.factor")
    if factor is None:                      # older files: the scale as a divisor of positions
        scale = field(f"{arch}.rope.scale_linear")
        factor = 1.0 / float(scale) if scale else None
    s = {"rope_type": kind, "factor": None if factor is None else float(factor)}
    if kind == "yarn":
        orig = field(f"{arch}.rope.scaling.original_context_length")
        s["original_max_position_embeddings"] = int(orig) if orig else cfg.max_position_embeddings
        for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            v = field(f"{arch}.rope.scaling.{name}")
            if v is not None:
                s[key] = float(v)
        attn = field(f"{arch}.rope.scaling.attn_factor")   # llama.cpp multiplies YaRN's own 0.1 ln(factor) + 1 by it
        if attn is not None and float(attn) != 1.0 and s["factor"]:
            s["attention_factor"] = float(attn) * rope_scalings.yarn_mscale(s["factor"])
    try:
        return rope_scalings.normalize(s, cfg.max_position_embeddings)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


# Run as shipped with quantization="gguf" (tokenfab/quant: Q5_0 widened into Q8_0's form, K-quants as stored).
_NATIVE_GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Read (dequantized by the gguf package) for quantization="none", and MXFP4 (gpt-oss's experts, no kernel) always.
READABLE_GGUF_TYPES = ("F32", "F16", "BF16", "Q5_1", "MXFP4") + _NATIVE_GGUF_TYPES


def load_gguf_weights(reader, cfg: ModelConfig, path: str):
    """-> (float weights, read lazily: LazyWeights; tensor type counts; raw blocks of the natively
    runnable quantized tensors)."""
    import gguf

    weights = LazyWeights()
    types: dict[str, int] = {}
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for t in reader.tensors:
        stacked = expert_tensors.stacked_experts(t.name)
        try:
            hf = gguf_name_to_hf(t.name, cfg.arch) if stacked is None else ""
        except KeyError:
            continue  # e.g. rope_freqs: read into the config's rope_scaling (_gguf_rope_scaling)
        qtype = t.tensor_type
        if qtype.name not in READABLE_GGUF_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has quantization type {qtype.name}, which tokenfab "
                                 f"does not read; supported: {', '.join(READABLE_GGUF_TYPES)}")
        types[qtype.name] = types.get(qtype.name, 0) + 1
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if t.data.nbytes != int(t.n_elements) // block * block_bytes:   # read lazily: check the size now
            raise ModelLoadError(f"{path}: tensor {t.name} of type {qtype.name} cannot be read, the file is "
                                 f"truncated or corrupt ({t.data.nbytes} of its "
                                 f"{int(t.n_elements) // block * block_bytes} bytes are there)")
        if stacked is not None:     # each expert's slice alone: a float read dequantizes one expert, not the stack
            kind = t.name.rpartition(".")[2]        # weight or bias
            for hf, e, rows in expert_tensors.expert_slices(t.data.shape[0], *stacked, cfg.moe_intermediate_size, kind):
                weights.defer(hf, lambda t=t, hf=hf, part=(e, rows): _gguf_float(t, hf, 0, cfg, path, part))
                if qtype.name in _NATIVE_GGUF_TYPES:
                    raw[hf] = (qtype.name, t.data[e][rows])
            continue
        heads = _rope_permuted_heads(cfg, hf)
        weights.defer(hf, lambda t=t, hf=hf, heads=heads: _gguf_float(t, hf, heads, cfg, path))
        if qtype.name in _NATIVE_GGUF_TYPES:
            blocks = t.data
            if heads:   # rows are independent blocks: permute the raw rows as the float rows are
                blocks = _unpermute_rope_rows(torch.from_numpy(np.array(blocks)), heads).numpy()
            raw[hf] = (qtype.name, blocks)
    if types.get("MXFP4"):
        log.warning("%s: %d MXFP4 tensors are dequantized to float at load (tokenfab has no MXFP4 kernel; they "
                    "take 8x their file size in float32)", path, types["MXFP4"])
    return weights, types, raw


def _gguf_float(t, hf: str, heads: int, cfg: ModelConfig, path: str,
                part: tuple[int, slice] | None = None) -> torch.Tensor:
    """One GGUF tensor as float32, in HF's row order and norm convention (`part`: one expert's stacked rows)."""
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data if part is None else t.data[part[0]][part[1]], t.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name} of type {t.tensor_type.name} cannot be read, the file is "
                             f"truncated or corrupt ({type(e).__name__}: {e})") from None
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    if heads:
        w = _unpermute_rope_rows(w, heads)
    if cfg.norm_offset and hf.endswith("norm.weight"):
        w = w - cfg.norm_offset       # llama.cpp stores Gemma's (1 + w); HF's convention is w
    return w


def _rope_permuted_heads(cfg: ModelConfig, hf_name: str) -> int:
    """How many heads llama.cpp's converter permuted in this tensor (0: not permuted)."""
    family = families.for_gguf(cfg.arch)
    if family is None or not family.rope_permuted:
        return 0
    if ".q_proj." in hf_name:
        return cfg.num_heads
    if ".k_proj." in hf_name:
        return cfg.num_kv_heads
    return 0


def load_hf_folder(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, int]]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (an HF model folder needs config.json and *.safetensors)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    try:
        cfg = ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: missing field {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for fn in files:
        try:
            part = load_file(fn)
        except Exception as e:  # safetensors raises its own error types for damaged headers
            raise ModelLoadError(f"{fn}: cannot read safetensors ({e})") from None
        for k, v in part.items():
            types[str(v.dtype).removeprefix("torch.")] = types.get(str(v.dtype).removeprefix("torch."), 0) + 1
            weights[k] = v.float() if v.is_floating_point() else v
    return cfg, weights, types


def load_model_files(model: str | None) -> LoadedModel:
    """Resolve `model` (None: the bundled GGUF), read config, weights and tokenizer."""
    path = resolve_model_path(model)
    raw: dict[str, tuple[str, np.ndarray]] = {}
    if os.path.isdir(path):
        cfg, weights, types = load_hf_folder(path)
    else:
        reader = open_gguf(path)
        cfg = gguf_config(reader, path)
        weights, types, raw = load_gguf_weights(reader, cfg, path)
    try:
        tok = load_tokenizer(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    to_decoder_layout(cfg, weights, raw)
    return LoadedModel(path=path, config=cfg, weights=weights, tokenizer=tok, file_dtypes=types, gguf_raw=raw)


def to_decoder_layout(cfg: ModelConfig, weights, raw: dict) -> None:
    """A family's tensors in the decoder's names and row order, in place: fused tensors split (Phi-3's
    qkv_proj, gate_up_proj), then a partial rotary head's q / k rows moved (partial_rotary_rows)."""
    families.for_gguf(cfg.arch).split_weights(cfg, weights, raw)
    if cfg.num_experts:
        expert_tensors.split_stacked_hf_experts(cfg, weights)
    if cfg.rotary_dim:
        _move_partial_rotary_rows(cfg, weights, raw)


def partial_rotary_rows(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's q / k rows that puts a partial rotary head's rotated pairs where the decoder's
    full-width rotate-half pairs them: rows [0, r/2) and [r/2, r) (HF pairs j with j + r/2) go to [0, r/2)
    and [D/2, D/2 + r/2), the D - r passed-through rows fill the rest. q . k is unchanged (the same order
    on both); RotaryEmbedding gives the moved-in rows frequency 0."""
    r, d, p = rotary_dim, head_dim, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(0, r // 2), torch.arange(r, r + p), torch.arange(r // 2, r), torch.arange(r + p, d)))


def _move_partial_rotary_rows(cfg: ModelConfig, weights, raw) -> None:
    if cfg.rotary_dim % 2 or (cfg.head_dim - cfg.rotary_dim) % 2:
        raise ModelLoadError(f"partial rotary on {cfg.rotary_dim} of {cfg.head_dim} dimensions: both must be even")
    perm = partial_rotary_rows(cfg.head_dim, cfg.rotary_dim)

    def moved(t, heads):
        rows = t.reshape(heads, cfg.head_dim, *t.shape[1:])[:, perm if isinstance(t, torch.Tensor) else perm.numpy()]
        return rows.reshape(t.shape)

    for i in range(cfg.num_layers):
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{suffix}"
                if name in raw:
                    kind, blocks = raw[name]
                    raw[name] = (kind, np.ascontiguousarray(moved(np.asarray(blocks), heads)))
                if name not in weights:
                    continue
                if isinstance(weights, LazyWeights):
                    weights.defer(name, lambda read=weights.reader(name), h=heads: moved(read(), h).contiguous())
                else:
                    weights[name] = moved(weights[name], heads).contiguous()
