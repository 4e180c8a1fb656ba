/* Causal prefill attention over the paged KV cache for one CPU thread with AVX512-BF16
 * (Zen 4, Cooper Lake, Sapphire Rapids and later), bfloat16 cache, head_dim 64 or 128.
 *
 * Built and loaded by executor/attention/cpu_prefill_kernel.py (gcc -O3 -march=native,
 * without -ffast-math, cached on disk); plain C, no torch headers, called through ctypes.
 *
 * Shapes (all contiguous, bfloat16 unless said):
 *   q            (T, H, D)               the step's prefill tokens, request r's rows
 *                                        query_start[r] .. query_start[r + 1]
 *   key/value    (num_blocks, bs, KVH, D)
 *   block_table  (n, bt_stride)          int32, physical block of each logical block
 *   query_start  (n + 1,)                int32, rows of q (relative to q)
 *   seq_lens     (n,)                    int32, keys of each request (context + its chunk)
 *   out          (T, H, D)
 * Request r's query i sits at position ctx + i (ctx = seq_lens[r] - its query count) and
 * attends to keys 0 .. ctx + i (written to the cache before the call); query head j uses
 * kv head j / G, G = H / KVH.
 *
 * The decode kernel (cpu_paged_attention.c) reads every key once per query row; here a
 * tile of query rows shares each key it reads, as flash attention does (Dao et al.,
 * NeurIPS 2022: scores, an online softmax and the weighted values block by block of keys,
 * never the whole score matrix). A tile is RW = 48 rows of one kv head: QT = 48 / G
 * consecutive tokens of one request times its G query heads. Its queries are packed once
 * into pairs of features, 48 rows a step (the bfloat16 GEMM's weight panel), and every
 * block of KB keys then runs as two small GEMMs on VDPBF16PS:
 *   scores  S^T (keys x 48) = K (keys x D) . Qp: each key's feature pair broadcast straight
 *           from the cache (no copy of the keys), 8 keys x 48 rows of float32 sums in 24 zmm;
 *   values  O^T (D x 48) += Vp . Pp: the block's probabilities rounded to bfloat16 in pairs
 *           of keys (as ATen's CPU flash attention rounds them for bfloat16), the value rows
 *           interleaved in the same pairs, 8 features x 48 rows in 24 zmm.
 * The softmax runs in float32 along the rows of S^T (one lane per query row): the
 * running maximum, the rescaling of O^T and the sum of the probabilities.
 *
 * Key blocks start at absolute positions 0, KB, 2 KB, ... and a row's sums run over its own
 * keys in that order, whatever the tile, chunk or batch around it: masked keys (past a row's
 * position) add exact zeros. So a token's result depends on its own prefix only: chunked
 * and whole prefills, and any batch, give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RW 48 /* query rows of a tile: three zmm of float32 lanes */
#define KB 32 /* keys of a block */
#define MK 8  /* keys of one score micro-kernel */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

int32_t prefill_attention_available(void) { return 1; }

typedef struct {
    float *s;     /* (KB, RW) scores, then probabilities, of the key block */
    uint32_t *pp; /* (KB / 2, RW) probability pairs (bfloat16) */
    uint32_t *vp; /* (KB / 2, D) value pairs (bfloat16) */
    uint32_t *qp; /* (D / 2, RW) query pairs (bfloat16) */
    float *o;     /* (D, RW) the weighted values, unnormalised */
    float *m, *l; /* (RW,) running maximum and sum of each row */
    int32_t *pos; /* (RW,) position of each row (padding rows: the tile's last) */
} Scratch;

