/* tokenfab's CPU kernels for the small, memory-bound parts of a decoder step (float32).
 *
 * torch runs each of these as 4-10 separate ops; at decode batch sizes the per-op overhead and the
 * copies between them (notably gathering every sequence's K/V blocks for attention) cost more than
 * the arithmetic. Built at first use by tokenfab/kernels/__init__.py with the machine's gcc (every .c
 * file of this folder in one command, one shared library) and called through ctypes; every kernel has a
 * torch reference it is tested against.
 *
 * Threads: OpenMP. The shared library links libgomp.so.1, the soname torch's wheel ships, so the
 * process keeps one OpenMP runtime and one thread pool. The decode GEMMs (tf_qgemm) and the paged decode
 * attention run on tf_cols / tf_team instead (pool.c): a pool that does not wait for a descheduled thread.
 *
 * The files, one section each:
 *   common.h         this header: includes, shared types and macros, the small inline helpers several
 *                    files use, and the library's exported API
 *   pool.c           tf_cols / tf_team: the decode GEMMs' and the paged attention's thread pool
 *   rowwise.c        RMSNorm (float32, bfloat16, fused with the residual add), RoPE + KV write, the GLU
 *                    activations, argmax
 *   attention.c      decode attention straight from the paged KV pools (float32 and float16)
 *   qgemm.c          tf_qgemm: int4 / int8 / Q8_0 weights times int16 activation blocks (decode rows)
 *   kquant.c         GGUF's K-quant super-blocks: tf_kdequant(_bf16), tf_kgemm
 *   qdot.c           tf_qdot: int8 activations (llama.cpp's approach), tf_isa
 *   qmadd.c          tf_qmadd: big batches on tf_qgemm's layout with the outputs in the lanes
 *   decode_layers.c  tf_decode_layers: a whole decode step of the decoder stack in one call
 *   amx_qtile.c      tf_qtile: qtile layouts on AMX int8 tiles (and AVX-512 VNNI, and the C reference)
 *   amx_bf16.c       tf_qbf16: qtile layouts on AMX bf16 tiles
 * Functions one file defines and another calls, other than the exported API, are hidden
 * (TF_HIDDEN): the library exports the tf_* API below and nothing else.
 */
#ifndef TOKENFAB_KERNELS_COMMON_H
#define TOKENFAB_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* A definition shared between the library's files, not exported from it. */
#define TF_HIDDEN __attribute__((visibility("hidden")))

#define TF_UP64(n) (((n) + 63) & ~(size_t)63)     /* bytes rounded up to whole cache lines */
/* The most rows (sequences) of a step whose GEMMs and decode attention run on the pool. Bigger steps run
 * in OpenMP (most of their GEMMs do anyway: qmadd, oneDNN), because OpenMP's workers spin ~1 ms after
 * each region on the core a pool worker needs: with pool jobs among them, 32 streams ran at 0.93x
 * OpenMP's speed on the 2-core EPYC. */
#define TF_POOL_MAX_ROWS 16

/* ---------------------------------------------------------------------------------------------------------
 * The thread pool (pool.c). */
typedef void (*tf_cols_fn)(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys);

extern __thread int tf_pool_off TF_HIDDEN;   /* this thread's calls bypass the pool (a big tf_qgemm's passes) */
/* This thread's scratch of at least `bytes`, grown as needed; valid until this thread's next call. */
TF_HIDDEN void *tf_scratch(size_t bytes);
/* The team size for a call from outside any OpenMP region. */
TF_HIDDEN int tf_pool_team(void);
/* Every thread of a team of `nth` runs body(ctx) (pool.c); `pooled`: on the pool, else an OpenMP team. */
TF_HIDDEN void tf_team(void (*body)(void *), void *ctx, int nth, int pooled);
/* y[r * N + n] for r < M, n < N, from fn over column ranges (pool.c). */
TF_HIDDEN void tf_cols(tf_cols_fn fn, const void *args, size_t args_size, int64_t M, int64_t N, float *y);

/* ---------------------------------------------------------------------------------------------------------
 * Quantized weights: shared constants. */
#define TF_MAX_ROWS 8     /* activation rows per pass over W: tf_qgemm's register tile, tf_kgemm's, tf_qdot's */
#define TF_QDOT 256       /* tf_qgemm's `bits | TF_QDOT`: run this kernel (the one-call decode stack's layouts) */
#define TF_QTILE 512      /* tf_qgemm's `bits | TF_QTILE`: run tf_qtile (the one-call decode stack's layouts) */
#define TF_QTILE_HALF 1024      /* a qtile layout's `bits | TF_QTILE_HALF`: its scales and offsets are float16 */

/* ggml's type ids of the blocks read as stored (layouts in kquant.c): Q4_0, and the K-quants. */
enum { TF_Q4_0 = 2, TF_Q2_K = 10, TF_Q3_K = 11, TF_Q4_K = 12, TF_Q5_K = 13, TF_Q6_K = 14 };

/* Quantizes x [n] to int16 blocks of 32 and their scales, as tf_qgemm does (qgemm.c; tf_qmadd too). */
TF_HIDDEN void tf_quantize_blocks(const float *x, int64_t n, int16_t *xq, float *dx);

