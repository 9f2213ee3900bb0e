/* Decode attention straight from the paged KV pools: tf_decode_attention_window (the plain kernel, and the
 * reference the benchmark measures against) and tf_paged_decode_attention / _f16 (float32 / float16 pools). */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
/* One softmax row in place: p[j] = exp(p[j] - max) for j < L; returns 1 / sum. */
static inline float tf_softmax_row(float *pg, int64_t L) {
    float m = -INFINITY, sum;
    int64_t j = 0;
    if (L >= 8) {       /* 8 running maxima: a scalar max is a 4-cycle dependency chain per score */
        __m256 vmax = _mm256_loadu_ps(pg);
        for (j = 8; j + 8 <= L; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(pg + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; j < L; j++) m = pg[j] > m ? pg[j] : m;
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= L; j += 8) {
        const __m256 e = tf_exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + j), vm));
        _mm256_storeu_ps(pg + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = tf_hsum(vsum);
    for (; j < L; j++) {
        pg[j] = expf(pg[j] - m);
        sum += pg[j];
    }
    return 1.f / sum;
}

/* The G query heads that share kv head kh, against one sequence's keys and values (head_dim a
 * multiple of 64). Scores 4 keys at a time for every head while those rows are in L1 (horizontal adds
 * instead of one reduction per key), the vector exp, then P V per head with the output held in
 * registers 64 dims at a time (V rows come from memory for the first head, from cache after).
 * qg: the G heads' queries, D apart; o: their outputs, D apart; p: scratch of G * L floats. */
static void tf_attend_group64(float *o, const float *qg, int64_t G, const float *k_cache, const float *v_cache,
                              const int64_t *bt, int64_t L, int64_t bs, int64_t KVH, int64_t kh, int64_t D,
                              float scale, float *p, int64_t j0) {
#define TF_ROW(cache, j) ((cache) + ((bt[((j) + j0) / bs] * bs + ((j) + j0) % bs) * KVH + kh) * D)
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const float *k0 = TF_ROW(k_cache, j), *k1 = TF_ROW(k_cache, j + 1);
        const float *k2 = TF_ROW(k_cache, j + 2), *k3 = TF_ROW(k_cache, j + 3);
        for (int64_t g = 0; g < G; g++) {
            const float *qh = qg + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + g * L + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
    for (; j < L; j++) {
        const float *kr = TF_ROW(k_cache, j);
        for (int64_t g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * D + d), _mm256_loadu_ps(kr + d), a);
            p[g * L + j] = tf_hsum(a) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * L, *og = o + g * D;
        const __m256 vi = _mm256_set1_ps(tf_softmax_row(pg, L));
        for (int64_t c = 0; c < D; c += 64) {
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
            for (j = 0; j < L; j++) {
                const float *vr = TF_ROW(v_cache, j) + c;
                const __m256 pj = _mm256_set1_ps(pg[j]);
                o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), o0);
                o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), o1);
                o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), o2);
                o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), o3);
                o4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 32), o4);
                o5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 40), o5);
                o6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 48), o6);
                o7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 56), o7);
            }
            _mm256_storeu_ps(og + c, _mm256_mul_ps(o0, vi));
            _mm256_storeu_ps(og + c + 8, _mm256_mul_ps(o1, vi));
            _mm256_storeu_ps(og + c + 16, _mm256_mul_ps(o2, vi));
            _mm256_storeu_ps(og + c + 24, _mm256_mul_ps(o3, vi));
            _mm256_storeu_ps(og + c + 32, _mm256_mul_ps(o4, vi));
            _mm256_storeu_ps(og + c + 40, _mm256_mul_ps(o5, vi));
            _mm256_storeu_ps(og + c + 48, _mm256_mul_ps(o6, vi));
            _mm256_storeu_ps(og + c + 56, _mm256_mul_ps(o7, vi));
        }
    }
#undef TF_ROW
}
#endif

