/* The row-wise kernels: RMSNorm (float32 rows, bfloat16 rows, and fused with the residual add), RoPE with the
 * KV write (float32 and float16 pools), the GLU activations (SwiGLU, GeGLU) and argmax over rows. */
#include "common.h"

/* The row-wise kernels (norms, rope, GLUs) go parallel only in steps of more than TF_POOL_MAX_ROWS rows,
 * which run in OpenMP, and above 8k floats (a per-token q/k norm stays serial). In the smaller steps the
 * pool runs the GEMMs, and an OpenMP region's workers, spinning ~1 ms after it (GOMP_SPINCOUNT), held the
 * core the pool's worker needed: at T >= 8 rows, the old threshold, 8 streams ran at half speed. */
#define TF_PAR(T, floats) ((T) > TF_POOL_MAX_ROWS && (floats) >= (1 << 13))

/* One row of tf_rms_norm (o may be xr): shared with tf_rms_norm_bf16, so both give the same floats. */
static inline __attribute__((always_inline)) void tf_rms_norm_row(float *o, const float *xr, const float *w,
                                                                  int64_t D, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
    float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] = w[d] * (xr[d] * inv);
}

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), as Hugging Face's LlamaRMSNorm in float32. */
void tf_rms_norm(float *out, const float *x, const float *w, int64_t T, int64_t D, float eps) {
#pragma omp parallel for if (TF_PAR(T, T * D))
    for (int64_t t = 0; t < T; t++) tf_rms_norm_row(out + t * D, x + t * D, w, D, eps);
}

/* tf_rms_norm writing bfloat16 rows (x and w float32). */
void tf_rms_norm_bf16(uint16_t *out, const float *x, const float *w, int64_t T, int64_t D, float eps) {
#pragma omp parallel if (TF_PAR(T, T * D))
    {
        float *row = malloc(D * sizeof(float));
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            tf_rms_norm_row(row, x + t * D, w, D, eps);
            tf_narrow_row(out + t * D, row, D);
        }
        free(row);
    }
}

/* Rotate q and k in place inside the fused qkv rows ([T, row_stride]: H query heads, then KVH key
 * heads, then KVH value heads, D each) with non-interleaved RoPE, then store k and v at their KV
 * cache slots ([slots, KVH, D] views of the K and V pools). cos / sin_signed: [positions, D] tables,
 * sin_signed = [-sin | sin], so x' = x * cos + roll(x, D/2) * sin_signed. */
void tf_rope_write_kv(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                      const int64_t *positions, const float *cos_t, const float *sin_t,
                      float *k_cache, float *v_cache, const int64_t *slots) {
    const int64_t half = D / 2;
#pragma omp parallel for if (TF_PAR(T, T * (H + KVH) * D))
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        float tmp[512];
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = row + h * D;
            memcpy(tmp, x, D * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                float a = tmp[i] * c[i], b = tmp[i + half] * s[i];
                x[i] = a + b;
            }
            for (int64_t i = half; i < D; i++) {
                float a = tmp[i] * c[i], b = tmp[i - half] * s[i];
                x[i] = a + b;
            }
        }
        memcpy(k_cache + slots[t] * KVH * D, row + H * D, KVH * D * sizeof(float));
        memcpy(v_cache + slots[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
    }
}
/* tf_rope_write_kv for float16 pools: the same rotation in place (float32), then k and v stored rounded
 * to nearest float16 (as torch's .to(torch.float16)). */
void tf_rope_write_kv_f16(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                          const int64_t *positions, const float *cos_t, const float *sin_t,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots) {
#if defined(__AVX2__) && defined(__FMA__)      /* F16C conversions; other builds never get float16 pools */
    const int64_t half = D / 2, n = KVH * D;
#pragma omp parallel for if (TF_PAR(T, T * (H + KVH) * D))
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        float tmp[512];
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = row + h * D;
            memcpy(tmp, x, D * sizeof(float));
            for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (int64_t i = half; i < D; i++) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
        const float *src[2] = {row + H * D, row + (H + KVH) * D};
        uint16_t *dst[2] = {k_cache + slots[t] * n, v_cache + slots[t] * n};
        for (int kv = 0; kv < 2; kv++) {
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                _mm_storeu_si128((__m128i *)(dst[kv] + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(src[kv] + i), _MM_FROUND_TO_NEAREST_INT));
            for (; i < n; i++) dst[kv][i] = _cvtss_sh(src[kv][i], _MM_FROUND_TO_NEAREST_INT);
        }
    }
#else
    (void)qkv; (void)T; (void)row_stride; (void)H; (void)KVH; (void)D; (void)positions; (void)cos_t; (void)sin_t;
    (void)k_cache; (void)v_cache; (void)slots;
    abort();
#endif
}
/* The residual add and the next RMSNorm in one pass: sum[t] = x[t] + y[t], out[t] = rms_norm(sum[t]) (as
 * tf_rms_norm). y float32, or bfloat16 (y_bf16: a bf16 GEMM's result, widened exactly); out float32, or
 * bfloat16 (out_bf16, rounded as tf_rms_norm_bf16). The same bits as torch's x + y, then the norm kernel. */
