/* ---------------------------------------------------------------------------------------------------------
 * tf_qbf16: many activation rows (decode batches above 16 rows, prefill chunks) times a qtile layout on AMX
 * bf16 tiles (kernel "qbf16", tokenfab/quant/kernels.py). Above 16 rows tf_qtile pays its per-block
 * scaling once per row and block (its int32 dots need the block's scales before they can be summed), and
 * the bf16 float copy (kernel "bf16", oneDNN) reads 2 bytes per weight from memory. Here each tile of 16
 * outputs is expanded once per call into bf16 B tiles in a per-thread buffer (w = q d + m in float32,
 * rounded to bf16 as the float copy is: the same weights), then every group of 32 rows runs one TDPBF16PS
 * per block and keeps its float32 sums in tiles across all blocks, stored once. The weights stream as
 * their quantized bytes, and no float copy is kept. Activations are rounded to bf16 as the bf16 kernel
 * rounds them (x: bf16 [rows rounded up to 16, K], the padding rows zero). */
#include "common.h"

#ifdef TF_QTILE_AMX        /* GCC 11+, an AVX-512 build (common.h) */
int64_t tf_amx_bf16_available(void) {
    static int state = -1;      /* asked once: cpuid traps to the hypervisor in a VM */
    if (state < 0) {
        unsigned a, b, c, dd, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(dd) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        /* CPUID 7.0 EDX bit 22: amx_bf16; 7.1 EAX bit 5: avx512_bf16 (the expansion's conversions) */
        state = (dd >> 22 & 1) && (a1 >> 5 & 1) && tf_amx_available();
    }
    return state;
}

__attribute__((target("amx-tile,amx-bf16"))) static void tf_qbf16_config(void) {
    tf_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;    /* C 0-3, A 4 5, B 6 7: 16 rows of 64 bytes */
    _tile_loadconfig(&c);
}

/* One block of a tile as 16 bf16 B rows (row j: inputs 2j, 2j + 1 of each of the 16 outputs, 64 bytes), from
 * its qtile bytes (8 rows of 16 outputs x 4 inputs; int4: chunk c's low / high nibbles are rows 2c / 2c + 1).
 * s, mo: the block's 16 scales and (int4) offsets. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline void
tf_qbf16_block(uint16_t *B, const uint8_t *wb, int64_t bits, __m512 s, __m512 mo) {
    __m512 sq[4], mq[4];
    for (int k = 0; k < 4; k++) {          /* lanes of quarter k: outputs 4k + l / 4 (4 inputs each) */
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                                             _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
        sq[k] = _mm512_permutexvar_ps(idx, s);
        mq[k] = _mm512_permutexvar_ps(idx, mo);
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i m4 = _mm512_set1_epi32(0x0F);
    for (int i = 0; i < 8; i++) {
        __m512 w[4];
        for (int k = 0; k < 4; k++) {       /* quarter k: bytes 16k.. = outputs 4k..4k+3, 4 inputs each */
            __m512i v;
            if (bits == 8) v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + i * 64 + 16 * k)));
            else {                           /* int4: row i is chunk i / 2's low (even i) or high nibbles */
                v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wb + (i / 2) * 64 + 16 * k)));
                v = _mm512_and_si512(i & 1 ? _mm512_srli_epi32(v, 4) : v, m4);
            }
            const __m512 f = _mm512_cvtepi32_ps(v);
            w[k] = bits == 8 ? _mm512_mul_ps(f, sq[k]) : _mm512_fmadd_ps(f, sq[k], mq[k]);
        }
        /* bf16 words 4n + j (n = output, j = input 4i + j) of outputs 0-7, then 8-15: dword 2n holds inputs
         * 4i, 4i + 1 of output n, dword 2n + 1 inputs 4i + 2, 4i + 3 */
        const __m512i p01 = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]), p23 = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);
        _mm512_store_si512((void *)(B + (2 * i) * 32), _mm512_permutex2var_epi32(p01, even, p23));
        _mm512_store_si512((void *)(B + (2 * i + 1) * 32), _mm512_permutex2var_epi32(p01, odd, p23));
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits) {
    if (M <= 0) return;
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, bpg = gs / 32, ntiles = N / 16, tb = bits == 8 ? 512 : 256;
    const int64_t es = half ? 2 : 4, Mp = (M + 15) / 16 * 16;
    /* x rounded to bf16 as torch's .to(torch.bfloat16) (tf_narrow_row), whole tiles of 16 rows, padding zero */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(Mp * K * 2 + 63) / 64 * 64);
    const int64_t npairs = (ntiles + 1) / 2, pair_elems = 2 * nb * 512;
    /* Each thread takes a run of tile pairs and expands them, up to ~1 MB of bf16 B tiles at a time (L2),
     * once per call. Then every group of 32 rows runs all those pairs: its A rows (32 x K x 2 bytes) stay
     * in L1 and its results land in 32 rows of y, close together. The first version looped pairs outside
     * rows: each pair re-read every row from L3 once they outgrew L2, and its stores strode the whole of y
     * (2048 x 3072 floats: a third of the time went to stores). */
    const int64_t per_mb = ((int64_t)1 << 20) / (pair_elems * 2), cb = per_mb > 0 ? per_mb : 1;   /* pairs per block */