/* S^T rows t (nk <= 8 keys at krow[t]) = scale * K . Qp over DP feature pairs. */
static inline __attribute__((always_inline)) void scores_block(const int nk, const uint16_t *const *krow,
                                                              const uint32_t *qp, const int DP, float scale,
                                                              float *s) {
    __m512 acc[MK][3];
    for (int i = 0; i < nk; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < DP; p++) {
        const __m512i b0 = _mm512_load_si512(qp + p * RW), b1 = _mm512_load_si512(qp + p * RW + 16),
                      b2 = _mm512_load_si512(qp + p * RW + 32);
        for (int i = 0; i < nk; i++) {
            int32_t pair;
            memcpy(&pair, krow[i] + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, (__m512bh)b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, (__m512bh)b1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, (__m512bh)b2);
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int i = 0; i < nk; i++)
        for (int j = 0; j < 3; j++) _mm512_store_ps(s + i * RW + 16 * j, _mm512_mul_ps(acc[i][j], vs));
}

#define SCORES_CASE(n)                                                   \
    case n: scores_block(n, krow, qp, DP, scale, s); break;
static inline __attribute__((always_inline)) void scores(int nk, const uint16_t *const *krow, const uint32_t *qp,
                                                        const int DP, float scale, float *s) {
    switch (nk) { /* a constant key count keeps the accumulators in registers */
        SCORES_CASE(8) SCORES_CASE(7) SCORES_CASE(6) SCORES_CASE(5)
        SCORES_CASE(4) SCORES_CASE(3) SCORES_CASE(2) SCORES_CASE(1)
    }
}

/* O^T rows d0 .. d0 + 8 = alpha * O^T + Vp . Pp over np key pairs. */
static inline __attribute__((always_inline)) void values_block(const uint32_t *vp, const uint32_t *pp, int np,
                                                              const int D, int d0, const __m512 *alpha, float *o) {
    __m512 acc[8][3];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_mul_ps(_mm512_load_ps(o + (d0 + i) * RW + 16 * j), alpha[j]);
    for (int u = 0; u < np; u++) {
        const __m512i b0 = _mm512_load_si512(pp + u * RW), b1 = _mm512_load_si512(pp + u * RW + 16),
                      b2 = _mm512_load_si512(pp + u * RW + 32);
        for (int i = 0; i < 8; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)vp[u * D + d0 + i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, (__m512bh)b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, (__m512bh)b1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, (__m512bh)b2);
        }
    }
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 3; j++) _mm512_store_ps(o + (d0 + i) * RW + 16 * j, acc[i][j]);
}

/* 32 bfloat16 pairs (a[i], b[i]) of two rows' elements lo .. lo + 16 and lo + 16 .. lo + 32. */
static inline void interleave(const uint16_t *a, const uint16_t *b, uint32_t *dst, const __m512i *idx) {
    const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, idx[0], y));
    _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(x, idx[1], y));
}

/* e^x, lane by lane, to about 1 ulp (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
 * polynomial in r, scaled by 2^n); exactly 0 below -87.3 (masked keys, which are -inf: the
 * kernel is built without -ffast-math, so that no sum is reassociated). */
static inline __m512 exp512(__m512 x) {
    const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps((__mmask16)~zero, p, n);
}

/* The 16 bfloat16 (round to nearest even) of 16 floats, widened to the low halves of 32-bit lanes. */
static inline __m512i bf16_lanes(__m512 x) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

