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
 * Query head j attends with kv head j / G, G = H / KVH (grouped-query attention, as
 * transformers' repeat_kv). Per request: scores of every query head against every key,
 * a softmax in float32 (max subtracted), then the weighted sum of the values,
 * accumulated in float32. Keys and values are walked token-major, block by block
 * (no division per token), four tokens at a time: each row of all kv heads is read
 * once, and four independent dot products (or four values in one sum) keep the
 * multiply-adds from waiting on each other (a single running sum per dot product was
 * latency-bound: 1.9x slower on one AVX2 core with the rows in cache, and 1.7x in
 * bfloat16, `python -m meshserve.bench.cpu_attention`). Each request's result depends
 * on its own keys only: batch-invariant. A prompt's tokens, each a row over its own prefix
 * (the torch backend's token rows), come as runs of rows with one key more each over the
 * same blocks: on the AVX512-BF16 path up to RUN_ROWS of them are computed together, each
 * row's sums unchanged (run_bf16). Where the CPU also has AMX-BF16, that path's scores are
 * multiplied on AMX tiles (qk_amx), decodes and runs alike; its softmax, on every such CPU, is
 * vectorised with its own exponential (softmax_rows_avx512). A 150-token prompt's token rows
 * over 30 layers: 11.4 -> 7.2 ms on one Sapphire Rapids core (300 tokens: 38.5 -> 21.6 ms); a
 * decode step of 32 requests of 300 keys: 20.7 -> 19.3 ms (the three interleaved, minima of 21).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
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

/* The D elements at element offset `off` as float32 (a pointer into the cache, or
 * `tmp` filled from bfloat16). */
static inline const float *row(const void *base, int64_t off, int64_t D, int bf16, float *restrict tmp) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_load(src[d]);
    return tmp;
}

/* The next request's key and value rows, prefetched into L2 while this request
 * computes, a few lines at a time (`prefetch_step`, called `steps` times over the
 * request: one slice per query head of each group of rows, so the misses are spread
 * over the request's compute instead of arriving in bursts that fill the miss queues
 * and stall it).
 * A request's rows are scattered over the cache in blocks, so the hardware
 * prefetcher, which follows one stream, stalls at every block edge; with the 30
 * layers' keys and values read from memory each decode step those stalls were most
 * of the kernel's time. Prefetching the next block into L1, 48 lines at once, cut a
 * step's attention from ~48 to ~38 ms (32 requests of ~150 tokens, one AVX2 core);
 * the next request into L2, spread, from there by another ~24% (the 30 layers from a
 * 1 GiB cache on huge pages: 32.0 -> 24.4 ms; with every row already in L2 it costs
 * 10.7 -> 11.7 ms; `reports/cpu-speed/`). Prefetches never fault. */
typedef struct {
    const char *key_cache, *value_cache;
    const int32_t *blocks; /* the next request's block table row, NULL for none */
    int64_t num_blocks, block_bytes, block, offset, lines_per_step;
} Prefetcher;

static inline Prefetcher prefetcher(const void *key_cache, const void *value_cache, const int32_t *blocks,
                                    int64_t next_len, int64_t steps, int64_t bs, int64_t block_bytes) {
    Prefetcher p = {(const char *)key_cache, (const char *)value_cache, blocks, 0, block_bytes, 0, 0, 0};
    if (!blocks || next_len <= 0) return p;
    p.num_blocks = (next_len + bs - 1) / bs;
    const int64_t lines = 2 * p.num_blocks * (block_bytes / 64);
    p.lines_per_step = steps > 0 ? (lines + steps - 1) / steps : lines;
    return p;
}

static inline void prefetch_step(Prefetcher *p) {
    for (int64_t left = 64 * p->lines_per_step; left > 0 && p->block < 2 * p->num_blocks;) {
        const int64_t b = p->block < p->num_blocks ? p->block : p->block - p->num_blocks;
        const char *base = (p->block < p->num_blocks ? p->key_cache : p->value_cache) + (int64_t)p->blocks[b] * p->block_bytes;
        const int64_t end = p->offset + left < p->block_bytes ? p->offset + left : p->block_bytes;
        for (int64_t i = p->offset; i < end; i += 64) __builtin_prefetch(base + i, 0, 1); /* prefetcht2: into L2 */
        left -= end - p->offset;
        if (end < p->block_bytes) p->offset = end;
        else p->offset = 0, p->block++;
    }
}

/* Scores of the query head `qj` (D) against the keys k0..k3 (D each), four independent
 * sums so the multiply-adds of different keys overlap instead of waiting on each other. */
static inline __attribute__((always_inline)) void dot4(const float *restrict qj, const float *restrict k0,
                                                       const float *restrict k1, const float *restrict k2,
                                                       const float *restrict k3, int64_t D, float *restrict s) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        s0 += qj[d] * k0[d];
        s1 += qj[d] * k1[d];
        s2 += qj[d] * k2[d];
        s3 += qj[d] * k3[d];
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

static inline __attribute__((always_inline)) float dot1(const float *restrict a, const float *restrict b, int64_t D) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* acc (D) += p0 v0 + p1 v1 + p2 v2 + p3 v3. */
static inline __attribute__((always_inline)) void axpy4(float *restrict acc, const float *restrict p,
                                                        const float *restrict v0, const float *restrict v1,
                                                        const float *restrict v2, const float *restrict v3,
                                                        int64_t D) {
    const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
    for (int64_t d = 0; d < D; d++) acc[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d]);
}

