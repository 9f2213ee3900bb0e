/* ---------------------------------------------------------------------------------------------------------
 * tf_qmadd: big batches and prefill chunks (17+ rows) on tf_qgemm's own layout, without AMX or VNNI (kernel
 * "qmadd", tokenfab/quant/kernels.py); GGUF's Q4_K super-blocks too (bits TF_Q4_K: each sub-block of 32
 * expands as an int4 block with scale d * sc and offset -dmin * mn) and Q4_0's blocks (bits TF_Q4_0: scale
 * d, offset -8 d). tf_qgemm puts a block's 32 inputs in the lanes, so every row and
 * output pays a convert, a scale broadcast and an FMA per block and a horizontal sum at the end: ~3.5
 * cycles per block and row, about what a float32 FMA GEMM costs, so above 16 rows the table took the
 * 4-byte float copy. Here the lanes are outputs: each thread expands its outputs' weights, 16 at a time,
 * into int16 pairs [block][input pair][output] once per call (with their scales), and every row's block is
 * then 16 vpmaddwd + vpaddd per 8 outputs against two activations broadcast per instruction (16 MACs per
 * instruction against an FMA's 8; on Zen 3 one thread ran 40 GMAC/s against MKL's float32 35, and the
 * weights stream at their quantized size), then one convert and one FMA per 8 outputs.
 * Numerics: the activations are quantized as tf_qgemm quantizes them (int16 per block of 32, scale
 * max|x| / 32767), so every block's integer dot is the same exact integer; y[r, n] = fma over blocks b in
 * order: acc = fma((float)D, fl(s[n, b] * dx[r, b]), acc), then (int4) acc = fma(m[n, g], xs[r, g], acc)
 * over groups g in order (tf_qtile's float steps). A row's result depends on that row alone; it differs
 * from tf_qgemm's (lanes summed in another order) in the last bits. N a multiple of 16.
 * GGUF's Q6_K (bits TF_Q6_K) runs as stored too: a block of 32 expands to its codes minus 32 (int16), and
 * its two sub-blocks of 16 keep their own scales d * sc (exact in float32), so a tile sums each half's 8
 * input pairs apart and takes one convert and one FMA per half (the codes times an int16 activation stay
 * exact in int32 either way; folding sc into the codes instead could overflow a block's sum). Without it,
 * Q6_K's big batches took float copies: 1.1 GB of them on a Llama-3.2-1B-shaped Q4_K_M file. */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#define TF_QMADD_ROWS 4         /* activation rows per register tile (8 int32 sums: 16 outputs x 4 rows) */
#define TF_QMADD_BLOCK 196608   /* bytes of expanded weights a thread keeps in L2 while every row group runs them */

/* An 8 x 8 transpose of dwords: r[i] holds output i's 8 input pairs, r[p] then holds pair p of 8 outputs. */
static inline __attribute__((always_inline)) void tf_transpose8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int p = 0; p < 4; p++) {
        r[p] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x20);
        r[p + 4] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x31);
    }
}

/* Outputs n0 .. n0 + 16 np - 1 expanded for tf_qmadd_tile: per 16 outputs, per block, 16 input pairs of
 * two 8-output halves (int16 [2][8][2] each: 1 KB), then per block the 16 scales, then (int4) per group the
 * 16 offsets. `stride` int16 per 16 outputs. */
/* Block b of a Q4_K row (sub-block b % 8 of super-block b / 8) as tf_load_weights gives an int4 block:
 * w[0] weights 0..15, w[1] 16..31, widened to int16. */
static inline __attribute__((always_inline)) void tf_load_q4k(const uint8_t *row, int64_t b, __m256i w[2]) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const uint8_t *qs = row + (b >> 3) * 144 + 16 + ((b & 7) >> 1) * 32;
    const int shift = 4 * (int)(b & 1);
    const __m128i a = _mm_loadu_si128((const __m128i *)qs), c = _mm_loadu_si128((const __m128i *)(qs + 16));
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(a, shift), m4));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(c, shift), m4));
}

/* Block b of a Q6_K row (in super-block b / 8: half h = (b % 8) / 4, run j = b % 4, ggml's order as in
 * tf_kdecode) as codes - 32: w[0] weights 0..15, w[1] 16..31, int16. */
static inline __attribute__((always_inline)) void tf_load_q6k(const uint8_t *row, int64_t b, __m256i w[2]) {
    const uint8_t *blk = row + (b >> 3) * 210;
    const int h = (int)((b & 7) >> 2), j = (int)(b & 3);
    const uint8_t *ql = blk + h * 64 + (j & 1) * 32, *qh = blk + 128 + h * 32;
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3);
    const __m256i off = _mm256_set1_epi16(32);
    const __m128i lsh = _mm_cvtsi32_si128(4 * (j >> 1)), hsh = _mm_cvtsi32_si128(2 * j);
    for (int t = 0; t < 2; t++) {
        const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(ql + 16 * t)), lsh), m4);
        const __m128i u = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * t)), hsh), m2);
        w[t] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(l, _mm_slli_epi16(u, 4))), off);
    }
}

