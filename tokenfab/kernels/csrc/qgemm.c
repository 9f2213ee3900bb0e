/* Quantized weights times activations for a few rows (decode): y[M, N] = x[M, K] @ W^T, 8 rows per
 * pass over W.
 * Each activation row is quantized to int16 in blocks of 32 (one float scale per block: max|x| /
 * 32767, a relative error near 2^-16, finer than bfloat16), so a block's dot product is an integer
 * one (AVX2 madd_epi16 on weights widened to 16 bits); W is read in its quantized form once for all M
 * rows. A row's result depends on that row alone (no batch effects). llama.cpp quantizes activations
 * to int8 here: that is tf_qdot (qdot.c), opt-in (KL 3.5e-3 against float on the bundled model, where
 * this kernel gives 3e-7).
 *   bits 4: q [N, K/2] bytes, in blocks of 32 weights = 16 bytes where byte j holds weight j in its
 *           low nibble and weight j + 16 in its high one (GGUF's order); w = q * d[n, k / gs] + m[n, k / gs]
 *           (the m term uses the float32 sums of x).
 *   bits 8: q [N, K] int8; w = q * d[n, k / gs]   (m unused).
 * gs is a multiple of 32; K a multiple of gs. */
#include "common.h"

void tf_quantize_blocks(const float *x, int64_t n, int16_t *xq, float *dx) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
#if defined(__AVX2__) && defined(__FMA__)
        /* the same arithmetic 8 lanes at a time: the scalar loop called libm's fmaxf per element, and
         * it runs serially before every tf_qgemm call (~100k activations a decode token) */
        const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();         /* max(a, mx) keeps mx where a is NaN, as fmaxf */
        for (int j = 0; j < 32; j += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + j), nosign), mx);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 32767.f, id = amax > 0.f ? 32767.f / amax : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int j = 0; j < 32; j += 16) {       /* round to nearest even, as lrintf */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), vid));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), vid));
            _mm256_storeu_si256((__m256i *)(xq + b * 32 + j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
#else
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 32767.f, id = amax > 0.f ? 32767.f / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int16_t)lrintf(xb[j] * id);
#endif
        dx[b] = d;
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* 8 partial sums of one block's integer dot product, as floats. */
static inline __attribute__((always_inline)) __m256 tf_block_dot(const __m256i w[2], const int16_t *xb) {
    const __m256i p = tf_dpwssd(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)xb)), w[1],
                                _mm256_loadu_si256((const __m256i *)(xb + 16)));
    return _mm256_cvtepi32_ps(p);
}

/* One output row for M activation rows; M is a compile-time constant at each call site, so the
 * accumulators live in registers; two per row (even / odd blocks) halve the FMA chain.
 * sb: the weight row's scale for each block of 32; dx: the activations' block scales [M, nb]. */
static inline __attribute__((always_inline)) void tf_qgemm_row(const int M, float *out, const int16_t *xq,
                                                              const float *dx, int64_t K, int64_t nb,
                                                              const void *q, const float *sb, int64_t bits) {
    __m256 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i w[2], v[2];
        tf_load_weights(q, b, bits, w);
        tf_load_weights(q, b + 1, bits, v);
        for (int r = 0; r < M; r++) {
            const __m256 s0 = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            const __m256 s1 = _mm256_set1_ps(sb[b + 1] * dx[r * nb + b + 1]);
            acc0[r] = _mm256_fmadd_ps(s0, tf_block_dot(w, xq + r * K + b * 32), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(s1, tf_block_dot(v, xq + r * K + (b + 1) * 32), acc1[r]);
        }
    }
    if (b < nb) {
        __m256i w[2];
        tf_load_weights(q, b, bits, w);
        for (int r = 0; r < M; r++) {
            const __m256 s0 = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            acc0[r] = _mm256_fmadd_ps(s0, tf_block_dot(w, xq + r * K + b * 32), acc0[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QGEMM512 1
/* A block's 32 weights widened to int16 in one register, lane j = weight j. */
static inline __attribute__((always_inline)) __m512i tf_load_weights512(const void *q, int64_t b, int64_t bits) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
        const __m128i mask = _mm_set1_epi8(0x0F);
        return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                                     _mm_and_si128(bytes, mask)));
    }
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * 32)));
}

