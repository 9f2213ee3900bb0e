/* GGUF's K-quant blocks, read as stored: super-blocks of 256 weights along a row (layouts as in ggml
 * and the gguf package's numpy dequantizers, which the tests check every type against). `type` is
 * ggml's type id; tf_qgemm hands these to tf_kgemm when its `bits` argument is one of them, so the
 * same layer table (tf_qlin) and the one-call decode stack take K-quant layers unchanged.
 *   Q2_K (10), 84 bytes:  scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin (fp16)
 *   Q3_K (11), 110 bytes: hmask[32], qs[64] 2-bit low bits, scales[12] (16 x 6-bit signed), d
 *   Q4_K (12), 144 bytes: d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128] nibbles
 *   Q5_K (13), 176 bytes: d, dmin, scales[12], qh[32] (fifth bits), qs[128]
 *   Q6_K (14), 210 bytes: ql[128] nibbles, qh[64] 2-bit highs, scales[16] int8, d
 * Q4_K and Q6_K on AVX2 builds run in integers against int16 activation blocks, as tf_qgemm's int4 / int8
 * layouts do (tf_kint below), and, for tf_qdot (the opt-in int8 activations), against llama.cpp's int8
 * blocks of 256 (tf_kint8). The other types' activations stay float32: a super-block is expanded into 256 floats
 * on the stack once per weight row and dotted with up to 8 activation rows while it is in L1. */
#include "common.h"

int64_t tf_kquant_block_bytes(int64_t type) {
    switch (type) {
        case TF_Q2_K: return 84;
        case TF_Q3_K: return 110;
        case TF_Q4_K: return 144;
        case TF_Q5_K: return 176;
        case TF_Q6_K: return 210;
        default: return 0;
    }
}

/* One super-block -> 256 floats. */
static void tf_kdecode(const uint8_t *b, int64_t type, float *w) {
    switch (type) {
        case TF_Q2_K: {
            const uint8_t *sc = b, *qs = b + 16;
            const float d = tf_f16(b + 80), dmin = tf_f16(b + 82);
            for (int i = 0; i < 256; i++) {
                const int h = i >> 7, s = (i >> 5) & 3, l = i & 31, sub = i >> 4;
                const int q = (qs[h * 32 + l] >> (2 * s)) & 3;
                w[i] = d * (float)(sc[sub] & 0x0F) * (float)q - dmin * (float)(sc[sub] >> 4);
            }
            break;
        }
        case TF_Q3_K: {
            const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
            const float d = tf_f16(b + 108);
            float dl[16];
            for (int j = 0; j < 16; j++) {
                const int lo = (j < 8 ? s[j] : s[j - 8] >> 4) & 0x0F;
                const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
                dl[j] = d * (float)((lo | (hi << 4)) - 32);
            }
            for (int i = 0; i < 256; i++) {
                const int h = i >> 7, sh = (i >> 5) & 3, l = i & 31;
                const int q = ((qs[h * 32 + l] >> (2 * sh)) & 3) - (((hm[l] >> (i >> 5)) & 1) ? 0 : 4);
                w[i] = dl[i >> 4] * (float)q;
            }
            break;
        }
        case TF_Q4_K:
        case TF_Q5_K: {
            const float d = tf_f16(b), dmin = tf_f16(b + 2);
            uint8_t sc[8], mn[8];
            tf_scale_min_k4(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = type == TF_Q4_K ? b + 16 : b + 48;
            for (int sub = 0; sub < 8; sub++) {
                const float a = d * (float)sc[sub], m = dmin * (float)mn[sub];
                const uint8_t *qc = qs + (sub >> 1) * 32;
                const int shift = 4 * (sub & 1);
                float *ws = w + sub * 32;
                if (type == TF_Q4_K) {
                    for (int l = 0; l < 32; l++) ws[l] = a * (float)((qc[l] >> shift) & 0x0F) - m;
                } else {
                    for (int l = 0; l < 32; l++)
                        ws[l] = a * (float)(((qc[l] >> shift) & 0x0F) | (((qh[l] >> sub) & 1) << 4)) - m;
                }
            }
            break;
        }
        case TF_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = tf_f16(b + 208);
            float dl[16];
            for (int j = 0; j < 16; j++) dl[j] = d * (float)sc[j];
            /* ggml's order: per half of 128, weight s * 32 + l takes ql[l + 32 * (s & 1)]'s low (s < 2) or
             * high nibble and bits 2s..2s+1 of qh[l]; loops without div/mod so they vectorize */
            for (int h = 0; h < 2; h++) {
                const uint8_t *qlh = ql + h * 64, *qhh = qh + h * 32;
                float *wh = w + h * 128;
                const float *dh = dl + h * 8;
                for (int l = 0; l < 32; l++) {
                    const int a = qlh[l], c = qlh[l + 32], e = qhh[l], g = l >> 4;
                    wh[l] = dh[g] * (float)(((a & 15) | ((e & 3) << 4)) - 32);
                    wh[l + 32] = dh[2 + g] * (float)(((c & 15) | (((e >> 2) & 3) << 4)) - 32);
                    wh[l + 64] = dh[4 + g] * (float)(((a >> 4) | (((e >> 4) & 3) << 4)) - 32);
                    wh[l + 96] = dh[6 + g] * (float)(((c >> 4) | (((e >> 6) & 3) << 4)) - 32);
                }
            }
            break;
        }
        default:
            memset(w, 0, 256 * sizeof(float));
    }
}

