/* A whole decode step of the decoder stack, for a few tokens (one per sequence) and layers whose
 * linears all have a tf_qgemm layout (which may switch to tf_qbf16 or tf_qmadd from `big_from` rows, as
 * its plan does: decode steps of up to 64 rows): per layer
 *   h = norm(x); qkv = h Wqkv; [q/k norms per head]; RoPE + KV write; a = attention; a = a Wo;
 *   [a = norm(a)]; x += a;  h = norm(x); m = act(h Wgate_up) Wdown; [m = norm(m)]; x += m
 * with the library's kernels (rowwise.c, attention.c, qgemm.c and the rest), in one call instead of ~10
 * Python calls per layer. x [M, hidden] is the residual stream, updated in place. The arithmetic is the
 * Python path's, call for call. The KV pools are float32 or float16 (a layer's kv_half: tf_rope_write_kv_f16
 * and tf_paged_decode_attention_f16, as the layer path runs them for kv_cache_dtype="float16").
 * The bracketed steps run where the layer has those weights (NULL: Llama skips them); Gemma 3 has all
 * of them, `act` 1 (GeGLU) and sliding layers (window > 0) that read the step's second view: their own
 * KV pool's slots and block tables (engine/sliding_kv.py) and the local RoPE tables. NoPE layers (SmolLM3)
 * read the third: the global metadata with tables that rotate nothing. */
#include "common.h"

typedef struct {
    const void *q;
    const float *d, *m;
    int64_t gs, bits;
    int64_t big_from;      /* > 0: steps of at least this many rows run the plan's big-batch kernel on this
                            * layout, as the layer's plan does there: tf_qbf16 on a qtile layout ("qbf16"),
                            * tf_qmadd on a qgemm one ("qmadd"); 0: tf_qgemm at every row count */
} tf_qlin;

/* y [M, N] = x [M, K] through one linear of the stack, with the kernel its plan runs at M rows. */
static void tf_stack_linear(float *y, const float *x, int64_t M, int64_t K, int64_t N, const tf_qlin *L) {
    if (L->big_from > 0 && M >= L->big_from) {      /* the big-batch kernel of this layout */
        if (L->bits & TF_QTILE)
            tf_qbf16(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits & ~(int64_t)TF_QTILE);
        else
            tf_qmadd(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits);
    } else
        tf_qgemm(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits);
}

typedef struct tf_layer {
    const float *ln1, *ln2;
    tf_qlin qkv, o, gate_up, down;
    void *k_cache, *v_cache;                   /* float32 pools, or float16 ones where kv_half */
    const float *q_norm, *k_norm;              /* per-head RMSNorm weights of q and k (Qwen3, Gemma 3), or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* norms of the attention and MLP outputs (Gemma 3), or NULL */
    int64_t window;                            /* > 0: a sliding layer (view 1, its window only); 0: global */
    int64_t kv_half;                           /* 1: float16 pools (kv_cache_dtype="float16"; AVX2 builds, D % 64 == 0) */
    tf_qlin qkv_rest;                          /* with qkv_split > 0, qkv's rows from qkv_split on: a projection */
    int64_t qkv_split;                         /* stored in two block types (a Q4_K q/k, a Q6_K v); 0: one layout */
    int64_t nope;                              /* 1: no RoPE (SmolLM3): view 2, whose tables rotate nothing */
} tf_layer;

/* What a step's layers read besides their weights: where the new K/V go, the block tables, and RoPE. */
typedef struct tf_step_view {
    const int64_t *positions, *slots, *block_tables, *ctx_lens;
    int64_t bt_stride;
    const float *cos_t, *sin_t;
} tf_step_view;

enum { TF_ACT_SILU = 0, TF_ACT_GELU_TANH = 1 };

/* wide [M, N] = h [M, K] through the layer's qkv projection: one layout, or two row ranges of their own
 * (qkv_split). One row writes both parts in place; more go through a scratch copy per part. */
