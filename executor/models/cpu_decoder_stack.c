/* The decoder layers of a Llama-family model over one step whose every token is a row of
 * the CPU decode-attention kernel (a decode-only step, or a step of short prefill chunks
 * run as token rows), in one call instead of ~12 Python-level calls a layer.
 *
 * It calls the very kernels the eager layers call, through function pointers the caller
 * takes from their libraries (cpu_gemm.c or cpu_gemm_bf16.c, cpu_fused.c,
 * cpu_paged_attention.c), in the eager order, on the same inputs, so its results are
 * bitwise the eager path's (executor/models/llama.py):
 *
 *     h = norm1(x, residual)          add_rms_norm: residual += x (none at layer 0), h = rms(residual) * w
 *     qkv = h Wqkv^T (+ b)            the GEMM kernel
 *     rotate q and k heads in place   rotary_inplace
 *     cache[slot] = k, v              the rows copied (index_copy_)
 *     a = attention(q)                paged_decode_attention over each token's block_table row
 *     o = a Wo^T (+ b)
 *     h = norm2(o, residual)
 *     x = silu_mul(h Wgu^T) Wdown^T
 *
 * The float32 GEMM kernel takes no bias: it is added after, one float32 add an element, as
 * `y.add_(bias)` does. What the eager path spends between these calls (module calls,
 * argument checks, views, fresh tensors: ~7 ms of a ~24 ms bfloat16 step at one request on
 * a Zen 4 core) is gone; the kernels' own time is the same. */
#include <stdint.h>
#include <string.h>

typedef int32_t (*gemm_bf16_fn)(const void *x, int64_t m, int64_t k, int64_t ldx, const void *bp, int64_t n,
                                const void *bias, void *y, int64_t ldy);
typedef int32_t (*gemm_f32_fn)(const void *x, int64_t m, int64_t k, int64_t ldx, const void *bp, int64_t n,
                               void *y, int64_t ldy);
typedef void (*norm_fn)(const void *x, void *residual, const void *weight, void *out, int64_t n, int64_t hidden,
                        float eps, int32_t lanes);
typedef void (*rotary_fn)(void *x, int64_t row_stride, int64_t n, int64_t heads, int64_t D, const void *cos_,
                          const void *sin_);
typedef void (*silu_fn)(const void *gate_up, void *out, int64_t n, int64_t inter);
typedef int32_t (*gemm_silu_fn)(const void *x, int64_t m, int64_t k, int64_t ldx, const void *bp, int64_t inter,
                                const void *bias, const float *table, void *y, int64_t ldy);
typedef int (*attention_fn)(const void *q, const void *key_cache, const void *value_cache,
                            const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out,
                            int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int bf16);

/* The kernels, the dtype and the model's geometry (one per model). */
typedef struct {
    void *gemm;            /* gemm_bf16_fn when bf16, else gemm_f32_fn */
    norm_fn norm;
    rotary_fn rotary;
    silu_fn silu;
    attention_fn attention;
    gemm_silu_fn gemm_silu;  /* NULL, or the GEMM that applies silu to the gate_up panels it packs */
    const float *silu_table; /* gemm_silu's table (cpu_fused.c's silu_bf16_table) */
    int64_t bf16, lanes;   /* lanes: cpu_fused's summation lanes */
    int64_t hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
} Stack;

/* One layer's parameters (the packed panels of its GEMMs, NULL biases where it has none)
 * and its KV caches, (num_blocks, block_size, kv_heads, head_dim) each. */
typedef struct {
    const void *norm1, *qkv, *qkv_bias, *o, *o_bias, *norm2, *gate_up, *gate_up_bias, *down, *down_bias;
    void *key_cache, *value_cache;
} Layer;

static int gemm(const Stack *s, const void *x, int64_t m, int64_t k, const void *bp, int64_t n, const void *bias,
                void *y) {
    if (s->bf16) return ((gemm_bf16_fn)s->gemm)(x, m, k, k, bp, n, bias, y, n);
    const int32_t rc = ((gemm_f32_fn)s->gemm)(x, m, k, k, bp, n, y, n);
    if (!rc && bias) {
        float *out = y;
        const float *b = bias;
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) out[r * n + j] += b[j];
    }
    return rc;
}

