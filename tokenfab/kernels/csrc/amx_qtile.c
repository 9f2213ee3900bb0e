/* ---------------------------------------------------------------------------------------------------------
 * tf_qtile: a few activation rows (decode batches, speculative verify rows) times int4 / int8 blocks on
 * AMX int8 tiles (kernel "qtile", tokenfab/quant/kernels.py). tf_qgemm's per-row loop costs ~2 cycles per
 * block of 32 and activation row (an int16 dot, a convert and an FMA per row, docs/speculative.md), so a
 * 5-row verify cost 2.4x a 1-row step. Here one tile multiply (TDPBSSD / TDPBSUD, ~8 cycles whatever
 * the rows up to 8, measured on the Sapphire Rapids VM) computes one block for 16 outputs and every
 * row at once; what is left per row is one convert and one FMA per 16 outputs.
 *
 * Numerics (the same for every row count, and in the plain C reference below, bit for bit):
 *   - each activation row is quantized per block of 32 to int16 in [-32639, 32639] (scale max|x| /
 *     32639, ~2^-16 relative, as tf_qgemm) and split exactly as q = 256 hi + lo, hi and lo int8
 *     (the tile unit multiplies bytes): the tile computes both halves' dots, recombined in int32, so
 *     D[r, n, b] = sum_j w[n, 32b + j] q[r, 32b + j] is exact;
 *   - y[r, n] = fma over blocks b in order: acc = fma((float)D, fl(s[n, b] * dx[r, b]), acc), then
 *     (int4) acc = fma(m[n, g], xs[r, g], acc) over groups g in order, xs the float sums of x per group.
 *   A row's result depends on that row alone: 1-row decode and 5-row verify give the same bits.
 * Layout (built by tokenfab/quant/kernels.py, `qtile_pack`): outputs in tiles of 16 (N % 16 == 0);
 *   bits 8: q [N/16][nb][8][16][4] int8: the tile unit's B operand as is (row i: k 4i..4i+3 of 16 outputs)
 *   bits 4: q [N/16][nb][4][64] bytes: chunk c's low nibbles are B row 2c, its high nibbles B row 2c+1
 *   d and m (int4's offsets), one per output and group of gs, tiled [N/16][G][16]: a block's 16 scales are
 *   one contiguous load. Float16 where `bits | TF_QTILE_HALF` says so (GGUF's Q4_1 / Q8_0 store theirs in
 *   float16, so widening them is exact and the bytes per token drop by a third of the int4 blocks'),
 *   else float32. */
#include "common.h"

/* TF_QTILE (tf_qgemm's `bits | TF_QTILE`: run tf_qtile) and TF_QTILE_HALF are defined in common.h. */
#define TF_QTILE_ROWS 16  /* rows per pass over the weight (two tiles of 8: each row takes a hi and a lo tile row) */
#define TF_QTILE_QMAX 32639.f   /* 256 * 127 + 127: the largest q whose hi and lo both fit int8 */

/* Element i of a tiled scale array, float32 or float16. */
static inline float tf_qtile_scale(const void *s, int half, int64_t i) {
    return half ? tf_f16((const uint8_t *)s + 2 * i) : ((const float *)s)[i];
}

/* x [n] -> int16 blocks in [-32639, 32639] and their scales (relative error ~2^-16). */
static void tf_qtile_quantize(const float *x, int64_t n, int16_t *xq, float *dx) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.f ? TF_QTILE_QMAX / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int16_t)lrintf(xb[j] * id);
        dx[b] = amax / TF_QTILE_QMAX;
    }
}

/* Each row's int16 blocks (tf_qtile_quantize), their scales dx [rows, nb], the float sums of x per group
 * xs [rows, G] (int4's offsets), and the exact split q = 256 hi + lo into int8 hi [rows, K] and lo
 * [rows, K]; with `bias` 128 the halves are stored plus 128, as uint8 (VNNI's unsigned operand). */
static void tf_qtile_prep(const float *x, int64_t M, int64_t K, int64_t gs, int16_t *xq, float *dx, float *xs,
                          int8_t *hi, int8_t *lo, int bias) {
    const int64_t nb = K / 32, G = K / gs;
    for (int64_t r = 0; r < M; r++) {
        tf_qtile_quantize(x + r * K, K, xq + r * K, dx + r * nb);
        for (int64_t g = 0; g < G; g++)
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
        if (hi)
            for (int64_t k = 0; k < K; k++) {
                const int v = xq[r * K + k], h = (v + 128) >> 8;     /* floor: lo in [-128, 127] */
                hi[r * K + k] = (int8_t)(uint8_t)(h + bias);
                lo[r * K + k] = (int8_t)(uint8_t)(v - 256 * h + bias);
            }
    }
}

