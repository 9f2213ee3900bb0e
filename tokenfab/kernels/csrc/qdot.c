/* ---------------------------------------------------------------------------------------------------------
 * Integer dot products with int8 activations: llama.cpp's approach, a measured option (kernel "qdot").
 * Each activation row is quantized to int8 in blocks of 32 with its own scale (max|x| / 127) and every
 * block's dot product with the stored weights is one u8 x s8 instruction sequence: `vpdpbusd` where the
 * build has AVX512-VNNI (+VL) or AVX-VNNI, else AVX2's maddubs + madd (no saturation: |w| <= 128 and
 * |x| <= 127, so a pair stays below 32767). Weight formats, as stored:
 *   bits 4 (int4 / Q4_0 / Q4_1 groups): nibbles are the unsigned operand, plus m times the sums of x~
 *   bits 8 (int8 / Q8_0): signed weights; |w| is the unsigned operand and w's sign moves onto x
 *   Q4_K (12), Q6_K (14): as llama.cpp, against int8 blocks of 256 with one scale each (tf_kint8, kquant.c)
 * Other K-quants fall back to tf_kgemm. The activations' rounding (relative error ~2^-8 per block) is
 * what this costs against tf_qgemm's int16 blocks; `tokenfab quant eval --kernel qdot` measures it. */
#include "common.h"

/* What this build compiled for: 1 AVX2+FMA, 2 AVX-512 F/BW/VL, 4 AVX512-VNNI, 8 AVX-VNNI (a bit mask). */
int64_t tf_isa(void) {
    int64_t f = 0;
#if defined(__AVX2__) && defined(__FMA__)
    f |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    f |= 2;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    f |= 4;
#endif
#if defined(__AVXVNNI__)
    f |= 8;
#endif
    return f;
}

/* x [n] -> int8 blocks of 32 and their scales; xs16: sums per 16 of the rounded x (NULL: not needed).
 * Offsets (int4's m) then multiply the same rounded x as the integer dot does,
 * so the result is exactly W . x~ (x~ the rounded activations): float sums of x measured twice the
 * error on random int4 weights, as the large unsigned q . x~ and the offset no longer cancel. */
static void tf_quantize_i8(const float *x, int64_t n, int8_t *xq, float *dx, float *xs16) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int8_t)lrintf(xb[j] * id);
        dx[b] = amax / 127.f;
        if (xs16) {        /* sums of the *rounded* x, so offsets see the same x as the integer dot */
            int32_t s0 = 0, s1 = 0;
            for (int j = 0; j < 16; j++) {
                s0 += xq[b * 32 + j];
                s1 += xq[b * 32 + j + 16];
            }
            xs16[2 * b] = dx[b] * (float)s0;
            xs16[2 * b + 1] = dx[b] * (float)s1;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* acc + the 8 lane sums of u8 x s8 products (lane i: bytes 4i..4i+3). */
static inline __attribute__((always_inline)) __m256i tf_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QDOT512 1
/* The 16 lane sums of u8 x s8 products over 64 bytes (two blocks of 32: lanes 0-7 the first). */
static inline __attribute__((always_inline)) __m512i tf_dpbusd512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* Two scales: lanes 0-7 a, 8-15 b. */
static inline __attribute__((always_inline)) __m512 tf_scale2(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
#endif

/* One output row of an int4 / int8 weight for M activation rows (M a constant at each call site).
 * AVX-512 builds take two blocks per instruction (one 64-byte dot product, one 16-lane FMA). */
static inline __attribute__((always_inline)) void tf_qdot_row(const int M, float *out, const int8_t *xq,
                                                             const float *dx, const float *dx16, int64_t K,
                                                             int64_t nb, const void *q, const float *sb,
                                                             int64_t bits) {
    int64_t b = 0;
    float tail[TF_MAX_ROWS] = {0};
#ifdef TF_QDOT512
    {
        __m512 acc[TF_MAX_ROWS];
        for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (; b + 2 <= nb; b += 2) {
            __m512i u, w = _mm512_setzero_si512();
            if (bits == 4) {      /* 32 bytes: blocks b, b+1; each block's low nibbles then high ones */
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const uint8_t *)q + b * 16));
                const __m256i lo = _mm256_and_si256(bytes, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
                const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   /* lo0 lo1 hi0 hi1 */
                u = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                  /* lo0 hi0 lo1 hi1 */
            } else {
                w = _mm512_loadu_si512((const void *)((const int8_t *)q + b * 32));
                u = _mm512_abs_epi8(w);
            }
            /* int8: w's sign moves onto x (x * sign(w); x == 0 where w == 0 does not matter) */
            const __mmask64 neg = bits == 4 ? 0 : _mm512_movepi8_mask(w);
            const __m512 wsc = tf_scale2(sb[b], sb[b + 1]);
            for (int r = 0; r < M; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + b * 32));
                if (bits != 4) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                const __m512 sc = _mm512_mul_ps(wsc, _mm512_loadu_ps(dx16 + (r * nb + b) * 8));
                acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(tf_dpbusd512(u, xv)), acc[r]);
            }
        }
        for (int r = 0; r < M; r++) tail[r] = _mm512_reduce_add_ps(acc[r]);
    }