void tf_add_rms_norm(float *sum, void *out, const float *x, const void *y, const float *w, int64_t T, int64_t D,
                     float eps, int64_t y_bf16, int64_t out_bf16) {
#pragma omp parallel if (TF_PAR(T, T * D))
    {
        float *row = out_bf16 ? malloc(D * sizeof(float)) : NULL;
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            const float *xr = x + t * D;
            float *s = sum + t * D;
            if (y_bf16) {
                const uint16_t *yr = (const uint16_t *)y + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) s[d] = xr[d] + tf_from_bf16(yr[d]);
            } else {
                const float *yr = (const float *)y + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) s[d] = xr[d] + yr[d];
            }
            if (out_bf16) {
                tf_rms_norm_row(row, s, w, D, eps);
                tf_narrow_row((uint16_t *)out + t * D, row, D);
            } else {
                tf_rms_norm_row((float *)out + t * D, s, w, D, eps);
            }
        }
        free(row);
    }
}

/* One row of tf_silu_mul: o[i] = silu(g[i]) * u[i] (shared with tf_silu_mul_bf16). */
static inline __attribute__((always_inline)) void tf_silu_mul_row(float *o, const float *g, const float *u, int64_t I) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), tf_exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], the SwiGLU activation of a fused gate/up row. */
void tf_silu_mul(float *out, const float *gate_up, int64_t T, int64_t I) {
#pragma omp parallel for if (TF_PAR(T, T * I))
    for (int64_t t = 0; t < T; t++) tf_silu_mul_row(out + t * I, gate_up + t * 2 * I, gate_up + t * 2 * I + I, I);
}

/* tf_silu_mul on bfloat16 rows, bfloat16 out: the gate/up GEMM's bf16 result straight into the bf16 down
 * projection. Widened exactly, computed as tf_silu_mul, rounded once (tf_to_bf16): the same bits as
 * .float(), tf_silu_mul, .to(torch.bfloat16), without the two float32 tensors. */
void tf_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t T, int64_t I) {
#pragma omp parallel if (TF_PAR(T, T * I))
    {
        float *row = malloc(3 * I * sizeof(float));     /* gate | up | result */
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *gu = gate_up + t * 2 * I;
#pragma omp simd
            for (int64_t i = 0; i < 2 * I; i++) row[i] = tf_from_bf16(gu[i]);
            tf_silu_mul_row(row + 2 * I, row, row + I, I);
            tf_narrow_row(out + t * I, row + 2 * I, I);
        }
        free(row);
    }
}

/* out[r] = the index of row r's maximum, the first of tied maxima, and the first NaN where the row has one:
 * torch's max(dim=-1).indices (and argmax), for greedy sampling over the vocabulary. One pass per row: each
 * lane keeps its largest value and that value's first index (an ordered greater-than never takes a NaN, so
 * a lane's first NaN is noted apart and the scalar loop finds the row's first), then the lanes reduce to
 * the largest value at the smallest index. Rows of `stride` floats; in parallel over rows. */
static int64_t tf_argmax_row(const float *x, int64_t N) {
    int64_t i = 0, best_i = 0;
    float best = -INFINITY;
    int nan = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (N >= 8) {
        __m256 bv = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
        __m256i bi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i eight = _mm256_set1_epi32(8);
        for (; i + 8 <= N; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
            unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bv = _mm256_blendv_ps(bv, v, gt);
            bi = _mm256_blendv_epi8(bi, idx, _mm256_castps_si256(gt));
            idx = _mm256_add_epi32(idx, eight);
        }
        nan = _mm256_movemask_ps(unord) != 0;
        float vals[8];
        int32_t ids[8];
        _mm256_storeu_ps(vals, bv);
        _mm256_storeu_si256((__m256i *)ids, bi);
        best_i = -1;
        for (int l = 0; l < 8; l++)           /* a lane that never saw a value above -inf keeps index 0.. */
            if (vals[l] > best || (vals[l] == best && ids[l] < best_i) || best_i < 0)
                best = vals[l], best_i = ids[l];
        if (best == -INFINITY) best_i = 0;    /* ..so an all -inf prefix answers 0, as torch does */
    }
#endif
    for (; i < N; i++) {
        if (x[i] != x[i]) { nan = 1; break; }
        if (x[i] > best) best = x[i], best_i = i;
    }
    if (nan)
        for (int64_t j = 0; j < N; j++)
            if (x[j] != x[j]) return j;
    return best_i;
}

void tf_argmax_rows(int64_t *out, const float *x, int64_t M, int64_t N, int64_t stride) {
#pragma omp parallel for if (M * N >= (1 << 16))
    for (int64_t r = 0; r < M; r++) out[r] = tf_argmax_row(x + r * stride, N);
}

/* out[t] = gelu_tanh(gate_up[t, :I]) * gate_up[t, I:], the GeGLU activation (Gemma) of a fused gate/up row.
 * gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^(-2u))
 * (the same value: 1 + tanh(u) = 2 / (1 + e^(-2u))), so it shares tf_silu_mul's exp and has no
 * cancellation near u = 0. Within a few ulp of torch's gelu(approximate="tanh") (Sleef's tanh), not
 * bit-equal: the cpu backend runs this kernel in the layer path and the one-call stack alike. */
void tf_gelu_tanh_mul(float *out, const float *gate_up, int64_t T, int64_t I) {
    const float k2 = 2.f * 0.7978845608028654f, kk = 0.044715f;     /* 2 sqrt(2 / pi), the cubic's factor */
#pragma omp parallel for if (TF_PAR(T, T * I))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(k2), _mm256_fmadd_ps(_mm256_set1_ps(kk), g3, gv));
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), tf_exp256(_mm256_sub_ps(_mm256_setzero_ps(), inner)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float inner = k2 * fmaf(kk, g[i] * g[i] * g[i], g[i]);
            o[i] = g[i] / (1.f + expf(-inner)) * u[i];
        }
    }
}