/* The whole [N, K] weight as float32 (the big-batch path: expand once, then a float GEMM). */
void tf_kdequant(float *out, const uint8_t *raw, int64_t N, int64_t K, int64_t type) {
    const int64_t bb = tf_kquant_block_bytes(type), nsb = K / 256;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++)
        for (int64_t s = 0; s < nsb; s++) tf_kdecode(raw + (n * nsb + s) * bb, type, out + n * K + s * 256);
}

/* The same expansion narrowed to bfloat16 as torch's .to(torch.bfloat16) narrows it (tf_to_bf16), in one
 * pass: the bf16 float copy (kernel "bf16") built without a float32 [N, K] in between. */
void tf_kdequant_bf16(uint16_t *out, const uint8_t *raw, int64_t N, int64_t K, int64_t type) {
    const int64_t bb = tf_kquant_block_bytes(type), nsb = K / 256;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++)
        for (int64_t s = 0; s < nsb; s++) {
            float w[256];
            tf_kdecode(raw + (n * nsb + s) * bb, type, w);
            tf_narrow_row(out + n * K + s * 256, w, 256);
        }
}

static inline float tf_dot256(const float *a, const float *b) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < 256; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
/* One output row of a K-quant weight that tf_kint does not read in integers (Q2_K, Q3_K, Q5_K; `row`: its
 * super-blocks) for M activation rows (M a constant at each call site): each super-block expanded to 256 floats once, then dotted with every activation row
 * into A vector accumulators per row, kept across the super-blocks, so the FMAs form M * A independent
 * chains (one chain per row and super-block, as before, was latency-bound: ~4x slower at 8 rows) and
 * each row is summed horizontally once. A = 4 / 2 / 1 for up to 2 / 4 / 8 rows keeps them in registers. */