/* The weight of output n (0..15 in its tile), input k (0..31 in block b) from the packed layout. */
static inline int tf_qtile_w(const uint8_t *tile_b, int64_t bits, int n, int k) {
    const int i = k / 4, j = k % 4;        /* B row i, byte n * 4 + j */
    if (bits == 8) return ((const int8_t *)tile_b)[i * 64 + n * 4 + j];
    const uint8_t byte = tile_b[(i / 2) * 64 + n * 4 + j];
    return i & 1 ? byte >> 4 : byte & 0x0F;
}

/* The plain C reference: the same arithmetic one weight at a time (tests compare the tile path to it). */
void tf_qtile_ref(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                  const float *m, int64_t gs, int64_t bits) {
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, tb = bits == 8 ? 512 : 256;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, NULL, NULL, 0);
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / 16;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *tile_b = (const uint8_t *)q + (t * nb + b) * tb;
                int32_t dot = 0;
                for (int k = 0; k < 32; k++) dot += tf_qtile_w(tile_b, bits, (int)(n % 16), k) * xq[r * K + b * 32 + k];
                const float sc = tf_qtile_scale(d, half, (t * G + b / (gs / 32)) * 16 + n % 16) * dx[r * nb + b];
                acc = fmaf((float)dot, sc, acc);
            }
            if (bits == 4)
                for (int64_t g = 0; g < G; g++) acc = fmaf(tf_qtile_scale(m, half, (t * G + g) * 16 + n % 16), xs[r * G + g], acc);
            y[r * N + n] = acc;
        }
    }
    free(xq);
    free(dx);
    free(xs);
}

/* tf_qtile on AVX-512 VNNI, for the rows where the tile unit's fixed cost per block dominates (1-row
 * decode: one tile multiply, store and reload per block cost ~115 cycles per 16 outputs x 32 inputs with
 * the weight in L2, against ~53 here, measured on the Sapphire Rapids VM) and on CPUs without AMX. A B row of the qtile layout (16 outputs x 4
 * consecutive inputs, 64 bytes) is exactly a VNNI operand: VPDPBUSD adds the 4 products of each output
 * lane, so a block is 8 instructions per activation half and row, with the 4 activation bytes
 * broadcast. The integer dot D is the same exact integer as the tile's, and the float steps are the
 * same operations in the same order: the same bits as tf_qtile_ref.
 *   int4: the weights (nibbles 0..15) are the unsigned operand, hi and lo the signed one.
 *   int8: the weights are signed, so hi and lo go in as uint8 (plus 128) and the block's weight sums
 *         S (one more VPDPBUSD per B row, against ones) take it back out: D = 256 Dh + Dl - 32896 S. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TF_QTILE_VNNI 1
#define TF_QTILE_VNNI_ROWS 4    /* rows per pass over the weight */
/* Where AMX runs too, VNNI takes 1-row calls only: 2-core VM, 1 and 2 threads, weights streamed, per call:
 * 1 row 1.3x the tiles' speed on int4 and 1.0-1.2x on the Q8_0 LM head; 2 rows int4 0.85-1.35x, Q8_0 0.6x. */
#define TF_QTILE_VNNI_AUTO 1

