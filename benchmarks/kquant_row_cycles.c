/* TSC cycles per super-block of tf_kint's and tf_kint8's one-row (and four-row) K-quant row kernels, one thread, weights held
 * in cache: the kernels' instruction cost alone, without memory or thread-pool effects, for comparing builds
 * of tokenfab/kernels/csrc/kquant.c on a noisy machine (alternate the builds; compare Q6_K against Q4_K).
 *
 *   gcc -O3 -fopenmp -fno-math-errno -march=x86-64-v3 -mtune=native -I tokenfab/kernels/csrc \
 *       -o /tmp/kq_cycles benchmarks/kquant_row_cycles.c \
 *       $(ls tokenfab/kernels/csrc/*.c | grep -v kquant.c) -lm && /tmp/kq_cycles
 */
#include "../tokenfab/kernels/csrc/kquant.c"
#include <stdio.h>
#include <x86intrin.h>

#define ROW_FN(NAME, FN, M)                                                                                    \
    __attribute__((noinline)) static void NAME(float *out, const int16_t *xp, const float *dx, const float *xs, \
                                               int64_t K, const uint8_t *row) {                                \
        FN(M, out, xp, dx, xs, K, row);                                                                        \
    }
ROW_FN(q6k_1, tf_q6k_row, 1)
ROW_FN(q6k_4, tf_q6k_row, 4)
ROW_FN(q4k_1, TF_Q4K_ROW, 1)
ROW_FN(q4k_4, TF_Q4K_ROW, 4)
/* tf_kint8's rows (int8 activation blocks of 256), on the same buffers read as their int8 / int16 inputs */
#define ROW8_FN(NAME, FN, M, XS_T)                                                                             \
    __attribute__((noinline)) static void NAME(float *out, const int16_t *xp, const float *dx, const float *xs, \
                                               int64_t K, const uint8_t *row) {                                \
        FN(M, out, (const int8_t *)xp, dx, (const XS_T *)xs, K, row);                                          \
    }
ROW8_FN(q4k8_1, tf_q4k8_row, 1, float)
ROW8_FN(q6k8_1, tf_q6k8_row, 1, int16_t)
ROW8_FN(q4k8_4, tf_q4k8_row, 4, float)
ROW8_FN(q6k8_4, tf_q6k8_row, 4, int16_t)

typedef void (*row_fn)(float *, const int16_t *, const float *, const float *, int64_t, const uint8_t *);

int main(void) {
    const int64_t K = 2048, N = 256, nsb = K / 256;
    uint8_t *w6 = malloc(N * nsb * 210), *w4 = malloc(N * nsb * 144);
    for (int64_t i = 0; i < N * nsb * 210; i++) w6[i] = (uint8_t)rand();
    for (int64_t i = 0; i < N * nsb * 144; i++) w4[i] = (uint8_t)rand();
    for (int64_t i = 0; i < N * nsb; i++) {    /* fp16 scales of 1.0: finite arithmetic */
        w6[i * 210 + 208] = 0, w6[i * 210 + 209] = 0x3c;
        w4[i * 144] = 0, w4[i * 144 + 1] = 0x3c, w4[i * 144 + 2] = 0, w4[i * 144 + 3] = 0x3c;
    }
    int16_t *xp = malloc(8 * K * sizeof(int16_t));
    float *dx = malloc(8 * K / 32 * sizeof(float)), *xs = malloc(8 * K / 32 * sizeof(float));
    for (int64_t i = 0; i < 8 * K; i++) xp[i] = (int16_t)(rand() % 65536 - 32768);
    for (int64_t i = 0; i < 8 * K / 32; i++) dx[i] = 1e-4f, xs[i] = 0.5f;
    const struct { const char *name; row_fn fn; const uint8_t *w; int64_t bytes; } cases[] = {
        {"Q6_K, 1 row ", q6k_1, w6, 210}, {"Q4_K, 1 row ", q4k_1, w4, 144},
        {"Q6_K, 4 rows", q6k_4, w6, 210}, {"Q4_K, 4 rows", q4k_4, w4, 144},
        {"Q6_K int8, 1 row ", q6k8_1, w6, 210}, {"Q4_K int8, 1 row ", q4k8_1, w4, 144},
        {"Q6_K int8, 4 rows", q6k8_4, w6, 210}, {"Q4_K int8, 4 rows", q4k8_4, w4, 144}};
    float out[8], sink = 0.f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint64_t best = ~0ull;
        for (int rep = 0; rep < 200; rep++) {
            const uint64_t t = __rdtsc();
            for (int64_t n = 0; n < N; n++) {
                cases[c].fn(out, xp, dx, xs, K, cases[c].w + n * nsb * cases[c].bytes);
                sink += out[0];
            }
            const uint64_t dt = __rdtsc() - t;
            if (dt < best) best = dt;
        }
        printf("%s: %.1f TSC cycles per super-block\n", cases[c].name, (double)best / (double)(N * nsb));
    }
    return sink == 12345.f;
}