static inline __attribute__((always_inline)) void tf_kgemm_row(const int M, float *out, const float *x, int64_t K,
                                                              const uint8_t *row, int64_t type, int64_t bb) {
    const int A = M <= 2 ? 4 : M <= 4 ? 2 : 1;
    float w[256] __attribute__((aligned(32)));
    __m256 acc[TF_MAX_ROWS][4];
    for (int r = 0; r < M; r++)
        for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / 256; s++) {
        const float *xs = x + s * 256;
        tf_kdecode(row + s * bb, type, w);
        for (int i = 0; i < 256; i += 8 * A)
            for (int a = 0; a < A; a++) {
                const __m256 wv = _mm256_load_ps(w + i + 8 * a);
                for (int r = 0; r < M; r++)
                    acc[r][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs + r * K + i + 8 * a), acc[r][a]);
            }
    }
    for (int r = 0; r < M; r++) {
        __m256 t = acc[r][0];
        for (int a = 1; a < A; a++) t = _mm256_add_ps(t, acc[r][a]);
        out[r] = tf_hsum(t);
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Q4_K in integers, read as stored (4.5 bits per weight): the activations as tf_qgemm quantizes them
 * (int16 per block of 32, scale max|x| / 32767), each block reordered once per call to its even inputs
 * then its odd ones (tf_kint_prep), and their float sums per block. One 32-byte load holds chunk c of a
 * super-block: sub-block 2c in the low nibbles, 2c + 1 in the high ones, weight l in byte l. Read as 16
 * words, word j holds weights 2j, 2j + 1 of sub-block 2c (bits 0-3, 8-11) and of 2c + 1 (bits 4-7, 12-15),
 * so a mask, and shifts and masks, give four int16 vectors in place, no shuffle; two vpmaddwd against the
 * reordered activations give a sub-block's exact integer dot in 8 lanes. Per sub-block, its scale
 * d * sc (exact in float32) times the block's activation scale multiplies that dot into the row's
 * accumulator, and the mins' term, dmin * mn times the block's float sum, is one FMA per super-block
 * (8 sub-blocks, 8 lanes). The same weight values as gguf's dequantizer, bit for bit, in every product. */
/* x's int16 blocks (tf_quantize_blocks) reordered: per block, inputs 0, 2, .., 30 then 1, 3, .., 31; and the
 * float sums of x per block of 32. */
static void tf_kint_prep(const float *x, int64_t K, int16_t *xq, float *dx, int16_t *xp, float *xs) {
    tf_quantize_blocks(x, K, xq, dx);
    for (int64_t b = 0; b < K / 32; b++) {
        const int16_t *i = xq + b * 32;
        int16_t *o = xp + b * 32;
        float s = 0.f;
        for (int j = 0; j < 16; j++) {
            o[j] = i[2 * j];
            o[16 + j] = i[2 * j + 1];
        }
        for (int j = 0; j < 32; j++) s += x[b * 32 + j];
        xs[b] = s;
    }
}

#ifndef TF_KPF
#define TF_KPF 1024
#endif
/* a block's bytes TF_KPF ahead of the one being read: rows are contiguous, so this streams through
 * the next rows at an even pace (the whole row 4 rows ahead at once, as the other kernels do, leaves the
 * long rows of K = 8192 waiting on memory) */
static inline void tf_kprefetch(const uint8_t *blk, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(blk + TF_KPF + l, 0, 3);
}

/* A Q4_K super-block's 8 sub-block scales and 8 mins as floats: d * sc and dmin * m. */
static inline __attribute__((always_inline)) void tf_q4k_scales(const uint8_t *blk, __m256 *scv, __m256 *mnv) {
    uint64_t sc, mn;
    tf_scale_min_k4_u64(blk + 4, &sc, &mn);
    *scv = _mm256_mul_ps(_mm256_set1_ps(tf_f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc))));
    *mnv = _mm256_mul_ps(_mm256_set1_ps(tf_f16(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn))));
}