/* tf_qgemm_row on AVX-512: three instructions per block and activation row (one 32-lane int16 dot
 * with the activation block as its memory operand, one convert, one FMA whose scale comes broadcast
 * from memory) instead of about eight, and the scales sb[b] * dx[r, b] multiplied 16 blocks at a time.
 * Per-call minima, 1 thread, the bundled model's int4 shapes streaming over 30 layers (2-core VM,
 * load ~8): the four linears of a layer 0.21 ms at 1 row (0.30 before) and 0.57 ms at 5 rows (0.83).
 * Each extra row still costs ~45 us per 3072 x 576 weight, before and after (with the weight in L2):
 * the int16 dot and the convert both issue on one port, ~2 cycles per block and row, so rows are
 * cheaper only by int8 activations (tf_qdot, lossy) or a tile unit (AMX), not by this loop.
 * Each row's arithmetic is the same whatever M is, so rows still have no batch effects. */
static inline __attribute__((always_inline)) void tf_qgemm_row512(const int M, float *out, const int16_t *xq,
                                                                 const float *dx, int64_t K, int64_t nb,
                                                                 const void *q, const float *sb, int64_t bits) {
    __m512 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    float sc[TF_MAX_ROWS][16] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const int n = nb - c < 16 ? (int)(nb - c) : 16;
        const __mmask16 mk = (__mmask16)((1u << n) - 1u);
        const __m512 s = _mm512_maskz_loadu_ps(mk, sb + c);
        for (int r = 0; r < M; r++) _mm512_store_ps(sc[r], _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, dx + r * nb + c)));
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const __m512i w = tf_load_weights512(q, c + j, bits), v = tf_load_weights512(q, c + j + 1, bits);
            const int16_t *xb = xq + (c + j) * 32;
            for (int r = 0; r < M; r++) {
                const __m512i p0 = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xb + r * K)));
                const __m512i p1 = _mm512_madd_epi16(v, _mm512_loadu_si512((const void *)(xb + r * K + 32)));
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(sc[r][j]), acc0[r]);
                acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_set1_ps(sc[r][j + 1]), acc1[r]);
            }
        }
        if (j < n) {
            const __m512i w = tf_load_weights512(q, c + j, bits);
            for (int r = 0; r < M; r++) {
                const __m512i p0 = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xq + r * K + (c + j) * 32)));
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(sc[r][j]), acc0[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(TF_QGEMM512)
#define TF_QGEMM4 1
/* tf_qgemm's int4 rows on AVX2 without AVX-512, two blocks per step. tf_qgemm_row widens each block's
 * nibbles with two vpmovzxbw (shuffles) and broadcasts a scale per block and row, ~14 instructions per
 * block: a 1-row decode step of the bundled model was compute-bound on the AMD EPYC (the linears took
 * 7.6 ms a token with the weights in cache, 8.4 ms streamed). Here one 32-byte load holds blocks b and
 * b + 1. Each 16-bit word j of a block holds weights 2j and 2j + 1 in its bytes' low nibbles and 2j + 16,
 * 2j + 17 in their high ones, so a mask, and a shift and a mask, give each of the four as an int16 lane
 * in place, for both blocks at once (word lanes 0-7: block b, 8-15: block b + 1). The activations are
 * laid out once per call to match (tf_qgemm4_prep: per pair of blocks, four 16-lane groups, the inputs
 * of weights 2j, 2j + 1, 2j + 16 and 2j + 17), so a pair costs 7 instructions of weight unpacking shared
 * by the rows and 4 vpmaddwd, 3 adds, a convert, a multiply and an FMA per row, none of them a
 * shuffle. The integer dot of every block is the same exact integer as tf_qgemm_row's; its float
 * partial sums are grouped by 8 products instead of 4, so results differ from that loop in the last
 * bits. Each row's arithmetic is the same whatever M is (rows go four at a time over the same weights),
 * so rows have no batch effects. */
static void tf_qgemm4_prep(const int16_t *xq, const float *dx, int64_t nb, int16_t *xp, float *dx8) {
    static const int off[4] = {0, 1, 16, 17};
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        int16_t *o = xp + b * 32;
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 8; j++) o[g * 16 + h * 8 + j] = xq[(b + h) * 32 + 2 * j + off[g]];
        for (int i = 0; i < 4; i++) {
            dx8[b * 4 + i] = dx[b];
            dx8[b * 4 + 4 + i] = dx[b + 1];
        }
    }
    if (b < nb) {       /* an odd last block keeps tf_qgemm_row's order and its one scale */
        memcpy(xp + b * 32, xq + b * 32, 32 * sizeof(int16_t));
        dx8[b * 4] = dx[b];
    }
}

/* Blocks b and b + 1 of an int4 row: the four int16 vectors of their weights in tf_qgemm4_prep's order. */
static inline __attribute__((always_inline)) void tf_qgemm4_unpack(const uint8_t *q, int64_t b, __m256i w[4]) {
    const __m256i lo = _mm256_set1_epi16(0x000F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * 16));
    w[0] = _mm256_and_si256(v, lo), w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), lo);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), w[3] = _mm256_srli_epi16(v, 12);
}

