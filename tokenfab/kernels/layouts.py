"""The weight layouts the C kernels read, and what their `bits` flags mean: a tf_qgemm layout is
(q, d, m, group size, bits); `bits | QDOT_FLAG` and `bits | QTILE_FLAG` name the qdot and qtile layouts
the one-call decode stack runs, K-quant type ids name GGUF's blocks as stored. Plain torch: building a
layout needs no compiled library.
"""
from __future__ import annotations

import torch

QDOT_FLAG = 256          # tf_qgemm's `bits | QDOT_FLAG` runs tf_qdot (a qdot layout in the decode stack)
QDOT_KQUANT_TYPES = (12, 14)   # Q4_K, Q6_K: the K-quants tf_qdot multiplies in integers
QTILE_FLAG = 512         # tf_qgemm's `bits | QTILE_FLAG` runs tf_qtile (a qtile layout in the decode stack)
QTILE_MAX_ROWS = 16      # rows tf_qtile takes per pass over the weight (TF_QTILE_ROWS in csrc/amx_qtile.c)
QTILE_HALF = 1024        # a qtile layout's `bits | QTILE_HALF`: its scales and offsets are float16 (TF_QTILE_HALF)
KQUANT_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
KQUANT_BLOCK_BYTES = {10: 84, 11: 110, 12: 144, 13: 176, 14: 210}
Q4_0_TYPE = 2            # ggml's id for Q4_0: a layout of Q4_0 blocks as stored (18 bytes per 32 weights)


def layout_in_features(layout: tuple) -> int:
    """The input width a tf_qgemm layout (q, d, m, gs, bits) covers."""
    q, _, _, _, bits = layout
    bits &= ~(QDOT_FLAG | QTILE_FLAG | QTILE_HALF)
    if bits in KQUANT_BLOCK_BYTES:
        return q.shape[1] // KQUANT_BLOCK_BYTES[bits] * 256
    if bits == Q4_0_TYPE:
        return q.shape[1] // 18 * 32
    return q.shape[1] * (2 if bits == 4 else 1)


def qtile_pack(layout: tuple, out_features: int) -> tuple:
    """A tf_qgemm layout (q, d, m, gs, bits 4 or 8) -> tf_qtile's (csrc/amx_qtile.c): outputs in tiles of 16, each
    block of 32 inputs as the tile unit's B operand (int8 as is; int4 as nibbles, two B rows per 64
    bytes); the scales and int4's offsets tiled [out / 16, groups, 16] (a block's 16 in one load), in
    float16 when that is exact (GGUF's blocks store float16: `bits | QTILE_HALF`), else float32. Int4
    repacks the same bytes as the input layout; int8 copies its weight (the Q8_0 LM head: 27 MiB more);
    the tiled scales are copies too (float16: 8 MiB on the bundled model)."""
    q, d, m, gs, bits = layout
    N = out_features
    assert bits in (4, 8) and N % 16 == 0 and q.shape[0] == N
    K = q.shape[1] * (2 if bits == 4 else 1)
    nb, T = K // 32, N // 16
    if bits == 4:
        raw = q.view(torch.uint8).reshape(N, nb, 16)
        w = torch.cat([raw & 0x0F, raw >> 4], dim=2)                 # [N, nb, 32], weight j in lane j
    else:
        w = q.view(torch.uint8).reshape(N, nb, 32)
    w = w.reshape(T, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)           # [T, nb, B row i, output n, k 4i + j]
    if bits == 4:                                                     # rows 2c, 2c + 1 share chunk c's bytes
        w = w.reshape(T, nb, 4, 2, 16, 4)
        packed = (w[:, :, :, 0] | (w[:, :, :, 1] << 4)).contiguous().view(N, K // 2)
    else:
        packed = w.contiguous().view(torch.int8).view(N, K)
    G = d.shape[1]

    def tiled(v):                                                     # [N, G] -> [N / 16, G, 16]
        return v.float().reshape(T, 16, G).transpose(1, 2).contiguous()

    dt, mt = tiled(d), None if m is None else tiled(m)
    if all(v is None or torch.equal(v.half().float(), v) for v in (dt, mt)):    # GGUF's own: exact in float16
        dt, mt, bits = dt.half(), None if mt is None else mt.half(), bits | QTILE_HALF
    return packed, dt, mt, gs, bits | QTILE_FLAG
