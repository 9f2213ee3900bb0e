"""Decode GGUF's Q8_0, Q4_0 and Q4_1 blocks into tensors, without requantizing anything.

Block layouts (ggml's, groups of 32 weights along a row; see gguf.quants for the reference):
- Q8_0, 34 bytes: fp16 scale d, then 32 int8 q.                    w = d * q
- Q4_0, 18 bytes: fp16 d, then 16 bytes of nibbles.                 w = d * (q - 8)
- Q4_1, 20 bytes: fp16 d, fp16 m, then 16 bytes of nibbles.         w = d * q + m
- Q5_0, 22 bytes: fp16 d, 4 bytes qh (bit j: weight j's fifth bit), 16 bytes of nibbles.   w = d * (q - 16)
In the nibble bytes, byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

`data` is what `gguf.GGUFReader` gives for a quantized tensor: uint8 `[rows, bytes_per_row]`
(rows = out_features). Row order is kept, so a caller that needs to permute rows (llama.cpp
permutes Q/K rows for its RoPE layout) can permute `data` first.
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2, "Q5_0": 6 + BLOCK // 2}


def _blocks(data, out_features: int, in_features: int, kind: str) -> np.ndarray:
    if in_features % BLOCK:
        raise ValueError(f"{kind} needs in_features divisible by {BLOCK}, got {in_features}")
    arr = np.ascontiguousarray(np.asarray(data)).view(np.uint8)
    nb = in_features // BLOCK
    expected = out_features * nb * BLOCK_BYTES[kind]
    if arr.size != expected:
        raise ValueError(f"{kind} data for [{out_features}, {in_features}] should be {expected} bytes, "
                         f"got {arr.size} (shape {tuple(arr.shape)})")
    return arr.reshape(out_features, nb, BLOCK_BYTES[kind])


def _fp16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def decode_q8_0(data, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 [out, in], d float32 [out, in / 32])."""
    b = _blocks(data, out_features, in_features, "Q8_0")
    d = _fp16(b[..., 0:2])
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)).reshape(out_features, in_features)
    return q, d


def _nibbles(qs: np.ndarray, out_features: int, in_features: int) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(qs))                     # [out, nb, 16]
    q = torch.cat([t & 0x0F, t >> 4], dim=2)                           # weights 0..15, then 16..31
    return q.reshape(out_features, in_features)


def _nibble_bytes(qs: np.ndarray, out_features: int, in_features: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(qs).reshape(out_features, in_features // 2))


def decode_q4_0(data, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (the nibble bytes as stored, uint8 [out, in / 2], d float32 [out, in / 32]); w = d * (q - 8)."""
    b = _blocks(data, out_features, in_features, "Q4_0")
    return _nibble_bytes(b[..., 2:], out_features, in_features), _fp16(b[..., 0:2])


def decode_q4_1(data, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (the nibble bytes as stored, uint8 [out, in / 2], d float32, m float32 [out, in / 32]);
    w = d * q + m."""
    b = _blocks(data, out_features, in_features, "Q4_1")
    return _nibble_bytes(b[..., 4:], out_features, in_features), _fp16(b[..., 0:2]), _fp16(b[..., 2:4])


def decode_q5_0(data, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 [out, in] values -16..15, d float32 [out, in / 32]); w = d * q (Q8_0's form)."""
    b = _blocks(data, out_features, in_features, "Q5_0")
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")                    # [out, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)   # [out, nb, 32]
    low = _nibbles(b[..., 6:], out_features, in_features).numpy().reshape(high.shape)
    q = (low | (high << 4)).astype(np.int16) - 16
    return torch.from_numpy(q.astype(np.int8).reshape(out_features, in_features)), _fp16(b[..., 0:2])