/* The pair's two weight scales, block b's in lanes 0-3 and block b + 1's in lanes 4-7. */
static inline __attribute__((always_inline)) __m256 tf_qgemm4_scales(const float *sb, int64_t b) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sb + b)), _mm_broadcast_ss(sb + b + 1), 1);
}

/* The pair's integer dots (lanes 0-3: block b, 4-7: block b + 1) against activation vectors x[0..3]. */
static inline __attribute__((always_inline)) __m256i tf_qgemm4_dot(const __m256i w[4], const __m256i x[4]) {
    return _mm256_add_epi32(tf_dpwssd(_mm256_madd_epi16(w[0], x[0]), w[1], x[1]),
                            tf_dpwssd(_mm256_madd_epi16(w[2], x[2]), w[3], x[3]));
}

/* Blocks b and b + 1 of one weight row against M activation rows (laid out by tf_qgemm4_prep). */
static inline __attribute__((always_inline)) void tf_qgemm4_pair(const int M, __m256 *acc, const uint8_t *q,
                                                                const float *sb, const int16_t *xp,
                                                                const float *dx8, int64_t K, int64_t nb,
                                                                int64_t b) {
    __m256i w[4];
    tf_qgemm4_unpack(q, b, w);
    const __m256 s = tf_qgemm4_scales(sb, b);
    for (int r = 0; r < M; r++) {
        const __m256i *xr = (const __m256i *)(xp + r * K + b * 32);
        const __m256i x[4] = {_mm256_loadu_si256(xr), _mm256_loadu_si256(xr + 1), _mm256_loadu_si256(xr + 2),
                              _mm256_loadu_si256(xr + 3)};
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tf_qgemm4_dot(w, x)),
                                 _mm256_mul_ps(s, _mm256_loadu_ps(dx8 + r * nb * 4 + b * 4)), acc[r]);
    }
}

/* The Q4_1 offsets' term, sum over groups of m[g] * xs[g], folded into a row's accumulator before its
 * horizontal sum (8 groups per FMA, the last few by a masked load, whose zero lanes add 0 * 0). */
static inline __attribute__((always_inline)) __m256 tf_fold_offsets(__m256 acc, const float *m, const float *xs,
                                                                   int64_t G) {
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xs + g), acc);
    if (g < G) {
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(G - g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(m + g, k), _mm256_maskload_ps(xs + g, k), acc);
    }
    return acc;
}

/* The odd last block of a row (nb odd), in tf_qgemm_row's order and with its one scale. */
static inline __attribute__((always_inline)) __m256 tf_qgemm4_last(__m256 acc, const uint8_t *q, const float *sb,
                                                                  const int16_t *xp, const float *dx8, int64_t b) {
    __m256i w[2];
    tf_load_weights(q, b, 4, w);
    return _mm256_fmadd_ps(_mm256_set1_ps(sb[b] * dx8[b * 4]), tf_block_dot(w, xp + b * 32), acc);
}

/* One int4 weight row for M <= 4 activation rows: one accumulator chain per row, over the pairs in
 * order, then the offsets' term (m: NULL for none) and one horizontal sum. tf_qgemm4_rows4 gives every
 * row these same operations in this order, so results do not depend on M or on which loop ran them. */
static inline __attribute__((always_inline)) void tf_qgemm4_row(const int M, float *out, const int16_t *xp,
                                                               const float *dx8, int64_t K, int64_t nb,
                                                               const uint8_t *q, const float *sb, const float *m,
                                                               const float *xs, int64_t G) {
    __m256 acc[4];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) tf_qgemm4_pair(M, acc, q, sb, xp, dx8, K, nb, b);
    for (int r = 0; r < M; r++) {
        if (b < nb) acc[r] = tf_qgemm4_last(acc[r], q, sb, xp + r * K, dx8 + r * nb * 4, b);
        if (m) acc[r] = tf_fold_offsets(acc[r], m, xs + r * G, G);
        out[r] = tf_hsum(acc[r]);
    }
}

/* Four int4 weight rows (q, sb, m: the first one's; the rest follow at row_bytes, G and G) against one
 * activation row: a decode step's linears. Per pair of blocks the four activation vectors and their
 * scales are loaded once for the four rows, and the per-row work after the loop (the offsets' term,
 * the horizontal sum) is a quarter of the loop's instead of most of it for the 18 blocks of a 576-wide
 * row. Each row's arithmetic is tf_qgemm4_row's. */