static inline __attribute__((always_inline)) void tf_q4k_row(const int M, float *out, const int16_t *xp,
                                                            const float *dx, const float *xs, int64_t K,
                                                            const uint8_t *row) {
    const int64_t nsb = K / 256, nb = K / 32;
    const __m256i lo = _mm256_set1_epi16(0x000F);
    const int H = M <= 4;           /* sub-blocks 2c and 2c + 1 on two FMA chains per row, while they fit in registers */
    __m256 acc[TF_MAX_ROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 144;
        tf_kprefetch(blk, 144);
        __m256 scv, mnv;
        tf_q4k_scales(blk, &scv, &mnv);
        float sx[TF_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < M; r++) {
            _mm256_store_ps(sx[r], _mm256_mul_ps(scv, _mm256_loadu_ps(dx + r * nb + s * 8)));
            acc[r][H] = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(xs + r * nb + s * 8), acc[r][H]);
        }
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32));
            const __m256i w0 = _mm256_and_si256(v, lo), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 8), lo);
            const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), w3 = _mm256_srli_epi16(v, 12);
            for (int r = 0; r < M; r++) {
                const __m256i *xr = (const __m256i *)(xp + r * K + s * 256 + c * 64);
                const __m256i plo = tf_dpwssd(_mm256_madd_epi16(w0, _mm256_loadu_si256(xr)), w1, _mm256_loadu_si256(xr + 1));
                const __m256i phi = tf_dpwssd(_mm256_madd_epi16(w2, _mm256_loadu_si256(xr + 2)), w3, _mm256_loadu_si256(xr + 3));
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), _mm256_broadcast_ss(sx[r] + 2 * c), acc[r][0]);
                acc[r][H] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), _mm256_broadcast_ss(sx[r] + 2 * c + 1), acc[r][H]);
            }
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* tf_q4k_row on 512-bit vectors (the avx512 builds). A chunk's 32 code bytes go to both halves of one
 * register; one per-half shift (0 | 8: the even and odd bytes' low nibbles; 4 | 12: their high ones) and a
 * mask give two 32-lane int16 vectors that line up with tf_kint_prep's activations as they lie (x0 x1 and
 * x2 x3 are contiguous), so each sub-block's dot is one vpmaddwd against one 64-byte load, and one convert
 * and one FMA per sub-block and row apply its scale: about a quarter fewer instructions per weight than the
 * 256-bit loop, at full width on cores that run 512-bit vectors natively (Zen 5, Intel's AVX-512 cores).
 * The integer products are tf_q4k_row's; only the order of the float sums differs. On a Zen 5 EPYC
 * (benchmarks/kquant_row_cycles.c) 4 rows take 48 TSC cycles per super-block against 54-57; one row stays at
 * ~20, where the per-super-block scale work and the per-sub-block convert and FMA set the pace. */
static inline __attribute__((always_inline)) void tf_q4k_row512(const int M, float *out, const int16_t *xp,
                                                               const float *dx, const float *xs, int64_t K,
                                                               const uint8_t *row) {
    const int64_t nsb = K / 256, nb = K / 32;
    const __m512i lo = _mm512_set1_epi16(0x000F);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1);
    const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(12), 1);
    const int H = M <= 4;           /* sub-blocks 2c and 2c + 1 on two FMA chains per row, while they fit in registers */
    __m512 acc[TF_MAX_ROWS][2];
    __m256 mins[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        mins[r] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 144;
        tf_kprefetch(blk, 144);
        __m256 scv, mnv;
        tf_q4k_scales(blk, &scv, &mnv);
        float sx[TF_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < M; r++) {
            _mm256_store_ps(sx[r], _mm256_mul_ps(scv, _mm256_loadu_ps(dx + r * nb + s * 8)));
            mins[r] = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(xs + r * nb + s * 8), mins[r]);
        }
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32)));
            const __m512i w01 = _mm512_and_si512(_mm512_srlv_epi16(v, sh01), lo);
            const __m512i w23 = _mm512_and_si512(_mm512_srlv_epi16(v, sh23), lo);
            for (int r = 0; r < M; r++) {
                const int16_t *xr = xp + r * K + s * 256 + c * 64;
                const __m512i p01 = _mm512_madd_epi16(w01, _mm512_loadu_si512((const void *)xr));
                const __m512i p23 = _mm512_madd_epi16(w23, _mm512_loadu_si512((const void *)(xr + 32)));
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_set1_ps(sx[r][2 * c]), acc[r][0]);
                acc[r][H] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_set1_ps(sx[r][2 * c + 1]), acc[r][H]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + tf_hsum(mins[r]);
}
#define TF_Q4K_ROW tf_q4k_row512
#else
#define TF_Q4K_ROW tf_q4k_row
#endif

/* Q6_K the same way (6.5625 bits per weight): per half of 128, tf_q6k_codes gives 32 six-bit codes in
 * bytes; as 16 words, a mask and a shift give the even and the odd inputs' codes as int16, minus 32, and two
 * vpmaddwd against the reordered activations give block (s, h, j)'s dot, its first 16 weights in lanes 0-3
 * and the rest in lanes 4-7, which take the scales d * sc of their 16 (exact in float32). */