/* One tile: rows r = i * G + g (i < nt tokens from q row `row0`, g < G) of kv head h. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache, const int32_t *blocks, int64_t row0,
    int64_t pos0, int nt, int G, int64_t h, int64_t H, int64_t KVH, const int D, int64_t bs, float scale,
    uint16_t *out, Scratch *w, const __m512i *idx) {
    const int DP = D / 2, rows = nt * G;
    const int64_t row_stride = KVH * D, last = pos0 + nt - 1, nkeys = last + 1;
    /* the tile's queries as feature pairs, RW rows a step; padding rows zero */
    memset(w->qp, 0, sizeof(uint32_t) * (size_t)(DP * RW));
    for (int r = 0; r < rows; r++) {
        const uint32_t *src = (const uint32_t *)(q + ((row0 + r / G) * H + h * G + r % G) * D);
        for (int p = 0; p < DP; p++) w->qp[p * RW + r] = src[p];
    }
    for (int r = 0; r < RW; r++) {
        w->pos[r] = (int32_t)(r < rows ? pos0 + r / G : last);
        w->m[r] = -INFINITY; /* not a finite sentinel: scores below it would all weigh 0 */
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)(D * RW));
    __m512i posv[3];
    for (int j = 0; j < 3; j++) posv[j] = _mm512_loadu_si512(w->pos + 16 * j);
    const uint16_t *krow[KB], *vrow[KB];
    for (int64_t t0 = 0; t0 < nkeys; t0 += KB) {
        const int nk = nkeys - t0 < KB ? (int)(nkeys - t0) : KB;
        for (int t = 0; t < nk; t++) {
            const int64_t key = t0 + t, off = ((int64_t)blocks[key / bs] * bs + key % bs) * row_stride + h * D;
            krow[t] = key_cache + off;
            vrow[t] = value_cache + off;
        }
        for (int t = 0; t < nk; t += MK) scores(nk - t < MK ? nk - t : MK, krow + t, w->qp, DP, scale, w->s + t * RW);
        /* causal mask, the running maximum and its rescaling factor */
        __m512 mx[3], alpha[3], sum[3];
        for (int j = 0; j < 3; j++) mx[j] = _mm512_loadu_ps(w->m + 16 * j);
        const int masked = t0 + nk - 1 > pos0;
        for (int t = 0; t < nk; t++)
            for (int j = 0; j < 3; j++) {
                __m512 v = _mm512_load_ps(w->s + t * RW + 16 * j);
                if (masked) { /* keys past a row's position: -inf, weight exactly 0 */
                    const __mmask16 late = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(t0 + t)), posv[j]);
                    v = _mm512_mask_mov_ps(v, late, _mm512_set1_ps(-INFINITY));
                    _mm512_store_ps(w->s + t * RW + 16 * j, v);
                }
                mx[j] = _mm512_max_ps(mx[j], v);
            }
        for (int j = 0; j < 3; j++) { /* the first block: e^(-inf - max) = 0 */
            alpha[j] = exp512(_mm512_sub_ps(_mm512_loadu_ps(w->m + 16 * j), mx[j]));
            _mm512_storeu_ps(w->m + 16 * j, mx[j]);
            sum[j] = _mm512_setzero_ps();
        }
        /* probabilities, their sums in key order, and their bfloat16 pairs */
        for (int t = 0; t < nk; t++)
            for (int j = 0; j < 3; j++) {
                const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(w->s + t * RW + 16 * j), mx[j]));
                _mm512_store_ps(w->s + t * RW + 16 * j, e);
                sum[j] = _mm512_add_ps(sum[j], e);
            }
        for (int j = 0; j < 3; j++)
            _mm512_storeu_ps(w->l + 16 * j,
                             _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(w->l + 16 * j), alpha[j]), sum[j]));
        const int np = (nk + 1) / 2;
        for (int u = 0; u < np; u++)
            for (int j = 0; j < 3; j++) {
                const __m512i lo = bf16_lanes(_mm512_load_ps(w->s + 2 * u * RW + 16 * j));
                const __m512i hi = 2 * u + 1 < nk ? bf16_lanes(_mm512_load_ps(w->s + (2 * u + 1) * RW + 16 * j))
                                                  : _mm512_setzero_si512();
                _mm512_store_si512(w->pp + u * RW + 16 * j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        for (int u = 0; u < np; u++) {
            const uint16_t *a = vrow[2 * u];
            uint16_t zero[128];
            const uint16_t *b = 2 * u + 1 < nk ? vrow[2 * u + 1] : (memset(zero, 0, sizeof zero), zero);
            for (int c = 0; c < D; c += 32) interleave(a + c, b + c, w->vp + u * D + c, idx);
        }
        for (int d0 = 0; d0 < D; d0 += 8) values_block(w->vp, w->pp, np, D, d0, alpha, w->o);
    }
    /* out rows: O^T / l, rounded to bfloat16 */
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / w->l[r];
        uint16_t *dst = out + ((row0 + r / G) * H + h * G + r % G) * D;
        for (int d = 0; d < D; d += 16) {
            const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(d * RW + r),
                                                _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                                                    5, 4, 3, 2, 1, 0),
                                                                   _mm512_set1_epi32(RW)));
            const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(at, w->o, 4), _mm512_set1_ps(inv));
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