static inline __attribute__((always_inline)) void axpy1(float *restrict acc, float p, const float *restrict v,
                                                        int64_t D) {
    for (int64_t d = 0; d < D; d++) acc[d] += p * v[d];
}

/* Each of the H rows of L scores in place: its softmax in float32, the row's maximum
 * subtracted first. */
static inline void softmax_rows(float *restrict scores, int64_t H, int64_t L) {
    for (int64_t j = 0; j < H; j++) {
        float *s = scores + j * L, mx = s[0], sum = 0.0f;
        for (int64_t i = 1; i < L; i++) mx = s[i] > mx ? s[i] : mx;
        for (int64_t i = 0; i < L; i++) {
            s[i] = expf(s[i] - mx);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < L; i++) s[i] *= inv;
    }
}

/* One request: the H query heads `qs` (H, D), already scaled, over its L keys in
 * `blocks`; the result (H, D) in `acc`; `scores` holds H * L floats, `tmp` 4 rows of
 * KVH * D floats (bfloat16 rows converted). Keys and values are walked token-major,
 * block by block, four tokens at a time: each row of all kv heads is read once. */
static inline __attribute__((always_inline)) void one_request(
    const float *restrict qs, const void *key_cache, const void *value_cache, const int32_t *blocks, int64_t L,
    int64_t H, int64_t KVH, int64_t D, int64_t bs, int bf16, float *restrict scores, float *restrict acc,
    float *restrict tmp, Prefetcher *ahead) {
    const int64_t G = H / KVH, row_stride = KVH * D, block_stride = bs * row_stride;
    const float *r[4];
    for (int64_t t = 0, b = 0; t < L; b++) {
        const int64_t base = (int64_t)blocks[b] * block_stride, count = L - t < bs ? L - t : bs;
        for (int64_t o = 0; o < count; o += 4) {
            const int64_t m = count - o < 4 ? count - o : 4;
            for (int64_t i = 0; i < m; i++)
                r[i] = row(key_cache, base + (o + i) * row_stride, row_stride, bf16, tmp + i * row_stride);
            for (int64_t j = 0; j < H; j++) {
                prefetch_step(ahead);
                const float *qj = qs + j * D;
                const int64_t kv = (j / G) * D;
                float *s = scores + j * L + t + o;
                if (m == 4)
                    dot4(qj, r[0] + kv, r[1] + kv, r[2] + kv, r[3] + kv, D, s);
                else
                    for (int64_t i = 0; i < m; i++) s[i] = dot1(qj, r[i] + kv, D);
            }
        }
        t += count;
    }
    softmax_rows(scores, H, L);
    memset(acc, 0, sizeof(float) * (size_t)(H * D));
    for (int64_t t = 0, b = 0; t < L; b++) {
        const int64_t base = (int64_t)blocks[b] * block_stride, count = L - t < bs ? L - t : bs;
        for (int64_t o = 0; o < count; o += 4) {
            const int64_t m = count - o < 4 ? count - o : 4;
            for (int64_t i = 0; i < m; i++)
                r[i] = row(value_cache, base + (o + i) * row_stride, row_stride, bf16, tmp + i * row_stride);
            for (int64_t j = 0; j < H; j++) {
                prefetch_step(ahead);
                const int64_t kv = (j / G) * D;
                const float *p = scores + j * L + t + o;
                if (m == 4)
                    axpy4(acc + j * D, p, r[0] + kv, r[1] + kv, r[2] + kv, r[3] + kv, D);
                else
                    for (int64_t i = 0; i < m; i++) axpy1(acc + j * D, p[i], r[i] + kv, D);
            }
        }
        t += count;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* A bfloat16 cache on a CPU with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and
 * later), D a multiple of 32. Scores: `vdpbf16ps` multiplies the query's bfloat16
 * pairs by the key's (each product exact in float32) and adds them into float32 sums,
 * 32 elements an instruction, no conversion; 16 keys' sums are reduced together
 * (`hsum16`), and the score is scaled after the dot product (the other path scales
 * the query first: a rounding apart). Values: each bfloat16 row widened in registers
 * and accumulated in float32 into the G heads of its group at once, so a row is read
 * and widened once per group of heads. 2.3x the other path on one Zen 4 core (one
 * layer of 32 decodes of ~150 keys in cache; about 1.4x over 30 layers from memory)
 * (`python -m meshserve.bench.cpu_attention --dtype bfloat16`). */
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* Lane i of the result: the sum of v[i]'s 16 lanes (pairs, then quads inside the
 * 128-bit lanes, then across them: 45 instructions for 16 sums). */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 c[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *w = v + 4 * g;
        const __m512d a =
            _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1])));
        const __m512d b =
            _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3])));
        c[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

/* e^x, 16 lanes, for x <= 0 (a softmax's scores less their maximum; results below 2^-126
 * are flushed to 0 where MXCSR says so, as in the kernel; a NaN stays NaN, so a NaN key still
 * makes its rows NaN): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two, Cody-Waite), e^r
 * by Cephes expf's polynomial (S. L. Moshier, Cephes Math Library, expf.c), 2^n by
 * VSCALEFPS; within 1.26 ulp of the exact e^x (every float in [-88, 0] with a normal
 * result checked). Every row's every score goes through it the same way: a score's value
 * depends on it and its row's maximum only. */
static inline __attribute__((always_inline)) __m512 exp_nonpositive(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-104.0f); /* (a compare, not VMAXPS, which would turn NaN into -104) */
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ), lowest);
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
    return _mm512_scalef_ps(p, n);
}

