// The bfloat16 GEMM of the linear layers on AMX tiles: y[m, n] = x[m, k] . W[n, k]^T (+ bias[n]),
// bfloat16 in and out, float32 sums, one thread, on cpu_gemm_bf16.c's panels (the same packing,
// pack_weight_bf16: per panel of NR = 48 columns, ceil(k / 2) steps of 48 column pairs).
//
// A panel step of 16 feature pairs is three AMX B tiles of 16 pairs x 16 columns (the panel's
// rows of 192 bytes, read 64 bytes apart); 16 input rows x 32 features are an A tile, read
// straight from x. TDPBF16PS (Intel SDM, "Intel AMX") adds each output's 16 pairs of products
// to its float32 sum; the output tiles go over the feature blocks in order, the features past
// the last whole block of 16 pairs (k = 576: 4 pairs) are added after them by VDPBF16PS, then
// the bias in float32, then one rounding to bfloat16. Each output's sum is so one fixed
// sequence of operations over its row and column, whatever m is or where its row falls among
// the tiles: batch-invariant by construction, as cpu_gemm_bf16.c (not bitwise equal to it: its
// chain adds one pair at a time).
//
// Blocking (the idea of oneDNN's AMX brgemm kernels, in our own code): two row tiles (32 rows) by one panel
// at a time, six C tiles, the A and B tiles loaded into one register each in an order that
// reuses each load once (7 loads for 6 TDPBF16PS; a lone last row tile takes 1 A by 3 B).
// Panels go in pairs, both for the same 32 rows before the outputs are written, so a row's
// 96 outputs are 192 bytes: three whole cache lines, each written once by one 64-byte store.
// (One panel's 96 bytes left half lines that were read from memory for ownership and written
// back twice: at 2,048 rows the writes took a third of the time. Non-temporal stores, which
// skip that read, made the GEMM alone faster still but the next op slower: it reads them back.)
//
// The loops are cpu_gemm_bf16.c's: input rows in chunks of at most 512 KiB, and for each chunk
// every panel pair once, its row tiles inner, so the pair stays in L2 across them and the
// weights stream from memory once per chunk, in order: while the first row tiles multiply a
// block, the one PREFETCH_AHEAD bytes on is prefetched, which keeps a steady stream of requests
// in flight at decode sizes (without it, 8-150 rows ran up to 1.4x slower whenever the host's
// memory was busy; the whole next panel prefetched at once, as the kernel once did, made 1-8
// rows 10% slower than no prefetch). Rows past the last 16 go through a zero-padded copy of
// them (and every row when k is odd, to pad its last pair). Linux hands AMX's tile state to a process only
// when it asks (arch_prctl ARCH_REQ_XCOMP_PERM): gemm_amx_available() asks.
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NR 48
#define TR 16     // rows of a tile
#define TPAIRS 16 // feature pairs of a tile (64 bytes a row)
#define CW (2 * NR) // columns of a panel pair: the row stride of the sums
#define A_CHUNK_BYTES (512 * 1024)
#define PREFETCH_AHEAD (12 * 1024) // 4 blocks of a panel ahead (tried: 6 and 12 KiB best, 24 and 48 slower)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int32_t gemm_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(void) {  // eight tiles of 16 rows x 64 bytes
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = TR;
        cfg.colsb[t] = 64;
    }
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of cfg: at -O1 and -Os it kept
    // only those of the zeroing above, and LDTILECFG faulted on the rest. The whole of it is read here.
    __asm__ volatile("" : : "m"(cfg));
    _tile_loadconfig(&cfg);
}

static inline __m512 widen(__m256i bf16) {  // 16 bfloat16 -> 16 float32, exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// The panel's lines PREFETCH_AHEAD bytes past block bk (3 KiB: one block's), into L1: past a
// panel's end they are the next one's (the panels lie one after another), past the weight's end
// nothing (a prefetch never faults).
static inline void ahead(const uint16_t *bk) {
    const char *p = (const char *)bk + PREFETCH_AHEAD;
    for (int line = 0; line < TPAIRS * NR * 4 / 64; line++) _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

// The float32 sums of the whole feature blocks of 16 rows of a (row stride lda elements) with
// one panel b, into c (16 x 48, row stride CW floats; zeros when there are none, k < 32);
// prefetch: the rows' first tiles (see ahead). Tiles: 0 A, 1-3 B, 4-6 C.
static void sums_one(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t blocks, float *c, int prefetch) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint16_t *bk = b + kb * TPAIRS * NR * 2;
        if (prefetch) ahead(bk);
        _tile_loadd(0, a + kb * TPAIRS * 2, lda * 2);
        _tile_loadd(1, bk, NR * 4);
        _tile_loadd(2, bk + 32, NR * 4);
        _tile_loadd(3, bk + 64, NR * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3);
    }
    _tile_stored(4, c, CW * 4);
    _tile_stored(5, c + 16, CW * 4);
    _tile_stored(6, c + 32, CW * 4);
}

