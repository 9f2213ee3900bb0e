"""Random-weight GGUF files of the sizes people serve, for speed and memory at size: a Llama decoder of
a real geometry (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B shapes, no RoPE scaling) with the bundled
SmolLM2 tokenizer, written as F16, then quantized by llama.cpp's own quantizer to each type asked.

    python benchmarks/size_models.py --geometry llama-3.2-1b --types Q4_K_M,Q4_0,Q8_0 --out ~/.cache/tokenfab-size
    MODEL=~/.cache/tokenfab-size/llama-3.2-1b-Q4_K_M.gguf bash benchmarks/vs_anchors.sh OUT

Quantizing needs llama.cpp built (../shared/anchors/llama-server.sh build). Weights are normal with
std 0.02 (embeddings and norms as a trained model's scale), so generated text is noise but every
kernel, memory and bandwidth figure is that of the real geometry. The files are written once and
reused; the F16 file (2.5 GB for 1B, 6.4 GB for 3B, 16 GB for 8B) is kept only with --keep-f16.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bandwidth import GEOMETRIES  # noqa: E402

LAYERS = {"smollm2-135m": 30, "llama-3.2-1b": 16, "llama-3.2-3b": 28, "llama-3.1-8b": 32}
TIED = {"smollm2-135m": True, "llama-3.2-1b": True, "llama-3.2-3b": True, "llama-3.1-8b": False}
ANCHORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "anchors")


def write_f16(path: str, geometry: str, seed: int = 0) -> None:
    import gguf

    from tokenfab.files.bundled import bundled_model_path
    hidden, h, kvh, d, ffn = GEOMETRIES[geometry]
    src = gguf.GGUFReader(bundled_model_path())
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random {geometry}")
    w.add_block_count(LAYERS[geometry])
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(h)
    w.add_head_count_kv(kvh)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():                  # the bundled tokenizer, as its file holds it
        if key.startswith("tokenizer."):
            vt = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vt, sub_type=sub)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)

    def rand(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(LAYERS[geometry]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", rand(h * d, hidden))
        w.add_tensor(p + "attn_k.weight", rand(kvh * d, hidden))
        w.add_tensor(p + "attn_v.weight", rand(kvh * d, hidden))
        w.add_tensor(p + "attn_output.weight", rand(hidden, h * d))
        w.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not TIED[geometry]:
        w.add_tensor("output.weight", rand(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="llama-3.2-1b", choices=sorted(LAYERS))
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0", help="llama-quantize types, comma-separated")
    ap.add_argument("--out", default=os.path.expanduser("~/.cache/tokenfab-size"))
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    f16 = os.path.join(args.out, f"{args.geometry}-F16.gguf")
    todo = [t for t in args.types.split(",") if t and not os.path.exists(os.path.join(args.out, f"{args.geometry}-{t}.gguf"))]
    if todo and not os.path.exists(f16):
        write_f16(f16 + ".part", args.geometry)
        os.replace(f16 + ".part", f16)
    for t in todo:
        out = os.path.join(args.out, f"{args.geometry}-{t}.gguf")
        subprocess.run(["bash", os.path.join(ANCHORS, "llama-server.sh"), "quantize", f16, out + ".part", t],
                       check=True, stdout=subprocess.DEVNULL)
        os.replace(out + ".part", out)
    if not args.keep_f16 and os.path.exists(f16):
        os.unlink(f16)
    for t in args.types.split(","):
        path = os.path.join(args.out, f"{args.geometry}-{t}.gguf")
        print(f"{path}  {os.path.getsize(path) / 1e6:,.0f} MB")


if __name__ == "__main__":
    main()