static inline __attribute__((always_inline)) void tf_qgemm4_rows4(float *out, const int16_t *xp, const float *dx8,
                                                                 int64_t nb, const uint8_t *q, int64_t row_bytes,
                                                                 const float *sb, const float *m, const float *xs,
                                                                 int64_t G) {
    __m256 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i *xr = (const __m256i *)(xp + b * 32);
        const __m256i x[4] = {_mm256_loadu_si256(xr), _mm256_loadu_si256(xr + 1), _mm256_loadu_si256(xr + 2),
                              _mm256_loadu_si256(xr + 3)};
        const __m256 dxv = _mm256_loadu_ps(dx8 + b * 4);
        for (int i = 0; i < 4; i++) {
            __m256i w[4];
            tf_qgemm4_unpack(q + i * row_bytes, b, w);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tf_qgemm4_dot(w, x)),
                                     _mm256_mul_ps(tf_qgemm4_scales(sb + i * G, b), dxv), acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        if (b < nb) acc[i] = tf_qgemm4_last(acc[i], q + i * row_bytes, sb + i * G, xp, dx8, b);
        if (m) acc[i] = tf_fold_offsets(acc[i], m + i * G, xs, G);
        out[i] = tf_hsum(acc[i]);
    }
}
#endif

/* tf_qgemm's outputs n0..n1-1 for every row, into y[r * ys + n - n0]. */
typedef struct {
    const void *q;
    const float *d, *m, *dx, *xs, *dx8;
    const int16_t *xq, *xp;
    int64_t M, K, N, G, nb, bpg, row_bytes, bits;
} tf_qgemm_job;

static void tf_qgemm_cols(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys) {
    const tf_qgemm_job *J = (const tf_qgemm_job *)job;
    const void *q = J->q;
    const float *d = J->d, *m = J->m, *dx = J->dx, *xs = J->xs;
    const int16_t *xq = J->xq;
    const int64_t M = J->M, K = J->K, G = J->G, nb = J->nb, bpg = J->bpg, row_bytes = J->row_bytes, bits = J->bits;
#ifdef TF_QGEMM4
    const int16_t *xp = J->xp;
    const float *dx8 = J->dx8;
    const int folded = xp != NULL;      /* tf_qgemm4_row(s4) fold the offsets' term into each row's sum */
#else
    const int folded = 0;
#endif
    (void)xq;
    int64_t n = n0;
#ifdef TF_QGEMM4
    if (xp && M == 1 && bpg == 1)    /* one activation row: four weight rows at a time */
        for (; n + 4 <= n1; n += 4) {
            const uint8_t *qn = (const uint8_t *)q + n * row_bytes;
            for (int64_t l = 0; l < 4 * row_bytes; l += 64) __builtin_prefetch(qn + 8 * row_bytes + l, 0, 3);
            for (int64_t l = 0; l < 4 * G; l += 16) {
                __builtin_prefetch(d + (n + 8) * G + l, 0, 3);
                if (m) __builtin_prefetch(m + (n + 8) * G + l, 0, 3);
            }
            float out[4];
            tf_qgemm4_rows4(out, xp, dx8, nb, qn, row_bytes, d + n * G, m ? m + n * G : NULL, xs, G);
            for (int i = 0; i < 4; i++) y[n + i - n0] = out[i];
        }
#endif
    for (; n < n1; n++) {
        const float *dn = d + n * G;
        const void *qn = (const uint8_t *)q + n * row_bytes;
        float out[TF_MAX_ROWS];
        /* 4 rows ahead: the three streams (blocks, scales, offsets) of short rows did not keep the hardware
         * prefetchers ahead (1 row streamed at ~60 % of a streaming read's bandwidth) */
        for (int64_t l = 0; l < row_bytes; l += 64) __builtin_prefetch((const char *)qn + 4 * row_bytes + l, 0, 3);
        __builtin_prefetch(dn + 4 * G, 0, 3);
        if (m) __builtin_prefetch(m + (n + 4) * G, 0, 3);
        float sbuf[bpg == 1 ? 1 : nb];
        const float *sb = tf_block_scales(dn, G, bpg, sbuf);
#if defined(__AVX2__) && defined(__FMA__)
#ifdef TF_QGEMM512
        TF_ROWS_SWITCH(tf_qgemm_row512, out, xq, dx, K, nb, qn, sb, bits)
#else
        if (xp) {
            for (int r0 = 0; r0 < M; r0 += 4)
                switch (M - r0) {
#define TF_Q4ROW(R) tf_qgemm4_row(R, out + r0, xp + r0 * K, dx8 + r0 * nb * 4, K, nb, (const uint8_t *)qn, sb, \
                                  m ? m + n * G : NULL, xs + r0 * G, G)
                    case 1: TF_Q4ROW(1); break;
                    case 2: TF_Q4ROW(2); break;
                    case 3: TF_Q4ROW(3); break;
                    default: TF_Q4ROW(4); break;
#undef TF_Q4ROW
                }
        } else
        switch (M) {
            case 1: tf_qgemm_row(1, out, xq, dx, K, nb, qn, sb, bits); break;
            case 2: tf_qgemm_row(2, out, xq, dx, K, nb, qn, sb, bits); break;
            case 3: tf_qgemm_row(3, out, xq, dx, K, nb, qn, sb, bits); break;
            case 4: tf_qgemm_row(4, out, xq, dx, K, nb, qn, sb, bits); break;
            case 5: tf_qgemm_row(5, out, xq, dx, K, nb, qn, sb, bits); break;
            case 6: tf_qgemm_row(6, out, xq, dx, K, nb, qn, sb, bits); break;
            case 7: tf_qgemm_row(7, out, xq, dx, K, nb, qn, sb, bits); break;
            default: tf_qgemm_row(8, out, xq, dx, K, nb, qn, sb, bits); break;
        }
#endif
#else
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) {
                    const int wq = bits == 4 ? (((const uint8_t *)qn)[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0x0F
                                             : ((const int8_t *)qn)[b * 32 + j];
                    dot += wq * xq[r * K + b * 32 + j];
                }
                acc += sb[b] * dx[r * nb + b] * (float)dot;
            }
            out[r] = acc;
        }