#endif
    __m256 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256(), mask = _mm256_set1_epi8(0x0F);
    for (; b < nb; b++) {
        __m256i u, w = zero;
        if (bits == 4) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
            u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), mask);
        } else {
            w = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * 32));
            u = _mm256_abs_epi8(w);
        }
        for (int r = 0; r < M; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32));
            if (bits != 4) xv = _mm256_sign_epi8(xv, w);
            const __m256 s = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            const __m256 dot = _mm256_cvtepi32_ps(tf_dpbusd(zero, u, xv));
            if (b & 1) acc1[r] = _mm256_fmadd_ps(s, dot, acc1[r]);
            else acc0[r] = _mm256_fmadd_ps(s, dot, acc0[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tail[r] + tf_hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

#endif

#if !(defined(__AVX2__) && defined(__FMA__))
/* Plain C for builds without AVX2: the same arithmetic, one weight at a time. */
static float tf_qdot_scalar_w(const void *q, int64_t bits, int64_t b, int j) {
    return bits == 4 ? (float)((((const uint8_t *)q)[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0x0F)
                     : (float)((const int8_t *)q)[b * 32 + j];
}
#endif

/* y[M, N] = x[M, K] @ W^T with int8 activation blocks (layouts as tf_qgemm's). */
void tf_qdot(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
             const float *m, int64_t gs, int64_t bits) {
    if (M > TF_MAX_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_qdot(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, q, d, m, gs, bits);
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    if (bits == TF_Q4_K || bits == TF_Q6_K) {     /* against int8 blocks of 256 (kquant.c) */
        tf_kint8(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
#endif
    if (tf_kquant_block_bytes(bits)) {      /* other K-quants, and any without AVX2: float activations */
        tf_kgemm(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
    const int64_t nb = K / 32;
    const int64_t G = K / gs, bpg = gs / 32;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs16 = (float *)malloc(sizeof(float) * (size_t)(M * (K / 16)));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));   /* sums of x~ per group (int4's m) */
    /* each activation scale repeated over its block's 8 lanes: the AVX-512 row loads two blocks' at once */
    float *dx16 = (float *)malloc(sizeof(float) * (size_t)(M * nb * 8));
    for (int64_t r = 0; r < M; r++) {
        tf_quantize_i8(x + r * K, K, xq + r * K, dx + r * nb, xs16 + r * (K / 16));
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 8; j++) dx16[(r * nb + b) * 8 + j] = dx[r * nb + b];
        if (bits == 4)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs / 16; k < (g + 1) * gs / 16; k++) xs[r * G + g] += xs16[r * (K / 16) + k];
    }
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; n++) {
        const void *qn = (const uint8_t *)q + n * row_bytes;
        float out[TF_MAX_ROWS];
        const float *dn = d + n * G;
        float sbuf[bpg == 1 ? 1 : nb];
        const float *sb = tf_block_scales(dn, G, bpg, sbuf);
#if defined(__AVX2__) && defined(__FMA__)
        TF_ROWS_SWITCH(tf_qdot_row, out, xq, dx, dx16, K, nb, qn, sb, bits)
#else
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += (int32_t)tf_qdot_scalar_w(qn, bits, b, j) * xq[r * K + b * 32 + j];
                acc += sb[b] * dx[r * nb + b] * (float)dot;
            }
            out[r] = acc;
        }
#endif
        if (bits == 4)
            for (int64_t r = 0; r < M; r++) out[r] += tf_dot_f32(m + n * G, xs + r * G, G);
        for (int64_t r = 0; r < M; r++) y[r * N + n] = out[r];
    }
    free(xq);
    free(dx);
    free(xs16);
    free(xs);
    free(dx16);
}
