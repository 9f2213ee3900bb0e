/* tokenfab's CPU kernels for the small, memory-bound parts of a decoder step (float32).
 *
 * torch runs each of these as 4-10 separate ops; at decode batch sizes the per-op overhead and the
 * copies between them (notably gathering every sequence's K/V blocks for attention) cost more than
 * the arithmetic. Built at first use by tokenfab/kernels/__init__.py with the machine's gcc and
 * called through ctypes; every kernel has a torch reference it is tested against.
 *
 * Threads: OpenMP. The shared library links libgomp.so.1, the soname torch's wheel ships, so the
 * process keeps one OpenMP runtime and one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), as Hugging Face's LlamaRMSNorm in float32. */
void tf_rms_norm(float *out, const float *x, const float *w, int64_t T, int64_t D, float eps) {
#pragma omp parallel for if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *o = out + t * D;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
        float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = w[d] * (xr[d] * inv);
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
#pragma omp parallel for if (T >= 8)
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

/* Decode attention straight from the paged pools, one query token per sequence:
 * out[b, h] = softmax(scale * q[b, h] . K[b]) V[b] over the sequence's first ctx_lens[b] tokens,
 * where token j of sequence b sits in block block_tables[b, j / bs] at offset j % bs.
 * q rows are q_stride floats apart (the fused qkv rows); out is [B, H, D]; query head h reads kv
 * head h / (H / KVH), as repeat_kv does. One (sequence, kv head) pair per task. */
void tf_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale) {
    const int64_t G = H / KVH;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = ctx_lens[b] > max_len ? ctx_lens[b] : max_len;
#pragma omp parallel if (B * KVH >= 2)
    {
        float *p = (float *)malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, kh = task % KVH, L = ctx_lens[b];
            const int64_t *bt = block_tables + b * bt_stride;
            const float *qg = q + b * q_stride + kh * G * D;
            float *o = out + (b * H + kh * G) * D;
            for (int64_t j = 0; j < L; j++) {
                const float *kr = k_cache + ((bt[j / bs] * bs + j % bs) * KVH + kh) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qr = qg + g * D;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                    p[g * L + j] = dot * scale;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *pg = p + g * L;
                float m = -INFINITY, sum = 0.f;
                for (int64_t j = 0; j < L; j++) m = pg[j] > m ? pg[j] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < L; j++) {
                    pg[j] = expf(pg[j] - m);
                    sum += pg[j];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t j = 0; j < L; j++) pg[j] *= inv;
            }
            memset(o, 0, sizeof(float) * G * D);
            for (int64_t j = 0; j < L; j++) {
                const float *vr = v_cache + ((bt[j / bs] * bs + j % bs) * KVH + kh) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float pj = p[g * L + j];
                    float *og = o + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) og[d] += pj * vr[d];
                }
            }
        }
        free(p);
    }
}

/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], the SwiGLU activation of a fused gate/up row. */
void tf_silu_mul(float *out, const float *gate_up, int64_t T, int64_t I) {
#pragma omp parallel for if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