/* softmax_rows on 16 lanes (the bfloat16 path's: every row of a run and every decode alike):
 * each row's maximum, e^(s - max) (exp_nonpositive) and their sum over lanes, the last partial
 * vector masked, the sum's lanes added by a fixed tree, then the row times 1 / sum. The rows go
 * in phases, up to 32 at a time (every row's maximum, then every row's exponentials, then
 * every row scaled), so that one row's reductions overlap the next's instead of waiting:
 * 1.5-2x the scalar loop with libmvec's expf (which took its last scores one at a time). */
static inline void softmax_rows_avx512(float *restrict scores, int64_t H, int64_t L) {
    const __mmask16 tail = (__mmask16)((1u << (L % 16)) - 1);
    const int64_t whole = L / 16 * 16;
    float mxs[32], invs[32];
    for (int64_t j0 = 0; j0 < H; j0 += 32) {
        const int64_t rows = H - j0 < 32 ? H - j0 : 32;
        for (int64_t j = 0; j < rows; j++) {
            const float *s = scores + (j0 + j) * L;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t i = 0; i < whole; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
            if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + whole));
            mxs[j] = _mm512_reduce_max_ps(mx);
        }
        for (int64_t j = 0; j < rows; j++) {
            float *s = scores + (j0 + j) * L;
            const __m512 vmx = _mm512_set1_ps(mxs[j]);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < whole; i += 16) {
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
                _mm512_storeu_ps(s + i, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (tail) {
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), vmx));
                _mm512_mask_storeu_ps(s + whole, tail, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
            }
            invs[j] = 1.0f / _mm512_reduce_add_ps(sum);
        }
        for (int64_t j = 0; j < rows; j++) {
            float *s = scores + (j0 + j) * L;
            const __m512 inv = _mm512_set1_ps(invs[j]);
            for (int64_t i = 0; i < whole; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
            if (tail) _mm512_mask_storeu_ps(s + whole, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + whole), inv));
        }
    }
}

static inline __attribute__((always_inline)) __m512bh load_bh(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* scores[j * L + t] = scale * q_j . k_t for every head j and key t, for R rows of one request
 * whose keys are the first L0, L0 + 1, ..., L0 + R - 1 of the same blocks (a prompt's tokens as
 * rows; R = 1: one row): row r's query at q + r * H * D, its scores at scores + r * s_stride
 * (j * L + t, L = L0 + r). Each row gets the sums it gets alone; the loops are turned so that a
 * group of 16 keys is read from L2 once for the R rows. */
static inline __attribute__((always_inline)) void qk_bf16(
    const uint16_t *restrict q, int64_t R, const uint16_t *keys, const int32_t *restrict blocks, int64_t L0,
    int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *restrict scores, int64_t s_stride,
    Prefetcher *ahead) {
    const int64_t G = H / KVH, row_stride = KVH * D, block_stride = bs * row_stride, C = D / 32, Lmax = L0 + R - 1;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t = 0, b = 0; t < Lmax; b++) {
        const uint16_t *block = keys + (int64_t)blocks[b] * block_stride;
        const int64_t span = Lmax - t < bs ? Lmax - t : bs;
        for (int64_t o = 0; o < span; o += 16)
            for (int64_t r = 0; r < R; r++) {
                const int64_t L = L0 + r, count = L - t < bs ? L - t : bs;
                if (o >= count) continue;  /* past this row's keys */
                const int64_t m = count - o < 16 ? count - o : 16;
                for (int64_t j = 0; j < H; j++) {
                    prefetch_step(ahead);
                    const uint16_t *k = block + o * row_stride + (j / G) * D;
                    __m512bh qv[8];
                    for (int64_t c = 0; c < C; c++) qv[c] = load_bh(q + r * H * D + j * D + 32 * c);
                    __m512 acc[16];
                    for (int i = 0; i < 16; i++) {
                        acc[i] = _mm512_setzero_ps();
                        if (i < m)
                            for (int64_t c = 0; c < C; c++)
                                acc[i] = _mm512_dpbf16_ps(acc[i], qv[c], load_bh(k + i * row_stride + 32 * c));
                    }
                    _mm512_mask_storeu_ps(scores + r * s_stride + j * L + t + o, (__mmask16)((1u << m) - 1),
                                          _mm512_mul_ps(hsum16(acc), vscale));
                }
            }
        t += span;
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* On a CPU with AMX-BF16 (Sapphire Rapids and later) the scores come from AMX tiles instead:
 * for each kv head, C = K Q^T with 16 keys a tile's rows (an A tile of 16 keys x 32 of their
 * features, read straight from the cache block) and 16 query columns a B tile (the row's query
 * heads of that kv head, over the run's rows, copied once a call into the pair-interleaved
 * layout TDPBF16PS reads). TDPBF16PS (Intel SDM, "Intel AMX") adds each score's products in
 * order over its features into one float32 sum, whatever else shares the tile: a row's score of
 * a key is the same sequence of operations whether the row is a decode or one of a prompt's
 * run, and whichever keys and rows fill the tile's other lanes. The tile of sums (16 keys x 16
 * columns) is turned in registers (transpose16) into the rows' scores, times the scale. The
 * rows' bits differ from the VDPBF16PS path's (another order of the same float32 additions), on
 * every row alike. At a decode the keys come from memory and the tiles save little (1.07x); in
 * a 150-token prompt's token rows the scores took 45% of the kernel's time, and the scores with
 * all but the softmax and the values' sums now take 33% (parts of a copy removed in turn). */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_QK 1