/* Any head_dim: the plain loops. */
static void tf_attend_head(float *o, const float *qh, const float *k_cache, const float *v_cache,
                           const int64_t *bt, int64_t L, int64_t bs, int64_t KVH, int64_t kh, int64_t D,
                           float scale, float *p, int64_t j0) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const float *kr = k_cache + ((bt[(j + j0) / bs] * bs + (j + j0) % bs) * KVH + kh) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qh[d] * kr[d];
        p[j] = dot * scale;
        m = p[j] > m ? p[j] : m;
    }
    for (int64_t j = 0; j < L; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    memset(o, 0, sizeof(float) * D);
    for (int64_t j = 0; j < L; j++) {
        const float *vr = v_cache + ((bt[(j + j0) / bs] * bs + (j + j0) % bs) * KVH + kh) * D;
        const float pj = p[j] / sum;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += pj * vr[d];
    }
}

/* Decode attention straight from the paged pools, one query token per sequence:
 * out[b, h] = softmax(scale * q[b, h] . K[b]) V[b] over the sequence's first ctx_lens[b] tokens,
 * where token j of sequence b sits in block block_tables[b, j / bs] at offset j % bs.
 * q rows are q_stride floats apart (the fused qkv rows); out is [B, H, D]; query head h reads kv
 * head h / (H / KVH), as repeat_kv does. One (sequence, kv head) pair per task.
 * window > 0 (a sliding-window layer): only the last `window` tokens of each sequence are attended. */
void tf_decode_attention_window(float *out, const float *q, int64_t q_stride, const float *k_cache,
                                const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                int64_t bs, float scale, int64_t window) {
    const int64_t G = H / KVH;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = window > 0 && ctx_lens[b] > window ? window : ctx_lens[b];
        max_len = n > max_len ? n : max_len;
    }
#pragma omp parallel if (B * KVH >= 2)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
#pragma omp for schedule(dynamic, 2)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, kh = task % KVH;
            const int64_t *bt = block_tables + b * bt_stride;
            float *o = out + (b * H + kh * G) * D;
            const float *qg = q + b * q_stride + kh * G * D;
            const int64_t j0 = window > 0 && ctx_lens[b] > window ? ctx_lens[b] - window : 0;
            const int64_t L = ctx_lens[b] - j0;
#if defined(__AVX2__) && defined(__FMA__)
            if (D % 64 == 0) {
                tf_attend_group64(o, qg, G, k_cache, v_cache, bt, L, bs, KVH, kh, D, scale, p, j0);
                continue;
            }
#endif
            for (int64_t g = 0; g < G; g++)
                tf_attend_head(o + g * D, qg + g * D, k_cache, v_cache, bt, L, bs, KVH, kh, D, scale, p, j0);
        }
        free(p);
    }
}

/* tf_paged_decode_attention: tf_decode_attention_window's arithmetic (per query head, softmax(scale
 * q.K) V over the sequence's first ctx_lens tokens, or its last `window`), rewritten for many and long
 * sequences, where decode attention reads more bytes than the linears (64 sequences of ~135 tokens read
 * 400 MB of float32 K/V per step on SmolLM2-135M; the old kernel took ~38 ms of an 81 ms step there):
 *  - each task locates its token rows once, in an offset table built by walking the block table,
 *    instead of a division and a modulo per row and query head;
 *  - AVX-512 builds score up to 4 of the heads that share a kv head against 4 keys at once, loading
 *    (and widening) each 16 values of a key once for all of them (tf_qk512), and accumulate P V for up
 *    to 4 heads at once in registers, reading each V row once instead of once per head;
 *  - each thread claims its next task before it starts one and prefetches that task's rows into L2
 *    while it computes (tf_ahead_t). Without it a thread's DRAM reads (the first kv head's pass) and
 *    its arithmetic (the other passes, softmax, P V) took turns: float16 pools at 32 rows x 192 tokens
 *    moved ~4 GB/s on one thread against ~9.4 GB/s for a streaming read, and ~6-7 GB/s with it
 *    (benchmarks/decode_attention.py --threads 1, 2026-12-02);
 *  - rows 8 keys ahead are prefetched too (whole rows, every kv head's, when a task takes a whole
 *    sequence): they cover each thread's first task, which nothing prefetched.
 * tf_paged_decode_attention_f16 reads float16 pools (kv_cache_dtype="float16": half the bytes, values
 * widened exactly to float32 as they are loaded; the arithmetic is the same). The old function stays
 * as the reference the benchmark measures against (benchmarks/decode_attention.py). */