static inline __attribute__((always_inline)) void tf_q6k_row(const int M, float *out, const int16_t *xp,
                                                            const float *dx, const float *xs, int64_t K,
                                                            const uint8_t *row) {
    (void)xs;
    const int64_t nsb = K / 256, nb = K / 32;
    const __m256i lo = _mm256_set1_epi16(0x00FF), off = _mm256_set1_epi16(32);
    const int H = M <= 4;           /* two FMA chains per row while they fit in registers */
    __m256 acc[TF_MAX_ROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 210;
        tf_kprefetch(blk, 210);
        /* the 16 scales d * sc as two vectors, once per super-block (a scalar convert, multiply and broadcast
         * per run of 32 made a one-row call 1.5x slower), and both halves unrolled: run j of half h takes
         * sub-blocks h * 8 + 2j and + 1 into lanes 0-3 and 4-7 by one permute */
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(tf_f16(blk + 208));
        const __m256 sch[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))),
                               _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))))};
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
            for (int j = 0; j < 4; j++) {
                const __m256i u = tf_q6k_codes(blk, qh, h, j);
                const __m256i we = _mm256_sub_epi16(_mm256_and_si256(u, lo), off);
                const __m256i wo = _mm256_sub_epi16(_mm256_srli_epi16(u, 8), off);
                const __m256 ws = _mm256_permutevar8x32_ps(
                    sch[h], _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1));
                const int64_t b = s * 8 + h * 4 + j;
                for (int r = 0; r < M; r++) {
                    const __m256i *xr = (const __m256i *)(xp + r * K + b * 32);
                    const __m256i p = tf_dpwssd(_mm256_madd_epi16(we, _mm256_loadu_si256(xr)), wo, _mm256_loadu_si256(xr + 1));
                    acc[r][j & H] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                                    _mm256_mul_ps(ws, _mm256_broadcast_ss(dx + r * nb + b)),
                                                    acc[r][j & H]);
                }
            }
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* GGUF's Q4_0 as stored (18 bytes per 32 weights: fp16 d, then byte j holding weight j in its low nibble
 * and j + 16 in its high one; w = d * (q - 8)), two blocks per step. The two blocks' 16 code bytes in one
 * register: as 16-bit words, word j of a block holds weights 2j, 2j + 1 (bits 0-3, 8-11) and 2j + 16,
 * 2j + 17 (bits 4-7, 12-15), so masks and shifts give four int16 vectors in place (lanes 0-7: block b,
 * 8-15: block b + 1), minus 8; the activations are laid out to match once per call (tf_q40_prep), so four
 * vpmaddwd give both blocks' exact integer dots (lanes 0-3 and 4-7), scaled by d times the activation
 * block's scale. */
static void tf_q40_prep(const float *x, int64_t K, int16_t *xq, float *dx, int16_t *xp, float *dx8) {
    static const int off[4] = {0, 1, 16, 17};
    const int64_t nb = K / 32;
    tf_quantize_blocks(x, K, xq, dx);
    for (int64_t b = 0; b < nb; b += 2) {
        int16_t *o = xp + b * 32;
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 8; j++)
                    o[g * 16 + h * 8 + j] = b + h < nb ? xq[(b + h) * 32 + 2 * j + off[g]] : 0;
        for (int i = 0; i < 4; i++) {
            dx8[b * 4 + i] = dx[b];
            dx8[b * 4 + 4 + i] = b + 1 < nb ? dx[b + 1] : 0.f;
        }
    }
}