/* r[i] (16 rows of 16 floats) transposed in place: r[n] lane i = the old r[i] lane n. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* 1 once the kernel may use AMX tiles (Linux hands their state to a process that asks:
 * arch_prctl ARCH_REQ_XCOMP_PERM), 0 where it may not: asked once. */
static int amx_permitted(void) {
    static int state = -1; /* threads that race here all ask, and all get the same answer */
    int known = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (known < 0) {
        known = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&state, known, __ATOMIC_RELAXED);
    }
    return known;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) { /* tiles 0-4 of 16 rows x 64 bytes: A, B and three C */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    __asm__ volatile("" : : "m"(cfg)); /* the whole struct is read (see cpu_gemm_amx.c) */
    _tile_loadconfig(&cfg);
}

/* The B tiles of kv head h for R rows: column n = r * G + jj (query head h * G + jj of row r),
 * tile ct, feature block kc: 16 rows of 16 feature pairs, b[((ct * C + kc) * 16 + p) * 16 + n]
 * the pair 16 kc + p of column 16 ct + n (zero past the R * G columns). */
static void pack_queries(const uint16_t *restrict q, int64_t R, int64_t H, int64_t G, int64_t D, int64_t h,
                         uint32_t *restrict b) {
    const int64_t C = D / 32, cols = R * G, tiles = (cols + 15) / 16;
    for (int64_t ct = 0; ct < tiles; ct++)
        for (int64_t kc = 0; kc < C; kc++) { /* 16 columns' 16 pairs each, turned (bits moved, not computed) */
            __m512 rows[16];
            for (int64_t n = 0; n < 16; n++) {
                const int64_t col = ct * 16 + n, r = col / G, j = h * G + col % G;
                rows[n] = col < cols ? _mm512_loadu_ps((const float *)(q + r * H * D + j * D + 32 * kc))
                                     : _mm512_setzero_ps();
            }
            transpose16(rows);
            for (int64_t p = 0; p < 16; p++) _mm512_storeu_ps((float *)(b + ((ct * C + kc) * 16 + p) * 16), rows[p]);
        }
}

/* Scores of one group of 16 keys (rows of `keys`, row stride `ld` elements) against the column
 * tiles ct0.. (nct <= 3) of b, into c (nct tiles of 16 keys x 16 columns). Tiles: 0 A, 1 B,
 * 2-4 C. */
static inline void amx_group(const uint16_t *keys, int64_t ld, const uint32_t *b, int64_t C, int64_t ct0, int nct,
                             float *c) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    for (int64_t kc = 0; kc < C; kc++) {
        _tile_loadd(0, keys + 32 * kc, ld * 2);
        _tile_loadd(1, b + ((ct0 * C + kc) * 16) * 16, 64);
        _tile_dpbf16ps(2, 0, 1);
        if (nct > 1) {
            _tile_loadd(1, b + (((ct0 + 1) * C + kc) * 16) * 16, 64);
            _tile_dpbf16ps(3, 0, 1);
        }
        if (nct > 2) {
            _tile_loadd(1, b + (((ct0 + 2) * C + kc) * 16) * 16, 64);
            _tile_dpbf16ps(4, 0, 1);
        }
    }
    _tile_stored(2, c, 64);
    if (nct > 1) _tile_stored(3, c + 256, 64);
    if (nct > 2) _tile_stored(4, c + 512, 64);
}