static inline __attribute__((always_inline)) __m512i tf_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* TG tiles of 16 outputs (consecutive in the layout) for M rows; M and TG constants at each call site. */
static inline __attribute__((always_inline)) void
tf_qtile_vnni_tiles(const int M, const int TG, float *y, int64_t N, const int8_t *hi, const int8_t *lo,
                    const float *dx, const float *xs, int64_t K, int64_t nb, int64_t G, const uint8_t *qt,
                    const char *dt, const char *mt, int64_t bits, int64_t bpg, const int half) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    const int64_t tb = bits == 8 ? 512 : 256;
    __m512 acc[4][TF_QTILE_VNNI_ROWS];
    for (int t = 0; t < TG; t++)
        for (int r = 0; r < M; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int t = 0; t < TG; t++) {
            const uint8_t *wb = qt + (t * nb + b) * tb;
            __m512i dh[TF_QTILE_VNNI_ROWS], dl[TF_QTILE_VNNI_ROWS], sw = _mm512_setzero_si512();
            for (int r = 0; r < M; r++) dh[r] = dl[r] = _mm512_setzero_si512();
            if (bits == 4) {
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(wb + c * 64));
                    const __m512i w0 = _mm512_and_si512(v, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    for (int r = 0; r < M; r++) {         /* B rows 2c, 2c + 1: inputs 8c..8c+3, 8c+4..8c+7 */
                        const int64_t o = r * K + b * 32 + 8 * c;
                        dh[r] = _mm512_dpbusd_epi32(dh[r], w0, tf_bcast4(hi + o));
                        dl[r] = _mm512_dpbusd_epi32(dl[r], w0, tf_bcast4(lo + o));
                        dh[r] = _mm512_dpbusd_epi32(dh[r], w1, tf_bcast4(hi + o + 4));
                        dl[r] = _mm512_dpbusd_epi32(dl[r], w1, tf_bcast4(lo + o + 4));
                    }
                }
            } else {
                for (int i = 0; i < 8; i++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(wb + i * 64));
                    sw = _mm512_dpbusd_epi32(sw, ones, w);
                    for (int r = 0; r < M; r++) {
                        const int64_t o = r * K + b * 32 + 4 * i;
                        dh[r] = _mm512_dpbusd_epi32(dh[r], tf_bcast4(hi + o), w);
                        dl[r] = _mm512_dpbusd_epi32(dl[r], tf_bcast4(lo + o), w);
                    }
                }
                sw = _mm512_mullo_epi32(sw, _mm512_set1_epi32(32896));   /* 128 * 257 */
            }
            const __m512 s = tf_ld16(dt, (t * G + b / bpg) * 16, half);
            for (int r = 0; r < M; r++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh[r], 8), dl[r]);
                if (bits == 8) dot = _mm512_sub_epi32(dot, sw);
                acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nb + b])),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < TG; t++) {
        if (bits == 4)
            for (int64_t g = 0; g < G; g++) {
                const __m512 mv = tf_ld16(mt, (t * G + g) * 16, half);
                for (int r = 0; r < M; r++) acc[t][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[t][r]);
            }
        for (int r = 0; r < M; r++) _mm512_storeu_ps(y + r * N + t * 16, acc[t][r]);
    }
}

#define TF_QTILE_VNNI_CALL(M_, TG_)                                                                    \
    tf_qtile_vnni_tiles(M_, TG_, y + t * 16, N, hi, lo, dx, xs, K, nb, G, (const uint8_t *)q + t * nb * tb, \
                        (const char *)d + t * 16 * G * es, bits == 4 ? (const char *)m + t * 16 * G * es : NULL, \
                        bits, gs / 32, half)

/* y[M, N] from a qtile layout on VNNI, TF_QTILE_VNNI_ROWS rows per pass (the rows' results as tf_qtile_ref's). */
static void tf_qtile_vnni_run(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q,
                              const float *d, const float *m, int64_t gs, int64_t bits) {
    if (M > TF_QTILE_VNNI_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_QTILE_VNNI_ROWS)
            tf_qtile_vnni_run(y + r0 * N, x + r0 * K, M - r0 < TF_QTILE_VNNI_ROWS ? M - r0 : TF_QTILE_VNNI_ROWS,
                              K, N, q, d, m, gs, bits);
        return;
    }
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, ntiles = N / 16, tb = bits == 8 ? 512 : 256, es = half ? 2 : 4;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
    int8_t *hi = (int8_t *)malloc((size_t)(M * K)), *lo = (int8_t *)malloc((size_t)(M * K));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, hi, lo, bits == 8 ? 128 : 0);
    /* one row: four tiles at a time (eight independent dot chains); more rows: fewer tiles, as many chains */
    const int64_t tg = M == 1 ? 4 : M == 2 ? 2 : 1, ngroups = ntiles / tg;