#endif
        if (bits == 4 && !folded)
            for (int64_t r = 0; r < M; r++) out[r] += tf_dot_f32(m + n * G, xs + r * G, G);
        for (int64_t r = 0; r < M; r++) y[r * ys + n - n0] = out[r];
    }
}

void tf_qgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
    if (bits & TF_QTILE) {               /* a qtile layout (below) */
        tf_qtile(y, x, M, K, N, q, d, m, gs, bits & ~TF_QTILE);
        return;
    }
    if (bits & TF_QDOT) {                /* a qdot layout (the one-call decode stack takes either kernel) */
        tf_qdot(y, x, M, K, N, q, d, m, gs, bits & ~TF_QDOT);
        return;
    }
    if (bits == TF_Q4_0 || tf_kquant_block_bytes(bits)) {   /* GGUF blocks as stored: bits is ggml's type id */
        tf_kgemm(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
    if (M > TF_MAX_ROWS) {   /* the register tile holds 8 rows: more rows, more passes over W */
        const int off = tf_pool_off;
        tf_pool_off = off || M > TF_POOL_MAX_ROWS;
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_qgemm(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, q, d, m, gs, bits);
        tf_pool_off = off;
        return;
    }
    const int64_t G = K / gs, nb = K / 32, bpg = gs / 32;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    /* the activations' copies live in this thread's scratch (tf_scratch) */
    const size_t nxq = (size_t)(M * K) * sizeof(int16_t), ndx = (size_t)(M * nb) * sizeof(float);
    char *buf = (char *)tf_scratch(2 * nxq + 5 * ndx + (size_t)(M * G + 1) * sizeof(float) + 4 * 64);
    int16_t *xq = (int16_t *)buf;
    float *dx = (float *)(buf + TF_UP64(nxq));
    float *xs = (float *)(buf + TF_UP64(nxq) + TF_UP64(ndx));     /* float sums of x per group */
    memset(xs, 0, (size_t)(M * G + 1) * sizeof(float));
    for (int64_t r = 0; r < M; r++) {
        tf_quantize_blocks(x + r * K, K, xq + r * K, dx + r * nb);
        if (bits == 4)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
    }
#ifdef TF_QGEMM4
    int16_t *xp = NULL;      /* int4 on AVX2: the activations in tf_qgemm4_pair's order */
    float *dx8 = NULL;
    if (bits == 4) {
        xp = (int16_t *)((char *)xs + TF_UP64((size_t)(M * G + 1) * sizeof(float)));
        dx8 = (float *)((char *)xp + TF_UP64(nxq));
        for (int64_t r = 0; r < M; r++) tf_qgemm4_prep(xq + r * K, dx + r * nb, nb, xp + r * K, dx8 + r * nb * 4);
    }
#endif
    const tf_qgemm_job job = {q, d, m, dx, xs,
#ifdef TF_QGEMM4
                              dx8, xq, xp,
#else
                              NULL, xq, NULL,
#endif
                              M, K, N, G, nb, bpg, row_bytes, bits};
    tf_cols(tf_qgemm_cols, &job, sizeof job, M, N, y);
}