/* qk_bf16's contract, on AMX tiles (the tiles configured: amx_configure): scores[r * s_stride +
 * j * L + t] = scale * q_j . k_t, L = L0 + r. `b` holds the packed queries (pack_queries: one kv
 * head's ceil(R * G / 16) * D / 32 tiles), `pad` 16 rows of D for a group of keys that would
 * run past its block. */
static inline __attribute__((always_inline)) void qk_amx(
    const uint16_t *restrict q, int64_t R, const uint16_t *keys, const int32_t *restrict blocks, int64_t L0,
    int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *restrict scores, int64_t s_stride,
    Prefetcher *ahead, uint32_t *restrict b, uint16_t *restrict pad) {
    const int64_t G = H / KVH, row_stride = KVH * D, block_stride = bs * row_stride, C = D / 32, Lmax = L0 + R - 1;
    const int64_t tiles = (R * G + 15) / 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    float c[3 * 256] __attribute__((aligned(64)));
    for (int64_t h = 0; h < KVH; h++) {
        pack_queries(q, R, H, G, D, h, b);
        for (int64_t t = 0, blk = 0; t < Lmax; blk++) {
            const uint16_t *block = keys + (int64_t)blocks[blk] * block_stride + h * D;
            const int64_t span = Lmax - t < bs ? Lmax - t : bs;
            for (int64_t o = 0; o < span; o += 16) {
                for (int64_t j = 0; j < G; j++) prefetch_step(ahead);
                const uint16_t *k = block + o * row_stride;
                int64_t ld = row_stride;
                if (o + 16 > bs) { /* the group would read past its block: its rows copied */
                    const int64_t m = span - o < 16 ? span - o : 16;
                    memset(pad, 0, sizeof(uint16_t) * (size_t)(16 * D));
                    for (int64_t i = 0; i < m; i++) memcpy(pad + i * D, k + i * row_stride, sizeof(uint16_t) * (size_t)D);
                    k = pad, ld = D;
                }
                for (int64_t ct = 0; ct < tiles; ct += 3) {
                    const int nct = tiles - ct < 3 ? (int)(tiles - ct) : 3;
                    amx_group(k, ld, b, C, ct, nct, c);
                    for (int q2 = 0; q2 < nct; q2++) {
                        const int64_t n0 = (ct + q2) * 16, live = R * G - n0 < 16 ? R * G - n0 : 16;
                        __m512 col[16]; /* the tile turned: column n the lanes of col[n] */
                        for (int i = 0; i < 16; i++) col[i] = _mm512_load_ps(c + q2 * 256 + 16 * i);
                        transpose16(col);
                        for (int64_t n = 0; n < live; n++) {
                            const int64_t r = (n0 + n) / G, j = h * G + (n0 + n) % G, L = L0 + r;
                            const int64_t count = L - t < bs ? L - t : bs;
                            if (o >= count) continue; /* past this row's keys */
                            const int64_t m = count - o < 16 ? count - o : 16;
                            _mm512_mask_storeu_ps(scores + r * s_stride + j * L + t + o, (__mmask16)((1u << m) - 1),
                                                  _mm512_mul_ps(col[n], vscale));
                        }
                    }
                }
            }
            t += span;
        }
    }
}
#endif

static inline __attribute__((always_inline)) __m512 widen_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* acc[j] (D floats) = sum over keys t of probs[j * L + t] v_t, for the NJ heads j0.. of
 * kv head h: NJ * D / 16 float32 accumulators held in registers over the whole walk. */
static inline __attribute__((always_inline)) void pv_heads(
    const float *restrict probs, const uint16_t *values, const int32_t *restrict blocks, int64_t L, int64_t KVH,
    int64_t D, int64_t bs, int64_t h, int64_t j0, const int NJ, float *restrict acc, Prefetcher *ahead) {
    const int64_t row_stride = KVH * D, block_stride = bs * row_stride, C = D / 16;
    __m512 a[4][16];
    for (int jj = 0; jj < NJ; jj++)
        for (int64_t c = 0; c < C; c++) a[jj][c] = _mm512_setzero_ps();
    for (int64_t t = 0, b = 0; t < L; b++) {
        const uint16_t *row = values + (int64_t)blocks[b] * block_stride + h * D;
        const int64_t count = L - t < bs ? L - t : bs;
        for (int64_t i = 0; i < count; i++, row += row_stride) {
            prefetch_step(ahead);
            __m512 v[16];
            for (int64_t c = 0; c < C; c++) v[c] = widen_bf16(row + 16 * c);
            for (int jj = 0; jj < NJ; jj++) {
                const __m512 p = _mm512_set1_ps(probs[(j0 + jj) * L + t + i]);
                for (int64_t c = 0; c < C; c++) a[jj][c] = _mm512_fmadd_ps(p, v[c], a[jj][c]);
            }
        }
        t += count;
    }
    for (int jj = 0; jj < NJ; jj++)
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(acc + (j0 + jj) * D + 16 * c, a[jj][c]);
}