/* Scales per block of 32 and output: 1, or Q6_K's 2 (one per sub-block of 16). */
static inline int64_t tf_qmadd_subs(int64_t bits) { return bits == TF_Q6_K ? 2 : 1; }

static void tf_qmadd_expand(int16_t *buf, int64_t stride, const void *q, const float *d, const float *m,
                            int64_t n0, int64_t np, int64_t nb, int64_t G, int64_t bpg, int64_t bits) {
    const int64_t row_bytes = bits == TF_Q4_K ? nb / 8 * 144 : bits == TF_Q6_K ? nb / 8 * 210
                              : bits == TF_Q4_0 ? nb * 18 : bits == 4 ? nb * 16 : nb * 32;
    for (int64_t p = 0; p < np; p++) {
        int16_t *w = buf + p * stride;
        float *sc = (float *)(w + nb * 512), *mo = sc + nb * 16 * tf_qmadd_subs(bits);
        if (p + 1 < np)           /* the next unit's 16 weight rows, while this one expands (16 strided streams) */
            for (int64_t o = 0; o < 16; o++)
                for (int64_t l = 0; l < row_bytes; l += 64)
                    __builtin_prefetch((const uint8_t *)q + (n0 + 16 * (p + 1) + o) * row_bytes + l, 0, 3);
        for (int64_t b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {         /* outputs 8h .. 8h + 7 of these 16 */
                __m256i lo[8], hi[8];
                for (int o = 0; o < 8; o++) {
                    __m256i v[2];
                    const uint8_t *row = (const uint8_t *)q + (n0 + 16 * p + 8 * h + o) * row_bytes;
                    if (bits == TF_Q4_K)
                        tf_load_q4k(row, b, v);
                    else if (bits == TF_Q6_K)
                        tf_load_q6k(row, b, v);
                    else if (bits == TF_Q4_0)
                        tf_load_weights(row + b * 18 + 2, 0, 4, v);   /* block b's 16 code bytes */
                    else
                        tf_load_weights(row, b, bits, v);
                    lo[o] = v[0];                 /* input pairs 0..7 */
                    hi[o] = v[1];                 /* input pairs 8..15 */
                }
                tf_transpose8_epi32(lo);
                tf_transpose8_epi32(hi);
                for (int i = 0; i < 8; i++) {     /* pair i: [pair][half][8 outputs][2] */
                    _mm256_store_si256((__m256i *)(w + b * 512 + i * 32 + h * 16), lo[i]);
                    _mm256_store_si256((__m256i *)(w + b * 512 + (8 + i) * 32 + h * 16), hi[i]);
                }
            }
        if (bits == TF_Q4_K)      /* per sub-block: scale d * sc, offset -dmin * mn (both exact in float32) */
            for (int64_t o = 0; o < 16; o++) {
                const uint8_t *row = (const uint8_t *)q + (n0 + 16 * p + o) * row_bytes;
                for (int64_t s = 0; s < nb / 8; s++) {
                    const uint8_t *blk = row + s * 144;
                    uint8_t scl[8], mn[8];
                    tf_scale_min_k4(blk + 4, scl, mn);
                    const float dd = tf_f16(blk), dmin = tf_f16(blk + 2);
                    for (int j = 0; j < 8; j++) {
                        sc[(s * 8 + j) * 16 + o] = dd * (float)scl[j];
                        mo[(s * 8 + j) * 16 + o] = -(dmin * (float)mn[j]);
                    }
                }
            }
        else if (bits == TF_Q6_K)  /* per sub-block of 16: scale d * sc */
            for (int64_t o = 0; o < 16; o++) {
                const uint8_t *row = (const uint8_t *)q + (n0 + 16 * p + o) * row_bytes;
                for (int64_t s = 0; s < nb / 8; s++) {
                    const uint8_t *blk = row + s * 210;
                    const float dd = tf_f16(blk + 208);
                    for (int j = 0; j < 16; j++) sc[(s * 16 + j) * 16 + o] = dd * (float)((const int8_t *)(blk + 192))[j];
                }
            }
        else if (bits == TF_Q4_0)  /* per block: scale d, offset -8 d */
            for (int64_t o = 0; o < 16; o++) {
                const uint8_t *row = (const uint8_t *)q + (n0 + 16 * p + o) * row_bytes;
                for (int64_t b = 0; b < nb; b++) {
                    const float dd = tf_f16(row + b * 18);
                    sc[b * 16 + o] = dd;
                    mo[b * 16 + o] = -8.f * dd;
                }
            }
        else
        for (int64_t o = 0; o < 16; o++) {
            const float *dn = d + (n0 + 16 * p + o) * G;
            for (int64_t b = 0; b < nb; b++) sc[b * 16 + o] = dn[b / bpg];
            if (bits == 4)
                for (int64_t g = 0; g < G; g++) mo[g * 16 + o] = m[(n0 + 16 * p + o) * G + g];
        }
    }
}

/* y[r0 .. r0 + R - 1, 16 outputs] from one expanded 16-output unit w (see tf_qmadd_expand); S scales per
 * block (tf_qmadd_subs), each over 16 / S of its input pairs. */
static inline __attribute__((always_inline)) void tf_qmadd_tile(const int R, const int S, float *y, int64_t N,
                                                                const int16_t *w, const int16_t *xq, int64_t K,
                                                                const float *dx, const float *xs, int64_t nb,
                                                                int64_t G, int64_t bits) {
    const float *sc = (const float *)(w + nb * 512), *mo = sc + nb * 16 * S;
    __m256 acc[TF_QMADD_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *wb = w + b * 512, *xb = xq + b * 32;
        for (int t = 0; t < S; t++) {
            __m256i s[TF_QMADD_ROWS][2];
            for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            for (int i = t * 16 / S; i < (t + 1) * 16 / S; i++) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + i * 32));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + i * 32 + 16));
                for (int r = 0; r < R; r++) {
                    int32_t pair;
                    memcpy(&pair, xb + r * K + 2 * i, 4);
                    const __m256i xv = _mm256_set1_epi32(pair);
                    s[r][0] = tf_dpwssd(s[r][0], w0, xv);
                    s[r][1] = tf_dpwssd(s[r][1], w1, xv);
                }
            }
            const float *st = sc + (b * S + t) * 16;
            const __m256 s0 = _mm256_loadu_ps(st), s1 = _mm256_loadu_ps(st + 8);
            for (int r = 0; r < R; r++) {
                const __m256 f = _mm256_set1_ps(dx[r * nb + b]);
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(s0, f), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(s1, f), acc[r][1]);
            }
        }
    }
    if (bits == 4 || bits == TF_Q4_K || bits == TF_Q4_0)
        for (int64_t g = 0; g < G; g++) {
            const __m256 m0 = _mm256_loadu_ps(mo + g * 16), m1 = _mm256_loadu_ps(mo + g * 16 + 8);
            for (int r = 0; r < R; r++) {
                const __m256 f = _mm256_set1_ps(xs[r * G + g]);
                acc[r][0] = _mm256_fmadd_ps(m0, f, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(m1, f, acc[r][1]);
            }
        }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * N, acc[r][0]);
        _mm256_storeu_ps(y + r * N + 8, acc[r][1]);
    }
}
#endif