/* FN(M, ...) with the row count M (1..TF_MAX_ROWS) a constant at each call site. */
#define TF_ROWS_SWITCH(FN, ...)                    \
    switch (M) {                                   \
        case 1: FN(1, __VA_ARGS__); break;         \
        case 2: FN(2, __VA_ARGS__); break;         \
        case 3: FN(3, __VA_ARGS__); break;         \
        case 4: FN(4, __VA_ARGS__); break;         \
        case 5: FN(5, __VA_ARGS__); break;         \
        case 6: FN(6, __VA_ARGS__); break;         \
        case 7: FN(7, __VA_ARGS__); break;         \
        default: FN(8, __VA_ARGS__); break;        \
    }

/* ---------------------------------------------------------------------------------------------------------
 * Small inline helpers several files use. */
#if defined(__AVX2__) && defined(__FMA__)
/* e^x for 8 floats (x clamped to [-87.3, 88]): 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, and a degree-6
 * polynomial for e^r (Cephes' coefficients); within 2 ulp of expf. glibc's vector expf is only
 * declared under -ffast-math, and a scalar expf per attention score cost more than the dot products. */
static inline __m256 tf_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float tf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc + the 8 lane sums of int16 x int16 pairs: one `vpdpwssd` where the build has AVX512-VNNI (+VL) or
 * AVX-VNNI, else `vpmaddwd` and an add (the same exact int32 result either way: a pair's sum fits, and
 * neither form saturates). */
static inline __attribute__((always_inline)) __m256i tf_dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* A block's 32 weights widened to int16: w[0] holds weights 0..15, w[1] weights 16..31. */
static inline __attribute__((always_inline)) void tf_load_weights(const void *q, int64_t b, int64_t bits, __m256i w[2]) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
        const __m128i mask = _mm_set1_epi8(0x0F);
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    } else {
        const int8_t *p = (const int8_t *)q + b * 32;
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    }
}
#endif

#if defined(__AVX512F__)
/* 16 values at element i of a float32 (half = 0) or float16 (half = 1) row, as float32. */
static inline __attribute__((always_inline)) __m512 tf_ld16(const char *base, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
                : _mm512_loadu_ps((const float *)base + i);
}
#endif

/* A short float dot product without one long dependency chain (the m * sum(x) term, per row). */
static inline float tf_dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float tail = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    tail = tf_hsum(acc);
#endif
    for (; i < n; i++) tail += a[i] * b[i];
    return tail;
}

/* One weight row's per-block scales: groups of 32 use the row's group scales `dn` as they are; wider
 * groups repeat each group's scale over its bpg blocks into `buf` (nb floats), so no block divides. */
static inline const float *tf_block_scales(const float *dn, int64_t G, int64_t bpg, float *buf) {
    if (bpg == 1) return dn;
    for (int64_t g = 0, b = 0; g < G; g++)
        for (int64_t i = 0; i < bpg; i++) buf[b++] = dn[g];
    return buf;
}

/* A little-endian float16 (GGUF's block scales, a qtile layout's float16 scales) as float32. */
static inline float tf_f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);          /* one instruction: K-quant kernels convert two or three per super-block */
#else
    const uint32_t e = (h >> 10) & 0x1F, man = h & 0x3FF, sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t u;
    float f;
    if (e == 0) {                 /* zero, subnormal: man * 2^-24, exact */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (man << 13);                      /* inf, NaN (payload kept) */
    } else {
        u = sign | ((e + 112) << 23) | (man << 13);                /* rebias 15 -> 127 */
    }
    memcpy(&f, &u, 4);
    return f;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* A Q6_K super-block's run (h, j) of 32 weights as 32 unsigned 6-bit codes (0..63), one a byte: weight
 * h * 128 + j * 32 + l has ql[h * 64 + l + 32 (j & 1)] >> 4 (j >> 1) and, from qh = the 32 bytes at
 * blk + 128 + h * 32, bits 2j..2j+1 of byte l. Its first 16 weights take scale sc[h * 8 + 2j], the rest
 * sc[h * 8 + 2j + 1]. */
static inline __attribute__((always_inline)) __m256i tf_q6k_codes(const uint8_t *blk, __m256i qh, int h, int j) {
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + (j & 1) * 32));
    const __m256i lo = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}
#endif

/* Q4_K / Q5_K's 8 six-bit scales and mins, packed in 12 bytes, in six 32-bit operations: bytes 0-3 hold
 * scales 0-3 and (bits 6-7) the high bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low
 * nibbles of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles). Byte j of *sc / *mn is scale / min j,
 * in registers (tf_kint widens them to floats straight from there). */
static inline void tf_scale_min_k4_u64(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, hi = 0x30303030u;
    *sc = (uint64_t)(a & m6) | (uint64_t)((c & m4) | ((a >> 2) & hi)) << 32;
    *mn = (uint64_t)(b & m6) | (uint64_t)(((c >> 4) & m4) | ((b >> 2) & hi)) << 32;
}