#pragma omp parallel for schedule(static) if (ntiles >= 8)
    for (int64_t gi = 0; gi < ngroups; gi++) {
        const int64_t t = gi * tg;
        switch (M) {
            case 1: TF_QTILE_VNNI_CALL(1, 4); break;
            case 2: TF_QTILE_VNNI_CALL(2, 2); break;
            case 3: TF_QTILE_VNNI_CALL(3, 1); break;
            default: TF_QTILE_VNNI_CALL(4, 1); break;
        }
    }
    for (int64_t t = ngroups * tg; t < ntiles; t++) {       /* the tiles left over by the groups */
        if (M == 1) TF_QTILE_VNNI_CALL(1, 1);        /* only 1 and 2 rows take groups */
        else TF_QTILE_VNNI_CALL(2, 1);
    }
    free(xq);
    free(dx);
    free(xs);
    free(hi);
    free(lo);
}
#endif

/* tf_qtile's VNNI path called directly (tests, benchmarks): 1 when this build has it and ran it, else 0. */
int64_t tf_qtile_vnni(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                      const float *m, int64_t gs, int64_t bits) {
#ifdef TF_QTILE_VNNI
    if (M > 0) tf_qtile_vnni_run(y, x, M, K, N, q, d, m, gs, bits);
    return 1;
#else
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)q, (void)d, (void)m, (void)gs, (void)bits;
    return 0;
#endif
}
#ifdef TF_QTILE_AMX        /* GCC 11+, an AVX-512 build (common.h) */
#include <sys/syscall.h>
#include <unistd.h>

static int tf_amx_state = -1;     /* -1 not asked yet, 0 no, 1 granted */

/* 1 when this process may use AMX tiles: the CPU has them (CPUID 7.0: EDX bits 24 tile, 25 int8), the
 * environment does not say TOKENFAB_NO_AMX=1, and Linux granted the XTILEDATA permission (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile
 * instruction kills the process). Asked once; the grant covers every thread of the process. */
int64_t tf_amx_available(void) {
    if (tf_amx_state < 0) {
        unsigned a, b, c, dd;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(dd) : "a"(7), "c"(0));
        const char *off = getenv("TOKENFAB_NO_AMX");      /* "1": run as on a CPU without AMX (tests, benchmarks) */
        const int has = (dd >> 24 & 1) && (dd >> 25 & 1) && !(off && off[0] == '1');
        tf_amx_state = has && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return tf_amx_state;
}

/* Tile configurations. Up to 8 rows ("pairs"): two blocks in flight, so one block's multiply never
 * waits for the previous block's result to be stored (tiles are not renamed; one block at a time ran
 * 1-row steps 25 % slower than tf_qgemm): tiles 0, 1 the activations of blocks b, b + 1 (each row's hi
 * bytes, then its lo bytes: 2M rows of 32 bytes = one block), 2, 3 their weights (the B operand: 8 rows
 * of 16 outputs x 4 bytes), 4, 5 their int32 dots. 9-16 rows ("groups"): one block at a time, tiles 0, 1
 * the activations of rows 0-7 and 8-15, 2 the weights, 3, 4 the dots. */
__attribute__((target("amx-tile,amx-int8"))) static void tf_qtile_config(int64_t M) {
    tf_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    if (M <= 8) {
        for (int t = 0; t < 2; t++) {
            c.rows[t] = (uint8_t)(2 * M), c.colsb[t] = 32;
            c.rows[2 + t] = 8, c.colsb[2 + t] = 64;
            c.rows[4 + t] = (uint8_t)(2 * M), c.colsb[4 + t] = 64;
        }
    } else {
        c.rows[0] = 16, c.colsb[0] = 32;
        c.rows[1] = (uint8_t)(2 * (M - 8)), c.colsb[1] = 32;
        c.rows[2] = 8, c.colsb[2] = 64;
        c.rows[3] = 16, c.colsb[3] = 64;
        c.rows[4] = (uint8_t)(2 * (M - 8)), c.colsb[4] = 64;
    }
    _tile_loadconfig(&c);
}

/* A block's B operand: int8 weights are stored as it (no copy); int4 nibbles are split into `buf`. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline const void *
tf_qtile_b(const uint8_t *qt, int64_t b, int64_t bits, uint8_t (*buf)[64]) {
    if (bits == 8) {
        _mm_prefetch((const char *)(qt + (b + 4) * 512), _MM_HINT_T0);   /* tile loads from memory don't */
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 64), _MM_HINT_T0);   /* wake the streamers */
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 192), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 320), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 384), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 448), _MM_HINT_T0);
        return qt + b * 512;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t *src = qt + b * 256;
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(src + 4 * 256 + c * 64), _MM_HINT_T0);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(src + c * 64));
        _mm512_store_si512((void *)buf[2 * c], _mm512_and_si512(v, m4));
        _mm512_store_si512((void *)buf[2 * c + 1], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
    TF_MEMBAR();
    return buf;
}