static void tf_stack_qkv(float *wide, const float *h, int64_t M, int64_t K, int64_t N, const tf_layer *L) {
    const int64_t s = L->qkv_split;
    if (s <= 0) {
        tf_stack_linear(wide, h, M, K, N, &L->qkv);
        return;
    }
    if (M == 1) {
        tf_stack_linear(wide, h, 1, K, s, &L->qkv);
        tf_stack_linear(wide + s, h, 1, K, N - s, &L->qkv_rest);
        return;
    }
    float *part = (float *)malloc(sizeof(float) * (size_t)(M * N));
    tf_stack_linear(part, h, M, K, s, &L->qkv);
    tf_stack_linear(part + M * s, h, M, K, N - s, &L->qkv_rest);
    for (int64_t t = 0; t < M; t++) {
        memcpy(wide + t * N, part + t * s, sizeof(float) * (size_t)s);
        memcpy(wide + t * N + s, part + M * s + t * (N - s), sizeof(float) * (size_t)(N - s));
    }
    free(part);
}

void tf_decode_layers(float *x, int64_t M, int64_t hidden, int64_t n_layers, const tf_layer *layers,
                      int64_t H, int64_t KVH, int64_t D, int64_t inter, float eps, int64_t act,
                      const tf_step_view *views, int64_t bs, float scale) {
    const int64_t qkv_n = (H + 2 * KVH) * D;
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    float *h = (float *)malloc(sizeof(float) * (size_t)(M * hidden));
    float *wide = (float *)malloc(sizeof(float) * (size_t)(M * widest));
    float *mid = (float *)malloc(sizeof(float) * (size_t)(M * (H * D > inter ? H * D : inter)));
    float *y = (float *)malloc(sizeof(float) * (size_t)(M * hidden));
    for (int64_t l = 0; l < n_layers; l++) {
        const tf_layer *L = layers + l;
        const tf_step_view *v = views + (L->window > 0 ? 1 : L->nope ? 2 : 0);
        tf_rms_norm(h, x, L->ln1, M, hidden, eps);
        tf_stack_qkv(wide, h, M, hidden, qkv_n, L);
        if (L->q_norm)      /* in place: each row's sum of squares is taken before it is written */
            for (int64_t t = 0; t < M; t++) {
                tf_rms_norm(wide + t * qkv_n, wide + t * qkv_n, L->q_norm, H, D, eps);
                tf_rms_norm(wide + t * qkv_n + H * D, wide + t * qkv_n + H * D, L->k_norm, KVH, D, eps);
            }
        if (L->kv_half) {     /* the same rotation; K/V stored rounded, widened to float32 as they are read */
            tf_rope_write_kv_f16(wide, M, qkv_n, H, KVH, D, v->positions, v->cos_t, v->sin_t,
                                 (uint16_t *)L->k_cache, (uint16_t *)L->v_cache, v->slots);
            tf_paged_decode_attention_f16(mid, wide, qkv_n, (const uint16_t *)L->k_cache, (const uint16_t *)L->v_cache,
                                          v->block_tables, v->bt_stride, v->ctx_lens, M, H, KVH, D, bs, scale,
                                          L->window);
        } else {
            tf_rope_write_kv(wide, M, qkv_n, H, KVH, D, v->positions, v->cos_t, v->sin_t, (float *)L->k_cache,
                             (float *)L->v_cache, v->slots);
            tf_paged_decode_attention(mid, wide, qkv_n, (const float *)L->k_cache, (const float *)L->v_cache,
                                      v->block_tables, v->bt_stride, v->ctx_lens, M, H, KVH, D, bs, scale, L->window);
        }
        tf_stack_linear(y, mid, M, H * D, hidden, &L->o);
        if (L->attn_out_norm) tf_rms_norm(y, y, L->attn_out_norm, M, hidden, eps);
        for (int64_t i = 0; i < M * hidden; i++) x[i] += y[i];
        tf_rms_norm(h, x, L->ln2, M, hidden, eps);
        tf_stack_linear(wide, h, M, hidden, 2 * inter, &L->gate_up);
        if (act == TF_ACT_GELU_TANH)
            tf_gelu_tanh_mul(mid, wide, M, inter);
        else
            tf_silu_mul(mid, wide, M, inter);
        tf_stack_linear(y, mid, M, inter, hidden, &L->down);
        if (L->mlp_out_norm) tf_rms_norm(y, y, L->mlp_out_norm, M, hidden, eps);
        for (int64_t i = 0; i < M * hidden; i++) x[i] += y[i];
    }
    free(h);
    free(wide);
    free(mid);
    free(y);
}