/* Runs `num_layers` layers over `n` tokens. `x` (n, hidden): the previous layer's MLP output,
 * or the embeddings when `has_residual` is 0 (the model's first layer); overwritten with the
 * last layer's MLP output. `residual` (n, hidden): the residual stream, updated in place; when
 * `has_residual` is 0 it starts as a copy of `x`. `cos`, `sin` (n, head_dim / 2) in the model
 * dtype; `slot_mapping` (n,) int64; `block_table` (rows of `bt_stride` int32) and `seq_lens`
 * (n,) int32: each token's block table row and key count; `scratch`: stack_scratch_bytes(n)
 * bytes. Returns 0, or 1 when a kernel could not allocate its scratch memory. */
int decoder_stack(const Stack *s, const Layer *layers, int64_t num_layers, void *x, void *residual,
                  int32_t has_residual, int64_t n, const void *cos_, const void *sin_, const int64_t *slot_mapping,
                  const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *scratch) {
    const int64_t e = s->bf16 ? 2 : 4, H = s->heads, KVH = s->kv_heads, D = s->head_dim, hid = s->hidden;
    const int64_t qkv_n = (H + 2 * KVH) * D, row = KVH * D;
    char *h = scratch, *qkv = h + n * hid * e, *q = qkv + n * qkv_n * e, *a = q + n * H * D * e;
    char *gate_up = a + n * H * D * e, *act = gate_up + n * 2 * s->inter * e;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        if (l == 0 && !has_residual) {
            memcpy(residual, x, (size_t)(n * hid * e));
            s->norm(NULL, residual, L->norm1, h, n, hid, s->eps, (int32_t)s->lanes);
        } else {
            s->norm(x, residual, L->norm1, h, n, hid, s->eps, (int32_t)s->lanes);
        }
        if (gemm(s, h, n, hid, L->qkv, qkv_n, L->qkv_bias, qkv)) return 1;
        s->rotary(qkv, qkv_n, n, H + KVH, D, cos_, sin_);
        char *kc = L->key_cache, *vc = L->value_cache;
        for (int64_t r = 0; r < n; r++) {
            const char *src = qkv + r * qkv_n * e;
            memcpy(q + r * H * D * e, src, (size_t)(H * D * e));
            memcpy(kc + slot_mapping[r] * row * e, src + H * D * e, (size_t)(row * e));
            memcpy(vc + slot_mapping[r] * row * e, src + (H + KVH) * D * e, (size_t)(row * e));
        }
        if (s->attention(q, kc, vc, block_table, bt_stride, seq_lens, a, n, H, KVH, D, s->block_size, s->scale,
                         (int)s->bf16))
            return 1;
        if (gemm(s, a, n, H * D, L->o, hid, L->o_bias, x)) return 1;
        s->norm(x, residual, L->norm2, h, n, hid, s->eps, (int32_t)s->lanes);
        if (s->gemm_silu) { /* the gate and up outputs never written: bitwise the two calls below */
            if (s->gemm_silu(h, n, hid, hid, L->gate_up, s->inter, L->gate_up_bias, s->silu_table, act, s->inter))
                return 1;
        } else {
            if (gemm(s, h, n, hid, L->gate_up, 2 * s->inter, L->gate_up_bias, gate_up)) return 1;
            s->silu(gate_up, act, n, s->inter);
        }
        if (gemm(s, act, n, s->inter, L->down, hid, L->down_bias, x)) return 1;
    }
    return 0;
}

/* Bytes of `decoder_stack`'s scratch for n tokens. */
int64_t stack_scratch_bytes(const Stack *s, int64_t n) {
    const int64_t e = s->bf16 ? 2 : 4;
    return n * e * (s->hidden + (s->heads + 2 * s->kv_heads) * s->head_dim + 2 * s->heads * s->head_dim +
                    3 * s->inter);
}
