/* Paged decode attention for one CPU thread: one query token per request, keys and
 * values read straight from the paged KV cache (no gather, no padding, no mask).
 *
 * Built and loaded by executor/attention/cpu_kernel.py (gcc -O3 -march=native
 * -ffast-math, cached on disk); plain C, no torch headers, called through ctypes.
 *
 * Shapes (all contiguous):
 *   q            (n, H, D)             float32 or bfloat16 (the model dtype)
 *   key/value    (num_blocks, bs, KVH, D)
 *   block_table  (n, bt_stride)        int32, physical block of each logical block
 *   seq_lens     (n,)                  int32, keys of each request (context + this token)
 *   out          (n, H, D)             same dtype as q
 * Query head j attends with kv head j / (H / KVH) (grouped-query attention, as
 * transformers' repeat_kv). Per (request, kv head): scores of the G = H / KVH query
 * heads against every key, a softmax in float32 (max subtracted), then the weighted
 * sum of the values, accumulated in float32. Each request's result depends on its
 * own keys only: batch-invariant.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(u >> 16); /* inf / nan kept */
    u += 0x7fffu + ((u >> 16) & 1u);                                   /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* The row of D elements at element offset `off` as float32 (a pointer into the cache,
 * or `tmp` filled from bfloat16). */
static inline const float *row(const void *base, int64_t off, int64_t D, int bf16, float *tmp) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_load(src[d]);
    return tmp;
}

/* Returns 0, or 1 when scratch memory could not be allocated. Each token's keys (and
 * values) of all kv heads are one contiguous row of KVH * D elements, read once. */
int paged_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                           const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out,
                           int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int bf16) {
    const int64_t G = H / KVH, row_stride = KVH * D, block_stride = bs * KVH * D;
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++)
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
    float *scores = malloc(sizeof(float) * (size_t)(H * max_len + 2 * H * D + row_stride));
    if (!scores) return 1;
    float *qs = scores + H * max_len, *acc = qs + H * D, *tmp = acc + H * D;
    for (int64_t r = 0; r < n; r++) {
        const int64_t L = seq_lens[r];
        const int32_t *blocks = block_table + r * bt_stride;
        const int64_t q_off = r * H * D;
        for (int64_t i = 0; i < H * D; i++)
            qs[i] = scale * (bf16 ? bf16_load(((const uint16_t *)q)[q_off + i]) : ((const float *)q)[q_off + i]);
        for (int64_t t = 0; t < L; t++) {
            const float *k = row(key_cache, blocks[t / bs] * block_stride + (t % bs) * row_stride, row_stride, bf16,
                                 tmp);
            for (int64_t j = 0; j < H; j++) {
                const float *qj = qs + j * D, *kj = k + (j / G) * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qj[d] * kj[d];
                scores[j * L + t] = dot;
            }
        }
        for (int64_t j = 0; j < H; j++) {
            float *s = scores + j * L, m = s[0], sum = 0.0f;
            for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < L; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < L; t++) s[t] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t t = 0; t < L; t++) {
            const float *v = row(value_cache, blocks[t / bs] * block_stride + (t % bs) * row_stride, row_stride, bf16,
                                 tmp);
            for (int64_t j = 0; j < H; j++) {
                const float p = scores[j * L + t], *vj = v + (j / G) * D;
                float *a = acc + j * D;
                for (int64_t d = 0; d < D; d++) a[d] += p * vj[d];
            }
        }
        for (int64_t i = 0; i < H * D; i++) {
            if (bf16)
                ((uint16_t *)out)[q_off + i] = bf16_store(acc[i]);
            else
                ((float *)out)[q_off + i] = acc[i];
        }
    }
    free(scores);
    return 0;
}