// The same for 32 rows: a0's 16 and a1's 16 (each with its row stride), into c (32 x 48, row
// stride CW). Tiles: 0 A (a0's or a1's block), 1 B (one of the three), 2-4 C of a0's rows,
// 5-7 of a1's. Each block: B0 a0 a1 | B1 a0 | B2 a1, each output's block added once, in order.
static void sums_two(const uint16_t *a0, int64_t lda0, const uint16_t *a1, int64_t lda1, const uint16_t *b,
                     int64_t blocks, float *c, int prefetch) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint16_t *bk = b + kb * TPAIRS * NR * 2;
        if (prefetch) ahead(bk);
        _tile_loadd(1, bk, NR * 4);
        _tile_loadd(0, a0 + kb * TPAIRS * 2, lda0 * 2);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(0, a1 + kb * TPAIRS * 2, lda1 * 2);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, bk + 32, NR * 4);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(0, a0 + kb * TPAIRS * 2, lda0 * 2);
        _tile_dpbf16ps(3, 0, 1);
        _tile_loadd(1, bk + 64, NR * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(0, a1 + kb * TPAIRS * 2, lda1 * 2);
        _tile_dpbf16ps(7, 0, 1);
    }
    float *c1 = c + TR * CW;
    _tile_stored(2, c, CW * 4);
    _tile_stored(3, c + 16, CW * 4);
    _tile_stored(4, c + 32, CW * 4);
    _tile_stored(5, c1, CW * 4);
    _tile_stored(6, c1 + 16, CW * 4);
    _tile_stored(7, c1 + 32, CW * 4);
}