static inline __attribute__((always_inline)) void tf_q40_row(const int M, float *out, const int16_t *xp,
                                                            const float *dx8, const float *xs, int64_t K,
                                                            const uint8_t *row) {
    (void)xs;
    const int64_t nb = K / 32;
    const __m256i lo = _mm256_set1_epi16(0x000F), eight = _mm256_set1_epi16(8);
    const int64_t stride = (nb + 1) / 2 * 64;           /* int16 per activation row in the paired layout */
    __m256 acc[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const uint8_t *b0 = row + b * 18;
        tf_kprefetch(b0, 36);
        const int two = b + 1 < nb;
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + 2));
        const __m128i q1 = two ? _mm_loadu_si128((const __m128i *)(b0 + 20)) : _mm_set1_epi8((char)0x88);
        const __m256i v = _mm256_set_m128i(q1, q0);      /* a missing second block: codes 8, weights 0 */
        const __m256i w0 = _mm256_sub_epi16(_mm256_and_si256(v, lo), eight);
        const __m256i w1 = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), lo), eight);
        const __m256i w2 = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo), eight);
        const __m256i w3 = _mm256_sub_epi16(_mm256_srli_epi16(v, 12), eight);
        const __m256 d = _mm256_set_m128(_mm_set1_ps(two ? tf_f16(b0 + 18) : 0.f), _mm_set1_ps(tf_f16(b0)));
        for (int r = 0; r < M; r++) {
            const __m256i *xr = (const __m256i *)(xp + r * stride + b * 32);
            const __m256i p = _mm256_add_epi32(tf_dpwssd(_mm256_madd_epi16(w0, _mm256_loadu_si256(xr)), w1, _mm256_loadu_si256(xr + 1)),
                                               tf_dpwssd(_mm256_madd_epi16(w2, _mm256_loadu_si256(xr + 2)), w3, _mm256_loadu_si256(xr + 3)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, _mm256_loadu_ps(dx8 + r * stride / 8 + b * 4)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(acc[r]);
}

/* ---------------------------------------------------------------------------------------------------------
 * Q4_K and Q6_K against int8 activations, as llama.cpp multiplies them (its Q8_K): each activation row in
 * blocks of 256, one scale per block (max|x| / 127), int8 values, and their integer sums per 16. A
 * super-block's dot is then integer from end to end: `vpmaddubsw` (unsigned codes x signed activations, 32
 * products in one instruction, pairs below 32767) and `vpmaddwd` against the sub-block scales broadcast to
 * 16 lanes (Q4_K: the 6-bit scale; Q6_K: the signed 8-bit one) sum each sub-block's dot times its scale into
 * 8 int32 lanes, across the whole super-block; one convert and one FMA per super-block and row apply
 * d times the activation scale. The offsets (Q4_K's mins, Q6_K's -32) multiply the sums of the same
 * rounded activations, so the result is W . x~ exactly (x~ the rounded x). The rounding of x is what this
 * costs against tf_kint's int16 blocks: `tokenfab quant eval --kernel qdot` measures it. */
static void tf_q8k_prep(const float *x, int64_t K, int8_t *xq, float *dx, int16_t *bs, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t s = 0; s < K / 256; s++) {
        const float *xb = x + s * 256;
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        dx[s] = amax / 127.f;
        for (int j = 0; j < 256; j += 32) {     /* round to nearest even, as lrintf; |q| <= 127: no saturation */
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * i), id));
            const __m256i w = _mm256_packs_epi32(q[0], q[1]), z = _mm256_packs_epi32(q[2], q[3]);
            /* packs interleaves 128-bit lanes: (q0 lo, q1 lo, q0 hi, q1 hi); restore the order */
            const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w, z), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(xq + s * 256 + j), b);
            /* sums per 16 (two int16 words): bytes to words in pairs, then pairs of words */
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b), _mm256_set1_epi16(1));
            /* p: 8 int32 sums of 4 bytes; the sums of 16 are lanes 0-3 and 4-7 */
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, p);
            bs[s * 16 + j / 16] = (int16_t)(t[0] + t[1] + t[2] + t[3]);
            bs[s * 16 + j / 16 + 1] = (int16_t)(t[4] + t[5] + t[6] + t[7]);
            xs[s * 8 + j / 32] = dx[s] * (float)(t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]);
        }
    }
}

static inline __attribute__((always_inline)) void tf_q4k8_row(const int M, float *out, const int8_t *xq,
                                                             const float *dx, const float *xs, int64_t K,
                                                             const uint8_t *row) {
    const int64_t nsb = K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 144;
        tf_kprefetch(blk, 144);
        uint64_t sc, mn;
        tf_scale_min_k4_u64(blk + 4, &sc, &mn);
        const __m256 d = _mm256_set1_ps(tf_f16(blk));
        const __m256 mnv = _mm256_mul_ps(_mm256_set1_ps(tf_f16(blk + 2)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn))));
        /* the 8 scales as int16, in both 128-bit lanes; sub-block j's broadcast is one byte shuffle */
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)sc)));
        __m256i isum[TF_MAX_ROWS];
        for (int r = 0; r < M; r++) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + (j >> 1) * 32));
            const __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
            const __m256i sv = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
            for (int r = 0; r < M; r++)
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                    u, _mm256_loadu_si256((const __m256i *)(xq + r * K + s * 256) + j)), sv));
        }
        for (int r = 0; r < M; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(dx + r * nsb + s)), acc[r]);
            /* the mins: dmin * mn against the float sums of the rounded x per 32 */
            acc[r] = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(xs + (r * nsb + s) * 8), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(acc[r]);
}