static __attribute__((noinline)) int attend(const uint16_t *q, const uint16_t *key_cache,
                                            const uint16_t *value_cache, const int32_t *block_table,
                                            int64_t bt_stride, const int32_t *query_start, const int32_t *seq_lens,
                                            uint16_t *out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                                            float scale) {
    const int G = (int)(H / KVH), QT = RW / G;
    const size_t floats = (size_t)(KB * RW + KB / 2 * RW + KB / 2 * D + D / 2 * RW + D * RW + 3 * RW);
    float *base = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    if (!base) return 1;
    Scratch w;
    w.s = base;
    w.o = w.s + KB * RW;
    w.pp = (uint32_t *)(w.o + D * RW);
    w.qp = w.pp + KB / 2 * RW;
    w.vp = w.qp + D / 2 * RW;
    w.m = (float *)(w.vp + KB / 2 * D);
    w.l = w.m + RW;
    w.pos = (int32_t *)(w.l + RW);
    __m512i idx[2]; /* a[i], b[i] for i in 0..15, then 16..31 */
    uint16_t lanes[2][32];
    for (int i = 0; i < 16; i++)
        for (int half = 0; half < 2; half++) {
            lanes[half][2 * i] = (uint16_t)(16 * half + i);
            lanes[half][2 * i + 1] = (uint16_t)(32 + 16 * half + i);
        }
    idx[0] = _mm512_loadu_si512(lanes[0]);
    idx[1] = _mm512_loadu_si512(lanes[1]);
    for (int64_t r = 0; r < n; r++) {
        const int64_t row_begin = query_start[r], qlen = query_start[r + 1] - row_begin, ctx = seq_lens[r] - qlen;
        const int32_t *blocks = block_table + r * bt_stride;
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t i0 = 0; i0 < qlen; i0 += QT) {
                const int nt = qlen - i0 < QT ? (int)(qlen - i0) : QT;
                if (D == 64)
                    tile(q, key_cache, value_cache, blocks, row_begin + i0, ctx + i0, nt, G, h, H, KVH, 64, bs, scale,
                         out, &w, idx);
                else
                    tile(q, key_cache, value_cache, blocks, row_begin + i0, ctx + i0, nt, G, h, H, KVH, 128, bs,
                         scale, out, &w, idx);
            }
    }
    free(base);
    return 0;
}

/* Returns 0; 1 when scratch memory could not be allocated; 2 for shapes this kernel does
 * not take (head_dim other than 64 or 128, more than 48 query heads a kv head). Runs with
 * denormals flushed to zero (the caller's MXCSR restored on return), as VDPBF16PS does. */
int paged_prefill_attention(const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache,
                            const int32_t *block_table, int64_t bt_stride, const int32_t *query_start,
                            const int32_t *seq_lens, uint16_t *out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                            int64_t bs, float scale) {
    if ((D != 64 && D != 128) || KVH < 1 || H % KVH != 0 || H / KVH > RW) return 2;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ */
    const int rc = attend(q, key_cache, value_cache, block_table, bt_stride, query_start, seq_lens, out, n, H, KVH,
                          D, bs, scale);
    _mm_setcsr(csr);
    return rc;
}

#else /* no AVX512-BF16 on the CPU this was built for: the library says so and does nothing */

int32_t prefill_attention_available(void) { return 0; }
int paged_prefill_attention(const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache,
                            const int32_t *block_table, int64_t bt_stride, const int32_t *query_start,
                            const int32_t *seq_lens, uint16_t *out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                            int64_t bs, float scale) {
    (void)q, (void)key_cache, (void)value_cache, (void)block_table, (void)bt_stride, (void)query_start;
    (void)seq_lens, (void)out, (void)n, (void)H, (void)KVH, (void)D, (void)bs, (void)scale;
    return 2;
}

#endif