/* pv_heads for two rows of one request, the second with one key more (L and L + 1 keys of
 * the same blocks), D = 64, NJ <= 3 heads (24 accumulators): each value row is read and widened
 * once for both rows; each accumulator gets the multiply-adds pv_heads gives it, in its order
 * (the second row's last key after the others). */
static inline __attribute__((always_inline)) void pv_heads_2rows(
    const float *restrict pa, const float *restrict pb, const uint16_t *values, const int32_t *restrict blocks,
    int64_t L, int64_t KVH, int64_t bs, int64_t h, int64_t j0, const int NJ, float *restrict acc_a,
    float *restrict acc_b) {
    const int64_t D = 64, C = 4, row_stride = KVH * D, block_stride = bs * row_stride, Lb = L + 1;
    __m512 a[3][4], b[3][4];
    for (int jj = 0; jj < NJ; jj++)
        for (int64_t c = 0; c < C; c++) a[jj][c] = b[jj][c] = _mm512_setzero_ps();
    for (int64_t t = 0, blk = 0; t < Lb; blk++) {
        const uint16_t *row = values + (int64_t)blocks[blk] * block_stride + h * D;
        const int64_t count = Lb - t < bs ? Lb - t : bs;
        for (int64_t i = 0; i < count; i++, row += row_stride) {
            __m512 v[4];
            for (int64_t c = 0; c < C; c++) v[c] = widen_bf16(row + 16 * c);
            const int both = t + i < L;
            for (int jj = 0; jj < NJ; jj++) {
                if (both) {
                    const __m512 p = _mm512_set1_ps(pa[(j0 + jj) * L + t + i]);
                    for (int64_t c = 0; c < C; c++) a[jj][c] = _mm512_fmadd_ps(p, v[c], a[jj][c]);
                }
                const __m512 p = _mm512_set1_ps(pb[(j0 + jj) * Lb + t + i]);
                for (int64_t c = 0; c < C; c++) b[jj][c] = _mm512_fmadd_ps(p, v[c], b[jj][c]);
            }
        }
        t += count;
    }
    for (int jj = 0; jj < NJ; jj++)
        for (int64_t c = 0; c < C; c++) {
            _mm512_storeu_ps(acc_a + (j0 + jj) * D + 16 * c, a[jj][c]);
            _mm512_storeu_ps(acc_b + (j0 + jj) * D + 16 * c, b[jj][c]);
        }
}

static inline void pv_bf16_2rows(const float *restrict pa, const float *restrict pb, const uint16_t *values,
                                 const int32_t *restrict blocks, int64_t L, int64_t H, int64_t KVH, int64_t bs,
                                 float *restrict acc_a, float *restrict acc_b) {
    const int64_t G = H / KVH;
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t j0 = h * G; j0 < (h + 1) * G; j0 += 3) {
            const int64_t nj = (h + 1) * G - j0 < 3 ? (h + 1) * G - j0 : 3;
            switch (nj) {
            case 3: pv_heads_2rows(pa, pb, values, blocks, L, KVH, bs, h, j0, 3, acc_a, acc_b); break;
            case 2: pv_heads_2rows(pa, pb, values, blocks, L, KVH, bs, h, j0, 2, acc_a, acc_b); break;
            default: pv_heads_2rows(pa, pb, values, blocks, L, KVH, bs, h, j0, 1, acc_a, acc_b); break;
            }
        }
}

/* Heads a register block: 16 accumulators of 16 floats hold 4 heads of 64. */
static inline int64_t pv_block(int64_t D) { return D <= 64 ? 4 : D <= 128 ? 2 : 1; }

static inline __attribute__((always_inline)) void pv_bf16(
    const float *restrict probs, const uint16_t *values, const int32_t *restrict blocks, int64_t L, int64_t H,
    int64_t KVH, int64_t D, int64_t bs, float *restrict acc, Prefetcher *ahead) {
    const int64_t G = H / KVH, JB = pv_block(D);
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t j0 = h * G; j0 < (h + 1) * G; j0 += JB) {
            const int64_t nj = (h + 1) * G - j0 < JB ? (h + 1) * G - j0 : JB;
            switch (nj) { /* a constant head count keeps the accumulators in registers */
            case 4: pv_heads(probs, values, blocks, L, KVH, D, bs, h, j0, 4, acc, ahead); break;
            case 3: pv_heads(probs, values, blocks, L, KVH, D, bs, h, j0, 3, acc, ahead); break;
            case 2: pv_heads(probs, values, blocks, L, KVH, D, bs, h, j0, 2, acc, ahead); break;
            default: pv_heads(probs, values, blocks, L, KVH, D, bs, h, j0, 1, acc, ahead); break;
            }
        }
}

/* prefetch_step calls of one request on this path. */
static inline int64_t bf16_dot_steps(int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t bs) {
    const int64_t G = H / KVH, JB = pv_block(D), groups = (L / bs) * ((bs + 15) / 16) + ((L % bs) + 15) / 16;
    return groups * H + L * KVH * ((G + JB - 1) / JB);
}