// Which of a row's six 16-column sums are live for `cols` (<= 96) columns: mask j its columns
// 16 j.. that exist.
static inline void live_masks(int64_t cols, __mmask16 live[6]) {
    for (int j = 0; j < 6; j++) {
        int64_t left = cols - 16 * j;
        live[j] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
}

// Row a_row's float32 sums over panel b0's columns, then b1's (b1 NULL: one panel), from its sums
// c_row of the whole feature blocks: the tail pairs past them added by VDPBF16PS, in order.
static inline __attribute__((always_inline)) void row_sums(const float *c_row, const uint16_t *a_row,
                                                           int64_t blocks, int64_t kp, const uint16_t *b0,
                                                           const uint16_t *b1, const __mmask16 live[6],
                                                           __m512 acc[6]) {
    for (int j = 0; j < 6; j++)  // a lone last panel leaves the second's sums unwritten: not read
        acc[j] = live[j] ? _mm512_load_ps(c_row + 16 * j) : _mm512_setzero_ps();
    for (int64_t kk = blocks * TPAIRS; kk < kp; kk++) {
        uint32_t pair;
        memcpy(&pair, a_row + 2 * kk, 4);
        __m512bh ai = (__m512bh)_mm512_set1_epi32((int)pair);
        const uint16_t *bk = b0 + kk * NR * 2;  // (indices known when compiled: acc stays in registers)
        acc[0] = _mm512_dpbf16_ps(acc[0], ai, (__m512bh)_mm512_loadu_si512(bk));
        acc[1] = _mm512_dpbf16_ps(acc[1], ai, (__m512bh)_mm512_loadu_si512(bk + 32));
        acc[2] = _mm512_dpbf16_ps(acc[2], ai, (__m512bh)_mm512_loadu_si512(bk + 64));
        if (b1) {
            bk = b1 + kk * NR * 2;
            acc[3] = _mm512_dpbf16_ps(acc[3], ai, (__m512bh)_mm512_loadu_si512(bk));
            acc[4] = _mm512_dpbf16_ps(acc[4], ai, (__m512bh)_mm512_loadu_si512(bk + 32));
            acc[5] = _mm512_dpbf16_ps(acc[5], ai, (__m512bh)_mm512_loadu_si512(bk + 64));
        }
    }
}

// The bias of `cols` columns as six float32 vectors (zeros past them, or none: NULL).
static inline void bias_vectors(const uint16_t *bias, const __mmask16 live[6], __m512 add[6]) {
    for (int j = 0; j < 6; j++)
        add[j] = bias ? widen(_mm256_maskz_loadu_epi16(live[j], bias + 16 * j)) : _mm512_setzero_ps();
}

// The row's 96 outputs (two 16-column halves a 64-byte store) under the live masks.
static inline void store_row(uint16_t *y_row, const __m256i out[6], const __mmask16 live[6]) {
    for (int j = 0; j < 6; j += 2) {
        __mmask32 mask = (__mmask32)live[j] | (__mmask32)live[j + 1] << 16;
        if (!mask) break;
        __m512i pair = _mm512_inserti64x4(_mm512_castsi256_si512(out[j]), out[j + 1], 1);
        _mm512_mask_storeu_epi16(y_row + 16 * j, mask, pair);
    }
}

// rows x cols (cols <= 96: panel b0's, then b1's; b1 NULL: one panel) outputs from the sums c
// (row stride CW): the tail pairs of a's rows by VDPBF16PS, the bias, one rounding, then
// 32 outputs (64 bytes) a store.
static void finish(const float *c, const uint16_t *a, int64_t lda, int64_t blocks, int64_t kp, const uint16_t *b0,
                   const uint16_t *b1, const uint16_t *bias, int64_t cols, uint16_t *y, int64_t ldy, int64_t rows) {
    __m512 add[6];
    __mmask16 live[6];
    live_masks(cols, live);
    bias_vectors(bias, live, add);
    for (int64_t i = 0; i < rows; i++) {
        __m512 acc[6];
        __m256i out[6];
        row_sums(c + i * CW, a + i * lda, blocks, kp, b0, b1, live, acc);
        for (int j = 0; j < 6; j++) out[j] = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j], add[j]));
        store_row(y + i * ldy, out, live);
    }
}

// bf16_store of cpu_fused.c on 16 lanes: round to nearest even (infinities stay), every NaN
// the one 0x7fc0, as torch's bfloat16 conversion (not VCVTNEPS2BF16, which flushes denormals to
// zero and keeps a NaN's sign: the product below must round as silu_mul_bf16 rounds it).
static inline __m256i round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000)),
                              _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

// rows x cols (cols <= 96) outputs of SiLU(gate) * up from the gate sums cg (panels g0, g1) and
// the up sums cu (panels u0, u1), each row stride CW: each gate and up output as finish makes it
// (tail pairs, bias, one rounding to bfloat16), then cpu_fused.c's silu_mul_bf16 on them:
// bf16(table[gate's bits] * up), table its silu_bf16_table (bf16(silu(g)) for every bfloat16 g).
static void finish_silu(const float *cg, const float *cu, const uint16_t *a, int64_t lda, int64_t blocks,
                        int64_t kp, const uint16_t *g0, const uint16_t *g1, const uint16_t *u0, const uint16_t *u1,
                        const uint16_t *bias_g, const uint16_t *bias_u, const float *table, int64_t cols,
                        uint16_t *y, int64_t ldy, int64_t rows) {
    __m512 add_g[6], add_u[6];
    __mmask16 live[6];
    live_masks(cols, live);
    bias_vectors(bias_g, live, add_g);
    bias_vectors(bias_u, live, add_u);
    for (int64_t i = 0; i < rows; i++) {
        __m512 gate[6], up[6];
        __m256i out[6];
        row_sums(cg + i * CW, a + i * lda, blocks, kp, g0, g1, live, gate);
        row_sums(cu + i * CW, a + i * lda, blocks, kp, u0, u1, live, up);
        for (int j = 0; j < 6; j++) {
            __m256i g = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(gate[j], add_g[j]));
            __m256i u = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(up[j], add_u[j]));
            __m512 silu = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live[j], _mm512_cvtepu16_epi32(g), table, 4);
            out[j] = round_bf16(_mm512_mul_ps(silu, widen(u)));
        }
        store_row(y + i * ldy, out, live);
    }
}