/* The same as byte arrays (little-endian: byte j is scale / min j). */
static inline void tf_scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint64_t a, b;
    tf_scale_min_k4_u64(s, &a, &b);
    memcpy(sc, &a, 8);
    memcpy(mn, &b, 8);
}

/* bfloat16 <-> float32 as torch converts them: widening is exact; narrowing rounds to nearest, ties to
 * even, and any NaN becomes the quiet NaN 0x7fc0 (c10::BFloat16's round_to_nearest_even). */
static inline float tf_from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t tf_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : r;        /* a select, so tf_narrow_row vectorizes */
}

/* float32 rows through `row` into a per-thread scratch, then narrowed to bfloat16: the bf16 kernels of
 * rowwise.c write what their float32 twins followed by torch's .to(torch.bfloat16) would, in one pass over memory
 * (a prefill chunk's activations feeding oneDNN's bf16 GEMM, kernel "bf16" in tokenfab/kernels/linear.py).
 * tf_qbf16 (amx_bf16.c) rounds its activations with it too. */
static inline void tf_narrow_row(uint16_t *o, const float *f, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = tf_to_bf16(f[i]);
}

/* This build has the AMX kernels (amx_qtile.c, amx_bf16.c): GCC 11+ (its tile intrinsics), an AVX-512 build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QTILE_AMX 1

/* GCC's tile intrinsics are asm statements without a memory clobber: the compiler does not know that a
 * tile load reads the B buffer just written, or that a tile store writes the dots read next, and may drop
 * or reorder those accesses (it did: 9-16 rows read stale dots). A barrier after each write fixes the order. */
#define TF_MEMBAR() __asm__ volatile("" ::: "memory")

/* LDTILECFG's 64-byte operand (palette 1: 8 tiles of up to 16 rows x 64 bytes). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tf_tilecfg;
#endif

/* ---------------------------------------------------------------------------------------------------------
 * The library's API: what tokenfab/kernels/__init__.py calls through ctypes (_SIGNATURES there), each
 * documented where it is defined. */
/* pool.c */
void tf_pool_stats(int64_t *out);
void tf_pool_threads(int64_t n);
void tf_pool_config(int64_t enabled, int64_t delay_us, int64_t spin_ns);
/* rowwise.c */
void tf_rms_norm(float *out, const float *x, const float *w, int64_t T, int64_t D, float eps);
void tf_rms_norm_bf16(uint16_t *out, const float *x, const float *w, int64_t T, int64_t D, float eps);
void tf_add_rms_norm(float *sum, void *out, const float *x, const void *y, const float *w, int64_t T, int64_t D,
                     float eps, int64_t y_bf16, int64_t out_bf16);
void tf_rope_write_kv(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                      const int64_t *positions, const float *cos_t, const float *sin_t,
                      float *k_cache, float *v_cache, const int64_t *slots);
void tf_rope_write_kv_f16(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                          const int64_t *positions, const float *cos_t, const float *sin_t,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots);
void tf_silu_mul(float *out, const float *gate_up, int64_t T, int64_t I);
void tf_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t T, int64_t I);
void tf_gelu_tanh_mul(float *out, const float *gate_up, int64_t T, int64_t I);
void tf_argmax_rows(int64_t *out, const float *x, int64_t M, int64_t N, int64_t stride);
/* attention.c */
void tf_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale);
void tf_decode_attention_window(float *out, const float *q, int64_t q_stride, const float *k_cache,
                                const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                int64_t bs, float scale, int64_t window);
void tf_paged_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                               const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                               int64_t bs, float scale, int64_t window);
void tf_paged_decode_attention_f16(float *out, const float *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                   const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                   int64_t bs, float scale, int64_t window);
/* qgemm.c */
void tf_qgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits);
/* kquant.c */
int64_t tf_kquant_block_bytes(int64_t type);
void tf_kdequant(float *out, const uint8_t *raw, int64_t N, int64_t K, int64_t type);
void tf_kdequant_bf16(uint16_t *out, const uint8_t *raw, int64_t N, int64_t K, int64_t type);
void tf_kgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type);
#if defined(__AVX2__) && defined(__FMA__)
TF_HIDDEN void tf_kint8(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type);
#endif
/* qdot.c */
int64_t tf_isa(void);
void tf_qdot(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
             const float *m, int64_t gs, int64_t bits);
/* qmadd.c */
void tf_qmadd(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits);
/* decode_layers.c (the structs are defined there) */
struct tf_layer;
struct tf_step_view;
void tf_decode_layers(float *x, int64_t M, int64_t hidden, int64_t n_layers, const struct tf_layer *layers,
                      int64_t H, int64_t KVH, int64_t D, int64_t inter, float eps, int64_t act,
                      const struct tf_step_view *views, int64_t bs, float scale);
/* amx_qtile.c */
int64_t tf_amx_available(void);
void tf_qtile(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits);
void tf_qtile_ref(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                  const float *m, int64_t gs, int64_t bits);
int64_t tf_qtile_vnni(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                      const float *m, int64_t gs, int64_t bits);
/* amx_bf16.c */
int64_t tf_amx_bf16_available(void);
void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits);

#endif