/* Most rows of a run (consecutive tokens of one request, as a prompt's rows come) taken
 * together: each group of 16 keys, and each value row, is then read once for all of them
 * (qk_bf16, pv_bf16_2rows) instead of once a row, with the sums each row gets alone: the
 * same bits. 1.6x the rows one by one for a 150-token prompt's 30 layers in bfloat16 on one
 * Sapphire Rapids core (the two kernels interleaved; `python -m
 * meshserve.bench.cpu_prefill_attention` times the token rows). */
#define RUN_ROWS 16

/* The rows r, r + 1, ... of one run: seq_lens one more each and the same blocks (each row's
 * own blocks equal to row r's), at most RUN_ROWS. */
static int64_t run_length(const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, int64_t n,
                          int64_t r, int64_t bs) {
    const int64_t L = seq_lens[r];
    int64_t R = 1;
    if (L < 1) return 1; /* no keys: the one-row path's answer (an engine's rows have one at least) */
    while (R < RUN_ROWS && r + R < n && seq_lens[r + R] == L + R &&
           memcmp(block_table + (r + R) * bt_stride, block_table + r * bt_stride,
                  sizeof(int32_t) * (size_t)((L + R + bs - 1) / bs)) == 0)
        R++;
    return R;
}

/* R rows of one run (q: R rows of H x D; row i has L0 + i keys of `blocks`; R = 1: one row)
 * into out (R rows of H x D, bfloat16): scores (R * H * (L0 + R - 1) floats), acc and acc2
 * (H * D floats each); `ahead` prefetches the next request meanwhile. */
static inline __attribute__((always_inline)) void run_bf16_dot(
    const uint16_t *restrict q, int64_t R, const void *key_cache, const void *value_cache, const int32_t *blocks,
    int64_t L0, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *restrict scores,
    float *restrict acc, float *restrict acc2, uint16_t *restrict out, Prefetcher *ahead, uint32_t *restrict b,
    uint16_t *restrict pad) {
    const int64_t s_stride = H * (L0 + R - 1);
#ifdef HAVE_AMX_QK
    if (b)
        qk_amx(q, R, key_cache, blocks, L0, H, KVH, D, bs, scale, scores, s_stride, ahead, b, pad);
    else
#endif
        qk_bf16(q, R, key_cache, blocks, L0, H, KVH, D, bs, scale, scores, s_stride, ahead);
    (void)b, (void)pad;
    for (int64_t i = 0; i < R; i++) softmax_rows_avx512(scores + i * s_stride, H, L0 + i);
    for (int64_t i = 0; i < R;) {
        float *sc = scores + i * s_stride;
        if (D == 64 && i + 1 < R) {
            pv_bf16_2rows(sc, sc + s_stride, value_cache, blocks, L0 + i, H, KVH, bs, acc, acc2);
            for (int64_t e = 0; e < H * D; e++) out[i * H * D + e] = bf16_store(acc[e]);
            for (int64_t e = 0; e < H * D; e++) out[(i + 1) * H * D + e] = bf16_store(acc2[e]);
            i += 2;
        } else {
            pv_bf16(sc, value_cache, blocks, L0 + i, H, KVH, D, bs, acc, ahead);
            for (int64_t e = 0; e < H * D; e++) out[i * H * D + e] = bf16_store(acc[e]);
            i += 1;
        }
    }
}

static void run_bf16(const uint16_t *restrict q, int64_t R, const void *key_cache, const void *value_cache,
                     const int32_t *blocks, int64_t L0, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
                     float *restrict scores, float *restrict acc, float *restrict acc2, uint16_t *restrict out,
                     Prefetcher *ahead, uint32_t *restrict b, uint16_t *restrict pad) {
    if (D == 64) /* a constant head size lets the compiler unroll */
        run_bf16_dot(q, R, key_cache, value_cache, blocks, L0, H, KVH, 64, bs, scale, scores, acc, acc2, out, ahead, b,
                     pad);
    else if (D == 128)
        run_bf16_dot(q, R, key_cache, value_cache, blocks, L0, H, KVH, 128, bs, scale, scores, acc, acc2, out,
                     ahead, b, pad);
    else
        run_bf16_dot(q, R, key_cache, value_cache, blocks, L0, H, KVH, D, bs, scale, scores, acc, acc2, out, ahead, b,
                     pad);
}
#endif

/* Frees the AMX scratch `b` (NULL: none), the tiles released with it. */
static void release_tiles(uint32_t *b) {
#ifdef HAVE_AMX_QK
    if (b) _tile_release();
#endif
    free(b);
}

/* One call's work; not inlined, so that no float work moves across the MXCSR writes
 * around its call. Returns 0, or 1 when scratch memory could not be allocated. */
static __attribute__((noinline)) int attend(
    const void *q, const void *key_cache, const void *value_cache, const int32_t *block_table, int64_t bt_stride,
    const int32_t *seq_lens, void *out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
    int bf16) {
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++)
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
    float *scores = malloc(sizeof(float) * (size_t)(H * max_len + 2 * H * D + 4 * KVH * D));
    if (!scores) return 1;
    float *qs = scores + H * max_len, *acc = qs + H * D, *tmp = acc + H * D;