static inline __attribute__((always_inline)) void tf_q6k8_row(const int M, float *out, const int8_t *xq,
                                                             const float *dx, const int16_t *bs, int64_t K,
                                                             const uint8_t *row) {
    const int64_t nsb = K / 256;
    __m256 acc[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 210;
        tf_kprefetch(blk, 210);
        const __m256 d = _mm256_set1_ps(tf_f16(blk + 208));
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m256i isum[TF_MAX_ROWS];
        for (int r = 0; r < M; r++) isum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
            const __m256i sch = _mm256_broadcastsi128_si256(
                h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
            for (int j = 0; j < 4; j++) {
                const __m256i u = tf_q6k_codes(blk, qh, h, j);
                /* lanes 0-7 (weights 0-15): scale 2j of the half; lanes 8-15: scale 2j + 1 */
                const __m256i sj = _mm256_shuffle_epi8(
                    sch, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1))),
                                          _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * j)))));
                for (int r = 0; r < M; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + s * 256 + h * 128 + j * 32));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sj));
                }
            }
        }
        for (int r = 0; r < M; r++) {    /* minus the -32 offset's term: 32 x scale x sum of x~, per 16 */
            const __m256i off = _mm256_slli_epi32(
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(bs + (r * nsb + s) * 16))), 5);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)),
                                     _mm256_mul_ps(d, _mm256_broadcast_ss(dx + r * nsb + s)), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(acc[r]);
}

typedef struct {
    const uint8_t *raw;
    const int8_t *xq;
    const float *dx, *xs;
    const int16_t *bs;
    int64_t M, K, type;
} tf_kint8_job;

static void tf_kint8_cols(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys) {
    const tf_kint8_job *J = (const tf_kint8_job *)job;
    const int64_t M = J->M, row_bytes = J->K / 256 * tf_kquant_block_bytes(J->type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = J->raw + n * row_bytes;
        float out[TF_MAX_ROWS];
        if (J->type == TF_Q4_K) {
            TF_ROWS_SWITCH(tf_q4k8_row, out, J->xq, J->dx, J->xs, J->K, row)
        } else {
            TF_ROWS_SWITCH(tf_q6k8_row, out, J->xq, J->dx, J->bs, J->K, row)
        }
        for (int64_t r = 0; r < M; r++) y[r * ys + n - n0] = out[r];
    }
}

/* y[M <= TF_MAX_ROWS, N] = x @ W^T for a Q4_K or Q6_K W against int8 activation blocks of 256 (tf_qdot's
 * K-quant path; tf_qdot passes at most TF_MAX_ROWS rows at a time). */
void tf_kint8(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type) {
    const int64_t nsb = K / 256;
    const size_t nq = TF_UP64((size_t)(M * K)), nd = TF_UP64((size_t)(M * nsb) * sizeof(float));
    const size_t nb = TF_UP64((size_t)(M * nsb * 16) * sizeof(int16_t)), ns = TF_UP64((size_t)(M * nsb * 8) * sizeof(float));
    char *buf = (char *)tf_scratch(nq + nd + nb + ns);
    int8_t *xq = (int8_t *)buf;
    float *dx = (float *)(buf + nq), *xs = (float *)(buf + nq + nd + nb);
    int16_t *bs = (int16_t *)(buf + nq + nd);
    for (int64_t r = 0; r < M; r++)
        tf_q8k_prep(x + r * K, K, xq + r * K, dx + r * nsb, bs + r * nsb * 16, xs + r * nsb * 8);
    const tf_kint8_job job = {raw, xq, dx, xs, bs, M, K, type};
    tf_cols(tf_kint8_cols, &job, sizeof job, M, N, y);
}

typedef struct {
    const uint8_t *raw;
    const int16_t *xp;
    const float *dx, *xs;
    int64_t M, K, type;
} tf_kint_job;

static void tf_kint_cols(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys) {
    const tf_kint_job *J = (const tf_kint_job *)job;
    const int64_t M = J->M, row_bytes = J->type == TF_Q4_0 ? J->K / 32 * 18 : J->K / 256 * tf_kquant_block_bytes(J->type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = J->raw + n * row_bytes;
        float out[TF_MAX_ROWS];
        if (J->type == TF_Q4_K) {
            TF_ROWS_SWITCH(TF_Q4K_ROW, out, J->xp, J->dx, J->xs, J->K, row)
        } else if (J->type == TF_Q4_0) {
            TF_ROWS_SWITCH(tf_q40_row, out, J->xp, J->dx, J->xs, J->K, row)
        } else {
            TF_ROWS_SWITCH(tf_q6k_row, out, J->xp, J->dx, J->xs, J->K, row)
        }
        for (int64_t r = 0; r < M; r++) y[r * ys + n - n0] = out[r];
    }
}