/* acc[r] = fma(D[r], s * dx[r, b], acc[r]) for one block's dots (cbuf rows: hi of row r at hi0 + r, lo at lo0 + r). */
__attribute__((always_inline)) static inline void tf_qtile_acc(const int M, __m512 *acc, int32_t (*cbuf)[16], int hi0,
                                                               int lo0, int nrows, int rbase, __m512 s,
                                                               const float *dx, int64_t nb, int64_t b) {
    for (int i = 0; i < nrows; i++) {
        const int r = rbase + i;
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)cbuf[hi0 + i]), 8),
                                             _mm512_load_si512((const void *)cbuf[lo0 + i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
    (void)M;
}

/* One tile of 16 outputs for M rows (M a constant at each call site: the accumulators stay in
 * registers). a: the activation tiles [nb][2 * M][32]; dx [M, nb]; xs [M, G]. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline void
tf_qtile_tile(const int M, float *y, int64_t N, const int8_t *a, const float *dx, const float *xs, int64_t nb,
              int64_t G, const uint8_t *qt, const char *dt, const char *mt, int64_t bits, int64_t bpg, const int half) {
    /* dt, mt: the tile's scales / offsets ([G][16]) */
#define TF_SB(blk) tf_ld16(dt, (blk) / bpg * 16, half)
    __m512 acc[TF_QTILE_ROWS];
    int32_t c0[2 * TF_QTILE_ROWS][16] __attribute__((aligned(64)));
    int32_t c1[2 * TF_QTILE_ROWS][16] __attribute__((aligned(64)));
    uint8_t b0[8][64] __attribute__((aligned(64))), b1[8][64] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    if (M <= 8) {
        for (; b + 1 < nb; b += 2) {
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(3, tf_qtile_b(qt, b + 1, bits, b1), 64);
            _tile_loadd(0, a + b * 2 * M * 32, 32);
            _tile_loadd(1, a + (b + 1) * 2 * M * 32, 32);
            _tile_zero(4);
            _tile_zero(5);
            if (bits == 8) {
                _tile_dpbssd(4, 0, 2);
                _tile_dpbssd(5, 1, 3);
            } else {
                _tile_dpbsud(4, 0, 2);
                _tile_dpbsud(5, 1, 3);
            }
            _tile_stored(4, c0, 64);
            _tile_stored(5, c1, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, M, M, 0, TF_SB(b), dx, nb, b);
            tf_qtile_acc(M, acc, c1, 0, M, M, 0, TF_SB(b + 1), dx, nb, b + 1);
        }
        if (b < nb) {
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(0, a + b * 2 * M * 32, 32);
            _tile_zero(4);
            if (bits == 8) _tile_dpbssd(4, 0, 2);
            else _tile_dpbsud(4, 0, 2);
            _tile_stored(4, c0, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, M, M, 0, TF_SB(b), dx, nb, b);
        }
    } else {
        for (; b < nb; b++) {
            const int8_t *ab = a + b * 2 * M * 32;
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(0, ab, 32);
            _tile_loadd(1, ab + 16 * 32, 32);
            _tile_zero(3);
            _tile_zero(4);
            if (bits == 8) {
                _tile_dpbssd(3, 0, 2);
                _tile_dpbssd(4, 1, 2);
            } else {
                _tile_dpbsud(3, 0, 2);
                _tile_dpbsud(4, 1, 2);
            }
            _tile_stored(3, c0, 64);
            _tile_stored(4, c1, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, 8, 8, 0, TF_SB(b), dx, nb, b);
            tf_qtile_acc(M, acc, c1, 0, M - 8, M - 8, 8, TF_SB(b), dx, nb, b);
        }
    }
    if (bits == 4)
        for (int64_t g = 0; g < G; g++) {
            const __m512 mv = tf_ld16(mt, g * 16, half);
            for (int r = 0; r < M; r++) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
        }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(y + r * N, acc[r]);
#undef TF_SB
}