#if defined(__AVX2__) && defined(__FMA__)

#ifndef TF_AHEAD
#define TF_AHEAD 8          /* rows prefetched ahead */
#endif
/* The cache lines of `bytes` bytes from r. */
static inline void tf_prefetch_row(const char *r, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(r + i, _MM_HINT_T0);
}

/* The next task's rows, prefetched into L2 a few at a time while the current task computes (its K rows,
 * then its V rows): a thread's memory reads then overlap its arithmetic instead of alternating with it.
 * Paced evenly (total rows over the `calls` steps the current task makes, Bresenham-style), so the
 * prefetches do not pile up in the fill buffers ahead of the current task's own loads. */
typedef struct {
    const char *k, *v;              /* the next task's bases: whole rows, or one kv head's part */
    const int64_t *off;             /* its row offsets (elements) */
    int64_t rows, bytes, es;        /* its rows; bytes prefetched per row; bytes per element */
    int64_t total, done, acc, calls;    /* 2 * rows (0: no next task), rows issued, pacing */
} tf_ahead_t;

static inline __attribute__((always_inline)) void tf_ahead_step(tf_ahead_t *a) {
    for (a->acc += a->total; a->acc >= a->calls && a->done < a->total; a->acc -= a->calls) {
        const int64_t r = a->done++;
        const char *row = r < a->rows ? a->k + a->off[r] * a->es : a->v + a->off[r - a->rows] * a->es;
        for (int64_t i = 0; i < a->bytes; i += 64) _mm_prefetch(row + i, _MM_HINT_T1);
    }
}

/* 8 values at element i of a float32 (half = 0) or float16 (half = 1) row, as float32 (16: tf_ld16, common.h). */
static inline __attribute__((always_inline)) __m256 tf_ld8(const char *base, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}
#endif

#if defined(__AVX512F__)
/* P V for NG (<= 4) heads, 64 dims from column c: o[g * D + c ..] = inv[g] * sum_j p[g * L + j] V[j]. */
static inline __attribute__((always_inline)) void tf_pv512(const int NG, float *o, const float *p, int64_t L,
                                                           const char *vb, const int64_t *off, int64_t c,
                                                           int64_t D, const float *inv, const char *pv,
                                                           int64_t pfb, tf_ahead_t *ah, const int half) {
    const int64_t es = half ? 2 : 4;
    __m512 acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const char *vr = vb + off[j] * es;
        if (pfb && j + TF_AHEAD < L) tf_prefetch_row(pv + off[j + TF_AHEAD] * es, pfb);
        if ((j & 3) == 3) tf_ahead_step(ah);
        const __m512 v0 = tf_ld16(vr, c, half), v1 = tf_ld16(vr, c + 16, half);
        const __m512 v2 = tf_ld16(vr, c + 32, half), v3 = tf_ld16(vr, c + 48, half);
        for (int g = 0; g < NG; g++) {
            const __m512 pj = _mm512_set1_ps(p[g * L + j]);
            acc[g][0] = _mm512_fmadd_ps(pj, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(pj, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(pj, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(pj, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < NG; g++) {
        const __m512 vi = _mm512_set1_ps(inv[g]);
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + g * D + c + 16 * i, _mm512_mul_ps(acc[g][i], vi));
    }
}

static inline __m256 tf_fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* (sum of a0's 16 lanes, of a1's, a2's, a3's): two unpack levels leave each 128-bit lane holding the 4
 * partial sums, then the lanes fold (13 uops against 21 for four folds and three hadds). */
static inline __m128 tf_hsum4x512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512d t0 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
    const __m512d t1 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
    const __m256 h = tf_fold512(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)),
                                              _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1))));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of NG (<= 4) heads (queries qh, D apart) against the 4 key rows k[0..3], into p[g * L + j ..]:
 * each 16 values of a key are loaded and widened once for all NG heads. */