/* y[M <= TF_MAX_ROWS, N] = x @ W^T for a Q4_0, Q4_K or Q6_K W, in integers, on the decode GEMMs' pool
 * (tf_cols). Q4_0's rows of activations (tf_q40_prep) are padded to whole pairs of blocks. */
static void tf_kint(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type) {
    const int64_t nb = K / 32, np = (nb + 1) / 2;
    const size_t nxq = (size_t)(M * np * 64) * sizeof(int16_t), nf = (size_t)(M * np * 8) * sizeof(float);
    /* this thread's scratch (tf_scratch) */
    char *buf = (char *)tf_scratch(2 * TF_UP64(nxq) + 2 * TF_UP64(nf));
    int16_t *xq = (int16_t *)buf, *xp = (int16_t *)(buf + TF_UP64(nxq));
    float *dx = (float *)(buf + 2 * TF_UP64(nxq)), *xs = (float *)(buf + 2 * TF_UP64(nxq) + TF_UP64(nf));
    for (int64_t r = 0; r < M; r++) {
        if (type == TF_Q4_0)      /* xs holds the paired scales (dx8) */
            tf_q40_prep(x + r * K, K, xq + r * K, dx + r * nb, xp + r * np * 64, xs + r * np * 8);
        else
            tf_kint_prep(x + r * K, K, xq + r * K, dx + r * nb, xp + r * K, xs + r * nb);
    }
    const tf_kint_job job = {raw, xp, type == TF_Q4_0 ? xs : dx, xs, M, K, type};
    tf_cols(tf_kint_cols, &job, sizeof job, M, N, y);
}
#endif

/* y[M, N] = x[M, K] @ W^T for a K-quant W [N, K / 256 super-blocks] or a Q4_0 W [N, K / 32 blocks]; 8
 * activation rows per pass. */
void tf_kgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type) {
    if (M > TF_MAX_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_kgemm(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, raw, type);
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    if (type == TF_Q4_0 || type == TF_Q4_K || type == TF_Q6_K) {
        tf_kint(y, x, M, K, N, raw, type);
        return;
    }
#endif
    if (type == TF_Q4_0) {      /* builds without AVX2: each block decoded to floats */
#pragma omp parallel for schedule(static) if (N >= 64)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = raw + n * (K / 32) * 18;
            for (int64_t r = 0; r < M; r++) {
                float acc = 0.f;
                for (int64_t b = 0; b < K / 32; b++) {
                    const float d = tf_f16(row + b * 18);
                    const uint8_t *qs = row + b * 18 + 2;
                    const float *xb = x + r * K + b * 32;
                    float part = 0.f;
                    for (int j = 0; j < 16; j++)
                        part += (float)((qs[j] & 15) - 8) * xb[j] + (float)((qs[j] >> 4) - 8) * xb[j + 16];
                    acc += d * part;
                }
                y[r * N + n] = acc;
            }
        }
        return;
    }
    const int64_t bb = tf_kquant_block_bytes(type), nsb = K / 256;
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = raw + n * nsb * bb;
        float acc[TF_MAX_ROWS] = {0};
#if defined(__AVX2__) && defined(__FMA__)
        switch (M) {
            case 1: tf_kgemm_row(1, acc, x, K, row, type, bb); break;
            case 2: tf_kgemm_row(2, acc, x, K, row, type, bb); break;
            case 3: tf_kgemm_row(3, acc, x, K, row, type, bb); break;
            case 4: tf_kgemm_row(4, acc, x, K, row, type, bb); break;
            case 5: tf_kgemm_row(5, acc, x, K, row, type, bb); break;
            case 6: tf_kgemm_row(6, acc, x, K, row, type, bb); break;
            case 7: tf_kgemm_row(7, acc, x, K, row, type, bb); break;
            default: tf_kgemm_row(8, acc, x, K, row, type, bb); break;
        }
#else
        float w[256] __attribute__((aligned(32)));
        for (int64_t s = 0; s < nsb; s++) {
            tf_kdecode(row + s * bb, type, w);
            for (int64_t r = 0; r < M; r++) acc[r] += tf_dot256(w, x + r * K + s * 256);
        }
#endif
        for (int64_t r = 0; r < M; r++) y[r * N + n] = acc[r];
    }
}