// Asks for the output lines of rows x cols (2 bytes each) of y for writing (PREFETCHW), before the
// sums that fill them: the reads for ownership of lines no cache holds (a long prefill's outputs)
// overlap the multiplications instead of stalling the stores (2,048 rows: 1.06-1.10x; level at
// 150-512; at 32 rows and fewer, where y stays in cache, not done).
static inline void claim(uint16_t *y, int64_t ldy, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t byte = 0; byte < cols * 2; byte += 64)
            _mm_prefetch((const char *)(y + i * ldy) + byte, _MM_HINT_ET0);
}

static _Thread_local uint16_t *pad;  // the last rows, zero-padded to TR, with an even k: grown once per thread
static _Thread_local int64_t pad_elems;

// Row tile t's first row and its row stride (*ld): in a (row stride lda) below row `whole`, else
// the zero-padded tail in pad (row stride kp pairs).
static inline const uint16_t *tile_rows(const uint16_t *a, int64_t lda, int64_t whole, int64_t kp, int64_t t,
                                        int64_t *ld) {
    *ld = t * TR < whole ? lda : kp * 2;
    return t * TR < whole ? a + t * TR * lda : pad;
}

// The sums of one row tile (a0) or two (a1 too) with panel b into c (see sums_one, sums_two).
static inline void pass_sums(const uint16_t *a0, int64_t lda0, const uint16_t *a1, int64_t lda1, int two_tiles,
                             const uint16_t *b, int64_t blocks, float *c, int prefetch) {
    if (two_tiles)
        sums_two(a0, lda0, a1, lda1, b, blocks, c, prefetch);
    else
        sums_one(a0, lda0, b, blocks, c, prefetch);
}

// The GEMM of packed_gemm_bf16_amx (table NULL) or of packed_gemm_silu_bf16_amx (table its SiLU
// table): n output columns, 96 a step (a panel pair; with the table, its gate pair then its up
// pair, the four panels of one group).
static int32_t gemm_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                        const uint16_t *bias, const float *table, uint16_t *y, int64_t ldy) {
    int64_t kp = (k + 1) / 2, blocks = kp / TPAIRS, full = m / TR * TR, panel = kp * NR * 2;
    int64_t tiles = (m + TR - 1) / TR, steps = (n + CW - 1) / CW;
    if (m <= 0) return 0;
    int odd = k % 2 != 0;  // the last pair would read past a row: every row copied with a zero feature
    int padded = kp > 0 && (m > full || odd);  // no features (k = 0): nothing to pad, pad may be NULL
    if (padded) {
        int64_t need = (odd ? tiles * TR : TR) * kp * 2;
        if (pad_elems < need) {
            free(pad);
            pad = aligned_alloc(64, (size_t)((need * 2 + 63) / 64 * 64));
            pad_elems = pad ? need : 0;
            if (!pad) return -1;
        }
    }
    // the rows of whole tiles read from a (x, or all of them from pad when k is odd), the rest from pad
    const uint16_t *a = x;
    int64_t lda = ldx, whole = full;
    if (odd && padded) {  // rare, not a model's shape
        memset(pad, 0, (size_t)(tiles * TR * kp * 4));
        for (int64_t i = 0; i < m; i++) memcpy(pad + i * kp * 2, x + i * ldx, (size_t)(k * 2));
        a = pad;
        lda = kp * 2;
        whole = tiles * TR;
    } else if (padded) {  // the last rows, zero-padded to a tile
        memset(pad, 0, (size_t)(TR * kp * 4));
        for (int64_t i = full; i < m; i++) memcpy(pad + (i - full) * kp * 2, x + i * ldx, (size_t)(k * 2));
    }
    // row tiles in chunks of at most A_CHUNK_BYTES of input (an even count), so a chunk's rows stay in L2
    int64_t chunk = A_CHUNK_BYTES / (4 * (kp > 0 ? kp : 1)) / (2 * TR) * 2;
    if (chunk < 2) chunk = 2;
    float c[2][2 * TR * CW] __attribute__((aligned(64)));  // the sums of 32 rows x a panel pair (and the up pair)
    configure();
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
        int64_t t1 = t0 + chunk < tiles ? t0 + chunk : tiles;
        for (int64_t step = 0; step < steps; step++) {
            int64_t col0 = step * CW, cols = n - col0 < CW ? n - col0 : CW;
            int two_panels = cols > NR;
            const uint16_t *b0 = bp + (table ? 4 : 2) * step * panel, *u0 = table ? b0 + 2 * panel : NULL;
            const uint16_t *b1 = two_panels ? b0 + panel : NULL, *u1 = two_panels && table ? u0 + panel : NULL;
            const uint16_t *bias_g = bias ? bias + col0 : NULL, *bias_u = bias ? bias + n + col0 : NULL;
            for (int64_t t = t0; t < t1; t += 2) {
                int two_tiles = t + 1 < t1;
                int64_t lda0, lda1;
                const uint16_t *a0 = tile_rows(a, lda, whole, kp, t, &lda0);
                const uint16_t *a1 = tile_rows(a, lda, whole, kp, t + 1, &lda1);
                int64_t pass_rows = (1 + two_tiles) * TR < m - t * TR ? (1 + two_tiles) * TR : m - t * TR;
                if (tiles > 2) claim(y + t * TR * ldy + col0, ldy, pass_rows, cols);  // (decode: y stays cached)
                for (int q = 0; q < 1 + two_panels; q++) {
                    pass_sums(a0, lda0, a1, lda1, two_tiles, q ? b1 : b0, blocks, c[0] + q * NR, t == t0);
                    if (table) pass_sums(a0, lda0, a1, lda1, two_tiles, q ? u1 : u0, blocks, c[1] + q * NR, t == t0);
                }
                for (int half = 0; half < 1 + two_tiles; half++) {
                    int64_t r = (t + half) * TR, rows = m - r < TR ? m - r : TR;
                    const uint16_t *a_half = half ? a1 : a0;
                    int64_t lda_half = half ? lda1 : lda0;
                    if (table)
                        finish_silu(c[0] + half * TR * CW, c[1] + half * TR * CW, a_half, lda_half, blocks, kp, b0,
                                    b1, u0, u1, bias_g, bias_u, table, cols, y + r * ldy + col0, ldy, rows);
                    else
                        finish(c[0] + half * TR * CW, a_half, lda_half, blocks, kp, b0, b1, bias_g, cols,
                               y + r * ldy + col0, ldy, rows);
                }
            }
        }
    }
    _tile_release();
    return 0;
}