#define TF_QTILE_SWITCH(...)                                                          \
    switch (M) {                                                                      \
        case 1: tf_qtile_tile(1, __VA_ARGS__); break;                                 \
        case 2: tf_qtile_tile(2, __VA_ARGS__); break;                                 \
        case 3: tf_qtile_tile(3, __VA_ARGS__); break;                                 \
        case 4: tf_qtile_tile(4, __VA_ARGS__); break;                                 \
        case 5: tf_qtile_tile(5, __VA_ARGS__); break;                                 \
        case 6: tf_qtile_tile(6, __VA_ARGS__); break;                                 \
        case 7: tf_qtile_tile(7, __VA_ARGS__); break;                                 \
        case 8: tf_qtile_tile(8, __VA_ARGS__); break;                                 \
        case 9: case 10: case 11: case 12: tf_qtile_tile(12, __VA_ARGS__); break;     \
        default: tf_qtile_tile(16, __VA_ARGS__); break;                               \
    }
#else
int64_t tf_amx_available(void) { return 0; }
#endif

/* y[M, N] = x[M, K] @ W^T from a qtile layout: AMX where the process may use it, else the reference. */
#ifdef TF_QTILE_AMX
__attribute__((target("amx-tile,amx-int8")))
#endif
void tf_qtile(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
    if (M <= 0) return;       /* a step that samples no row (a prefill chunk mid-prompt): a 0-row tile is a #GP */
#ifdef TF_QTILE_VNNI
    if (M <= TF_QTILE_VNNI_AUTO || !tf_amx_available()) {
        tf_qtile_vnni_run(y, x, M, K, N, q, d, m, gs, bits);
        return;
    }
#endif
#ifdef TF_QTILE_AMX
    if (!tf_amx_available()) {
        tf_qtile_ref(y, x, M, K, N, q, d, m, gs, bits);
        return;
    }
    if (M > TF_QTILE_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_QTILE_ROWS)
            tf_qtile(y + r0 * N, x + r0 * K, M - r0 < TF_QTILE_ROWS ? M - r0 : TF_QTILE_ROWS, K, N, q, d, m, gs, bits);
        return;
    }
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    /* 9-16 rows run the kernel compiled for 12 or 16: pad with zero rows (their output is dropped) */
    const int64_t Mk = M <= 8 ? M : M <= 12 ? 12 : 16;
    const int64_t nb = K / 32, G = K / gs, r0 = Mk < 8 ? Mk : 8;
    int16_t *xq = (int16_t *)calloc((size_t)(Mk * K), sizeof(int16_t));
    float *dx = (float *)calloc((size_t)(Mk * nb), sizeof(float));
    float *xs = (float *)calloc((size_t)(Mk * G + 1), sizeof(float));
    int8_t *a = (int8_t *)aligned_alloc(64, (size_t)((nb * 2 * Mk * 32 + 63) / 64 * 64));
    float *yk = Mk == M ? y : (float *)malloc(sizeof(float) * (size_t)(Mk * N));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, NULL, NULL, 0);
    /* activation tiles per block: rows 0..r0-1's hi bytes, their lo bytes, then the same for rows r0.. */
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < Mk; r++) {
            const int64_t first = r < r0 ? 0 : 2 * r0, nr = r < r0 ? r0 : Mk - r0, i = r < r0 ? r : r - r0;
            int8_t *hi = a + (b * 2 * Mk + first + i) * 32, *lo = a + (b * 2 * Mk + first + nr + i) * 32;
            for (int j = 0; j < 32; j++) {
                const int v = xq[r * K + b * 32 + j], h = (v + 128) >> 8;     /* floor: lo in [-128, 127] */
                hi[j] = (int8_t)h;
                lo[j] = (int8_t)(v - 256 * h);
            }
        }
    const int64_t ntiles = N / 16, tb = bits == 8 ? 512 : 256, es = half ? 2 : 4;
#pragma omp parallel if (ntiles >= 8)
    {
        tf_qtile_config(Mk);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *qt = (const uint8_t *)q + t * nb * tb;
            const char *dt = (const char *)d + t * 16 * G * es, *mt = bits == 4 ? (const char *)m + t * 16 * G * es : NULL;
            TF_QTILE_SWITCH(yk + t * 16, N, a, dx, xs, nb, G, qt, dt, mt, bits, gs / 32, half)
        }
        _tile_release();
    }
    if (yk != y) {
        memcpy(y, yk, sizeof(float) * (size_t)(M * N));
        free(yk);
    }
    free(xq);
    free(dx);
    free(xs);
    free(a);
#else
    tf_qtile_ref(y, x, M, K, N, q, d, m, gs, bits);
#endif
}