void tf_qmadd(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
#if defined(__AVX2__) && defined(__FMA__)
    if (bits == TF_Q4_K || bits == TF_Q4_0 || bits == TF_Q6_K) gs = 32;   /* the activation blocks; Q6_K has no offsets */
    const int64_t G = K / gs, nb = K / 32, bpg = gs / 32, units = N / 16,
                  offsets = bits == 4 || bits == TF_Q4_K || bits == TF_Q4_0;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t r = 0; r < M; r++) {     /* as tf_qgemm: the same integers, the same float sums of x */
        tf_quantize_blocks(x + r * K, K, xq + r * K, dx + r * nb);
        if (offsets)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
    }
    /* per 16 outputs: weights, scales, offsets; a multiple of 16 int16 keeps every unit 32-byte aligned */
    const int64_t S = tf_qmadd_subs(bits);
    const int64_t stride = (nb * 512 + (nb * 16 * S + (offsets ? G * 16 : 0)) * 2 + 15) / 16 * 16;
    int64_t per = TF_QMADD_BLOCK / (stride * 2);
    if (per < 1) per = 1;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t u0 = units * me / nth, u1 = units * (me + 1) / nth;
        const int64_t most = u1 - u0 < per ? u1 - u0 : per;
        int16_t *buf = most > 0 ? (int16_t *)aligned_alloc(64, (size_t)((most * stride * 2 + 63) / 64 * 64)) : NULL;
        for (int64_t c = u0; c < u1; c += per) {
            const int64_t np = u1 - c < per ? u1 - c : per;
            tf_qmadd_expand(buf, stride, q, d, m, 16 * c, np, nb, G, bpg, bits);
            for (int64_t r0 = 0; r0 < M; r0 += TF_QMADD_ROWS) {
                const int64_t R = M - r0 < TF_QMADD_ROWS ? M - r0 : TF_QMADD_ROWS;
                const int16_t *xr = xq + r0 * K;
                const float *dr = dx + r0 * nb, *sr = xs + r0 * G;
                for (int64_t p = 0; p < np; p++) {
                    float *yo = y + r0 * N + 16 * (c + p);
                    const int16_t *w = buf + p * stride;
                    if (S == 2)
                        switch (R) {
                            case 1: tf_qmadd_tile(1, 2, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            case 2: tf_qmadd_tile(2, 2, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            case 3: tf_qmadd_tile(3, 2, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            default: tf_qmadd_tile(4, 2, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                        }
                    else
                        switch (R) {
                            case 1: tf_qmadd_tile(1, 1, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            case 2: tf_qmadd_tile(2, 1, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            case 3: tf_qmadd_tile(3, 1, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                            default: tf_qmadd_tile(4, 1, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                        }
                }
            }
        }
        free(buf);
    }
    free(xq);
    free(dx);
    free(xs);
#else
    (void)y; (void)x; (void)M; (void)K; (void)N; (void)q; (void)d; (void)m; (void)gs; (void)bits;
#endif
}