// As packed_gemm_bf16 (cpu_gemm_bf16.c): y (m rows, row stride ldy) = x (m rows of k, row stride
// ldx) . W^T + bias (NULL: none), W packed by pack_weight_bf16 for n columns. Returns 0, or -1 if
// the padding buffer cannot be allocated (y untouched).
int32_t packed_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    return gemm_amx(x, m, k, ldx, bp, n, bias, NULL, y, ldy);
}

// SwiGLU's gate/up projection and its activation in one pass, the gate and up outputs never
// written: y (m rows of `inter`, row stride ldy) = bf16(table[bf16(x . Wg^T + bg)] * bf16(x . Wu^T
// + bu)), bitwise packed_gemm_bf16_amx's [gate | up] followed by cpu_fused.c's silu_mul_bf16 (whose
// silu_bf16_table is `table`). W = [Wg; Wu] (2 inter x k) packed by pack_weight_bf16 in groups of
// 96 outputs: group q's rows 96 q.. of Wg, then the same of Wu, each zero-padded to 96 rows (the
// panels 4 q .. 4 q + 3); bias (2 inter: [bg | bu], NULL: none) unpacked. Returns as
// packed_gemm_bf16_amx.
int32_t packed_gemm_silu_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp,
                                  int64_t inter, const uint16_t *bias, const float *table, uint16_t *y, int64_t ldy) {
    return gemm_amx(x, m, k, ldx, bp, inter, bias, table, y, ldy);
}

#else  // no AMX-BF16 on the CPU this was built for: the library says so and does nothing

int32_t gemm_amx_available(void) { return 0; }
int32_t packed_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)bp, (void)n, (void)bias, (void)y, (void)ldy;
    return -2;
}
int32_t packed_gemm_silu_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp,
                                  int64_t inter, const uint16_t *bias, const float *table, uint16_t *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)bp, (void)inter, (void)bias, (void)table, (void)y, (void)ldy;
    return -2;
}

#endif