#ifdef HAVE_BF16_DOT
    float *run_scores = NULL; /* a run's scores (run_bf16), grown as needed */
    int64_t run_floats = 0;
#endif
    uint32_t *tiles_b = NULL; /* AMX: one kv head's packed queries of a run, then a key group's pad */
    uint16_t *tiles_pad = NULL;
#ifdef HAVE_AMX_QK
    if (bf16 && D % 32 == 0 && D <= 256 && amx_permitted()) {
        const int64_t tiles = (RUN_ROWS * (H / KVH) + 15) / 16;
        tiles_b = aligned_alloc(64, (size_t)((tiles * (D / 32) * 1024 + 32 * D + 63) / 64 * 64));
        if (!tiles_b) {
            free(scores);
            return 1;
        }
        tiles_pad = (uint16_t *)(tiles_b + tiles * (D / 32) * 256);
        amx_configure();
    }
#endif
    for (int64_t r = 0; r < n; r++) {
        const int64_t L = seq_lens[r], q_off = r * H * D;
        const int32_t *blocks = block_table + r * bt_stride;
        const int64_t elem = bf16 ? 2 : 4, block_bytes = bs * KVH * D * elem;
        const int32_t *next_blocks = r + 1 < n ? block_table + (r + 1) * bt_stride : NULL;
        const int64_t next_len = r + 1 < n ? seq_lens[r + 1] : 0;
#ifdef HAVE_BF16_DOT
        if (bf16 && D % 32 == 0 && D <= 256) { /* one row, or a run of them (run_length) */
            const int64_t R = run_length(block_table, bt_stride, seq_lens, n, r, bs);
            float *sc = scores; /* one row: H * max_len floats */
            if (R > 1) {
                const int64_t need = R * H * (L + R - 1);
                if (need > run_floats) {
                    float *grown = realloc(run_scores, sizeof(float) * (size_t)need);
                    if (!grown) {
                        free(run_scores), free(scores);
                        release_tiles(tiles_b);
                        return 1;
                    }
                    run_scores = grown, run_floats = need;
                }
                sc = run_scores;
            }
            /* a run prefetches nothing: its rows share their blocks, read by its first row */
            Prefetcher ahead = R > 1 ? prefetcher(key_cache, value_cache, NULL, 0, 0, bs, 0)
                                     : prefetcher(key_cache, value_cache, next_blocks, next_len,
                                                  bf16_dot_steps(L, H, KVH, D, bs), bs, block_bytes);
            /* qs: the sums of a row pair's second row (the queries are read in bfloat16) */
            run_bf16((const uint16_t *)q + q_off, R, key_cache, value_cache, blocks, L, H, KVH, D, bs, scale, sc,
                     acc, qs, (uint16_t *)out + q_off, &ahead, tiles_b, tiles_pad);
            r += R - 1;
            continue;
        }
#endif
        {
            Prefetcher ahead = prefetcher(key_cache, value_cache, next_blocks, next_len, 2 * ((L + 3) / 4) * H, bs,
                                          block_bytes);
            for (int64_t i = 0; i < H * D; i++)
                qs[i] = scale * (bf16 ? bf16_load(((const uint16_t *)q)[q_off + i]) : ((const float *)q)[q_off + i]);
            if (D == 64) /* a constant head size lets the compiler unroll the dot products */
                one_request(qs, key_cache, value_cache, blocks, L, H, KVH, 64, bs, bf16, scores, acc, tmp, &ahead);
            else if (D == 128)
                one_request(qs, key_cache, value_cache, blocks, L, H, KVH, 128, bs, bf16, scores, acc, tmp, &ahead);
            else
                one_request(qs, key_cache, value_cache, blocks, L, H, KVH, D, bs, bf16, scores, acc, tmp, &ahead);
        }
        for (int64_t i = 0; i < H * D; i++) {
            if (bf16)
                ((uint16_t *)out)[q_off + i] = bf16_store(acc[i]);
            else
                ((float *)out)[q_off + i] = acc[i];
        }
    }
#ifdef HAVE_BF16_DOT
    free(run_scores);
#endif
    release_tiles(tiles_b);
    free(scores);
    return 0;
}

/* 1 where a bfloat16 cache's scores are multiplied on AMX tiles (qk_amx), else 0. */
int paged_attention_scores_on_amx(void) {
#ifdef HAVE_AMX_QK
    return amx_permitted();
#else
    return 0;
#endif
}

/* Returns 0, or 1 when scratch memory could not be allocated. Runs with denormals
 * flushed to zero (the caller's MXCSR restored on return): softmax weights below 1e-38
 * add nothing, and on some CPUs each denormal operand costs a slow microcode assist. */
int paged_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                           const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out,
                           int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int bf16) {
#if defined(__SSE__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ */
#endif
    const int rc = attend(q, key_cache, value_cache, block_table, bt_stride, seq_lens, out, n, H, KVH, D, bs, scale,
                          bf16);
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
    return rc;
}