#pragma omp parallel if (ntiles >= 8)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t r_lo = M * me / nth, r_hi = M * (me + 1) / nth;
        tf_narrow_row(xb + r_lo * K, x + r_lo * K, (r_hi - r_lo) * K);
        if (me == nth - 1) memset(xb + M * K, 0, (size_t)((Mp - M) * K * 2));
        tf_qbf16_config();
        const int64_t p_lo = npairs * me / nth, p_hi = npairs * (me + 1) / nth;
        const int64_t mine = p_hi - p_lo < cb ? p_hi - p_lo : cb;
        uint16_t *B = (uint16_t *)aligned_alloc(64, (size_t)((mine > 0 ? mine : 1) * pair_elems * 2));
        float ct[16][16] __attribute__((aligned(64)));
#pragma omp barrier
        for (int64_t c0 = p_lo; c0 < p_hi; c0 += cb) {
            const int64_t c1 = c0 + cb < p_hi ? c0 + cb : p_hi;
            for (int64_t pi = c0; pi < c1; pi++) {
                uint16_t *Bp = B + (pi - c0) * pair_elems;
                for (int64_t t = 2 * pi; t < 2 * pi + 2 && t < ntiles; t++) {
                    const uint8_t *qt = (const uint8_t *)q + t * nb * tb;
                    const char *dt = (const char *)d + t * 16 * G * es, *mt = bits == 4 ? (const char *)m + t * 16 * G * es : NULL;
                    for (int64_t b = 0; b < nb; b++) {
                        /* the weights stream from memory and the expansion stalled on them (perf: a fifth of
                         * the kernel's samples on the first byte load of a block): fetch 4 blocks ahead */
                        for (int64_t l = 0; l < tb; l += 64) _mm_prefetch((const char *)(qt + (b + 4) * tb + l), _MM_HINT_T0);
                        tf_qbf16_block(Bp + ((t - 2 * pi) * nb + b) * 512, qt + b * tb, bits, tf_ld16(dt, b / bpg * 16, half),
                                       mt ? tf_ld16(mt, b / bpg * 16, half) : _mm512_setzero_ps());
                    }
                }
            }
            TF_MEMBAR();
            for (int64_t r0 = 0; r0 < Mp; r0 += 32) {
                const int two = r0 + 16 < Mp;
                for (int64_t pi = c0; pi < c1; pi++) {
                    /* tiles t0 and t0 + 1 (one where N / 16 is odd): each A tile loaded serves both.
                     * C[2 h + u]: rows r0 + 16 h.., tile t0 + u; A tiles 4, 5 (rows), B tiles 6, 7 */
                    const int64_t t0 = 2 * pi, nt = t0 + 1 < ntiles ? 2 : 1;
                    const uint16_t *B0 = B + (pi - c0) * pair_elems, *B1 = B0 + nb * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t b = 0; b < nb; b++) {
                        _tile_loadd(6, B0 + b * 512, 64);
                        _tile_loadd(4, xb + r0 * K + b * 32, K * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        if (nt == 2) {
                            _tile_loadd(7, B1 + b * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (two) {
                            _tile_loadd(5, xb + (r0 + 16) * K + b * 32, K * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            if (nt == 2) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    for (int h = 0; h < 1 + two; h++)
                        for (int64_t u = 0; u < nt; u++) {
                            const int64_t rb = r0 + 16 * h;
                            float *yt = y + rb * N + (t0 + u) * 16;
                            if (rb + 16 <= M) {
                                switch (2 * h + u) {
                                    case 0: _tile_stored(0, yt, N * 4); break;
                                    case 1: _tile_stored(1, yt, N * 4); break;
                                    case 2: _tile_stored(2, yt, N * 4); break;
                                    default: _tile_stored(3, yt, N * 4); break;
                                }
                            } else if (rb < M) {            /* the last rows: through a buffer, padding dropped */
                                switch (2 * h + u) {
                                    case 0: _tile_stored(0, ct, 64); break;
                                    case 1: _tile_stored(1, ct, 64); break;
                                    case 2: _tile_stored(2, ct, 64); break;
                                    default: _tile_stored(3, ct, 64); break;
                                }
                                TF_MEMBAR();
                                for (int64_t r = rb; r < M; r++) memcpy(yt + (r - rb) * N, ct[r - rb], 64);
                            }
                        }
                    TF_MEMBAR();
                }
            }
        }
        free(B);
        _tile_release();
    }
    free(xb);
}
#else
int64_t tf_amx_bf16_available(void) { return 0; }
void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits) {
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)q, (void)d, (void)m, (void)gs, (void)bits;
}
#endif