static inline __attribute__((always_inline)) void tf_qk512(const int NG, float *p, const float *qh, int64_t L,
                                                           int64_t j, const char *const *k, int64_t D,
                                                           float scale, const int half) {
    __m512 acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 x0 = tf_ld16(k[0], d, half), x1 = tf_ld16(k[1], d, half);
        const __m512 x2 = tf_ld16(k[2], d, half), x3 = tf_ld16(k[3], d, half);
        for (int g = 0; g < NG; g++) {
            const __m512 qv = _mm512_loadu_ps(qh + g * D + d);
            acc[g][0] = _mm512_fmadd_ps(qv, x0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(qv, x1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(qv, x2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(qv, x3, acc[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        _mm_storeu_ps(p + g * L + j, _mm_mul_ps(tf_hsum4x512(acc[g][0], acc[g][1], acc[g][2], acc[g][3]),
                                                _mm_set1_ps(scale)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The G query heads of one kv head against one sequence's rows at element offsets off[j] of kb / vb (D
 * a multiple of 64); o and qg: the G heads, D apart; p: scratch of G * L floats. pk / pv and pfb:
 * prefetch pfb bytes of each row ahead from those bases (0: none). */
static inline __attribute__((always_inline)) void tf_attend_rows64_t(
        float *o, const float *qg, int64_t G, const char *kb, const char *vb, const int64_t *off, int64_t L,
        int64_t D, float scale, float *p, const char *pk, const char *pv, int64_t pfb, tf_ahead_t *ah,
        const int half) {
    const int64_t es = half ? 2 : 4;
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const char *k0 = kb + off[j] * es, *k1 = kb + off[j + 1] * es;
        const char *k2 = kb + off[j + 2] * es, *k3 = kb + off[j + 3] * es;
        if (pfb && j + TF_AHEAD + 4 <= L)
            for (int i = TF_AHEAD; i < TF_AHEAD + 4; i++) tf_prefetch_row(pk + off[j + i] * es, pfb);
        tf_ahead_step(ah);
#if defined(__AVX512F__)
        const char *k[4] = {k0, k1, k2, k3};
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t n = G - g0 < 4 ? G - g0 : 4;
            if (n == 4) tf_qk512(4, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else if (n == 3) tf_qk512(3, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else if (n == 2) tf_qk512(2, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else tf_qk512(1, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
        }
#else
        for (int64_t g = 0; g < G; g++) {
            const float *qh = qg + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, tf_ld8(k0, d, half), a0);
                a1 = _mm256_fmadd_ps(qv, tf_ld8(k1, d, half), a1);
                a2 = _mm256_fmadd_ps(qv, tf_ld8(k2, d, half), a2);
                a3 = _mm256_fmadd_ps(qv, tf_ld8(k3, d, half), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + g * L + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
#endif
    }
    for (; j < L; j++) {
        const char *kr = kb + off[j] * es;
        for (int64_t g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * D + d), tf_ld8(kr, d, half), a);
            p[g * L + j] = tf_hsum(a) * scale;
        }
    }
    float inv[G];
    for (int64_t g = 0; g < G; g++) inv[g] = tf_softmax_row(p + g * L, L);
#if defined(__AVX512F__)
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t n = G - g0 < 4 ? G - g0 : 4;
        for (int64_t c = 0; c < D; c += 64) {
            float *og = o + g0 * D;
            const float *pg = p + g0 * L;
            const int64_t w = g0 == 0 && c == 0 ? pfb : 0;     /* each row prefetched once */
            if (n == 4) tf_pv512(4, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else if (n == 3) tf_pv512(3, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else if (n == 2) tf_pv512(2, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else tf_pv512(1, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
        }
    }
#else
    for (int64_t g = 0; g < G; g++) {
        const float *pg = p + g * L;
        float *og = o + g * D;
        const __m256 vi = _mm256_set1_ps(inv[g]);
        for (int64_t c = 0; c < D; c += 64) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (j = 0; j < L; j++) {
                const char *vr = vb + off[j] * es;
                if (g == 0 && c == 0 && pfb && j + TF_AHEAD < L) tf_prefetch_row(pv + off[j + TF_AHEAD] * es, pfb);
                if ((j & 3) == 3) tf_ahead_step(ah);
                const __m256 pj = _mm256_set1_ps(pg[j]);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pj, tf_ld8(vr, c + 8 * i, half), acc[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(og + c + 8 * i, _mm256_mul_ps(acc[i], vi));
        }
    }
#endif
}

/* Task b's row offsets (elements) into off: its first ctx_lens[b] tokens, or its last `window`; returns
 * how many. */
static inline int64_t tf_row_offsets(int64_t *off, const int64_t *bt, int64_t ctx, int64_t window, int64_t bs,
                                     int64_t KVH, int64_t D) {
    const int64_t j0 = window > 0 && ctx > window ? ctx - window : 0, L = ctx - j0;
    int64_t blk = j0 / bs, t = j0 % bs;
    for (int64_t j = 0; j < L; j++) {
        off[j] = (bt[blk] * bs + t) * KVH * D;
        if (++t == bs) t = 0, blk++;
    }
    return L;
}

/* The task loop (one thread's, every thread of the team runs it), for float32 (half = 0) or float16
 * (half = 1) pools; D a multiple of 64. */
typedef struct {
    float *out;
    const float *q;
    const char *k_cache, *v_cache;
    const int64_t *block_tables, *ctx_lens;
    int64_t q_stride, bt_stride, B, H, KVH, D, bs, window, max_len, per;
    float scale;
    int64_t claimed;        /* tasks handed out; each thread claims its next task before it starts one */
} tf_attn_job;

static inline __attribute__((always_inline)) void tf_paged_attention_t(tf_attn_job *J, const int half) {
    float *out = J->out;
    const float *q = J->q;
    const char *k_cache = J->k_cache, *v_cache = J->v_cache;
    const int64_t *block_tables = J->block_tables, *ctx_lens = J->ctx_lens;
    const int64_t q_stride = J->q_stride, bt_stride = J->bt_stride, B = J->B, H = J->H, KVH = J->KVH, D = J->D;
    const int64_t bs = J->bs, window = J->window, max_len = J->max_len, per = J->per;
    const float scale = J->scale;
    const int64_t G = H / KVH, es = half ? 2 : 4;
#if defined(__AVX512F__)
    const int64_t pv_passes = (G + 3) / 4 * (D / 64);      /* tf_ahead_step calls per 4 keys of a kv head: */
#else
    const int64_t pv_passes = G * (D / 64);                /* one in QK, one per P V pass */
#endif
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
        int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * max_len));
        int64_t *off = offs, *off_next = offs + max_len;
        /* Tasks: whole sequences when there are enough of them (a sequence's kv heads interleave in
         * its rows, so one core reads them all while they are in its cache), else (sequence, kv head). */
        const int64_t ntasks = B * KVH / per;
        int64_t task = __atomic_fetch_add(&J->claimed, 1, __ATOMIC_RELAXED), b = task * per / KVH, L = 0;
        if (task < ntasks) L = tf_row_offsets(off, block_tables + b * bt_stride, ctx_lens[b], window, bs, KVH, D);
        while (task < ntasks) {
            const int64_t next = __atomic_fetch_add(&J->claimed, 1, __ATOMIC_RELAXED), nb = next * per / KVH;
            const int64_t kh0 = task * per % KVH;
            const int whole = per > 1;
            tf_ahead_t ah = {0};
            ah.es = es;
            ah.calls = per * (L / 4) * (1 + pv_passes);
            ah.calls = ah.calls > 0 ? ah.calls : 1;
            if (next < ntasks) {
                ah.off = off;
                ah.rows = L;
                if (nb != b) {          /* a thread's consecutive tasks often share the sequence */
                    ah.off = off_next;
                    ah.rows = tf_row_offsets(off_next, block_tables + nb * bt_stride, ctx_lens[nb], window, bs, KVH,
                                             D);
                }
                const int64_t nkh = whole ? 0 : next % KVH;
                ah.k = k_cache + nkh * D * es;
                ah.v = v_cache + nkh * D * es;
                ah.bytes = (whole ? KVH * D : D) * es;
                ah.total = 2 * ah.rows;
            }
            /* A whole sequence: its first kv head's pass prefetches whole rows (every kv head's K and
             * V), so the other heads' passes find them in cache and the memory reads are contiguous;
             * one kv head: its own D values per row. */
            for (int64_t kh = kh0; kh < kh0 + per; kh++) {
                const char *kb = k_cache + kh * D * es, *vb = v_cache + kh * D * es;
                tf_attend_rows64_t(out + (b * H + kh * G) * D, q + b * q_stride + kh * G * D, G, kb, vb, off, L, D,
                                   scale, p, whole ? k_cache : kb, whole ? v_cache : vb,
                                   (whole ? (kh == kh0 ? KVH * D : 0) : D) * es, &ah, half);
            }
            if (next < ntasks && nb != b) {
                int64_t *t = off;
                off = off_next, off_next = t;
                L = ah.rows;
            }
            task = next, b = nb;
        }
        free(p);
        free(offs);
    }
}

static void tf_paged_attention_f32(void *J) { tf_paged_attention_t((tf_attn_job *)J, 0); }
static void tf_paged_attention_f16(void *J) { tf_paged_attention_t((tf_attn_job *)J, 1); }

/* The team: whole sequences per task when there are enough of them (a sequence's kv heads interleave in its
 * rows, so one core reads them all while they are in its cache), else (sequence, kv head). */
static void tf_paged_attention(float *out, const float *q, int64_t q_stride, const char *k_cache, const char *v_cache,
                               const int64_t *block_tables, int64_t bt_stride, const int64_t *ctx_lens, int64_t B,
                               int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int64_t window, int half) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = window > 0 && ctx_lens[b] > window ? window : ctx_lens[b];
        max_len = n > max_len ? n : max_len;
    }
    const int nth = B * KVH >= 2 && !omp_in_parallel() ? tf_pool_team() : 1;
    tf_attn_job J = {out, q, k_cache, v_cache, block_tables, ctx_lens, q_stride, bt_stride, B, H, KVH, D, bs, window,
                     max_len, B >= 4 * nth ? KVH : 1, scale, 0};
    tf_team(half ? tf_paged_attention_f16 : tf_paged_attention_f32, &J, nth, B <= TF_POOL_MAX_ROWS);
}
#endif

void tf_paged_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                               const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                               int64_t bs, float scale, int64_t window) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 64 == 0) {
        tf_paged_attention(out, q, q_stride, (const char *)k_cache, (const char *)v_cache, block_tables, bt_stride,
                           ctx_lens, B, H, KVH, D, bs, scale, window, 0);
        return;
    }
#endif
    tf_decode_attention_window(out, q, q_stride, k_cache, v_cache, block_tables, bt_stride, ctx_lens, B, H, KVH, D,
                               bs, scale, window);
}

/* Float16 pools: D a multiple of 64 on an AVX2 build (the Python side checks; torch's path otherwise). */
void tf_paged_decode_attention_f16(float *out, const float *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                   const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                   int64_t bs, float scale, int64_t window) {
#if defined(__AVX2__) && defined(__FMA__)
    tf_paged_attention(out, q, q_stride, (const char *)k_cache, (const char *)v_cache, block_tables, bt_stride,
                       ctx_lens, B, H, KVH, D, bs, scale, window, 1);
#else
    (void)out; (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_tables; (void)bt_stride;
    (void)ctx_lens; (void)B; (void)H; (void)KVH; (void)D; (void)bs; (void)scale; (void)window;
    abort();
#endif
}

void tf_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale) {
    tf_paged_decode_attention(out, q, q_stride, k_cache, v_cache, block_tables, bt_stride, ctx_lens, B, H, KVH, D,
                              bs, scale, 0);
}
