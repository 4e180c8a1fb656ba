// The bfloat16 GEMM of the linear layers on AMX tiles: y[m, n] = x[m, k] . W[n, k]^T (+ bias[n]),
// bfloat16 in and out, float32 sums, one thread, on cpu_gemm_bf16.c's panels (the same packing,
// pack_weight_bf16: per panel of NR = 48 columns, ceil(k / 2) steps of 48 column pairs).
//
// A panel step of 16 feature pairs is three AMX B tiles of 16 pairs x 16 columns (the panel's
// rows of 192 bytes, read 64 bytes apart); 16 input rows x 32 features are the A tile, read
// straight from x. TDPBF16PS (Intel SDM, "Intel AMX") adds each output's 16 pairs of products
// to its float32 sum; the output tiles go over the feature blocks in order, the features past
// the last whole block of 16 pairs (k = 576: 4 pairs) are added after them by VDPBF16PS, then
// the bias in float32, then one rounding to bfloat16. Each output's sum is so one fixed
// sequence of operations over its row and column, whatever m is or where its row falls among
// the 16 of a tile: batch-invariant by construction, as cpu_gemm_bf16.c (not bitwise equal to
// it: its chain adds one pair at a time).
//
// The loops are cpu_gemm_bf16.c's: input rows in chunks of at most 512 KiB, and for each chunk
// every panel once, its row tiles inner, so a panel stays in L2 across them and the weights
// stream from memory once per chunk. Rows past the last 16 go through a zero-padded copy of
// them (and every row when k is odd, to pad its last pair). Linux hands AMX's tile state
// to a process only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM): gemm_amx_available() asks.
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
#define A_CHUNK_BYTES (512 * 1024)

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

static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 7; t++) {  // 0: A; 1-3: B; 4-6: C
        cfg.rows[t] = t >= 1 && t <= 3 ? TPAIRS : TR;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline __m512 widen(__m256i bf16) {  // 16 bfloat16 -> 16 float32, exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// One panel for TR rows of a (row stride lda elements): sums into c (TR x NR float32), then the
// tail pairs, the bias, the rounding, stored to y's first `rows` rows and `cols` columns.
static void panel(const uint16_t *a, int64_t lda, int64_t kp, const uint16_t *b, const uint16_t *bias, int64_t cols,
                  uint16_t *y, int64_t ldy, int64_t rows, const char *next) {
    float c[TR][NR] __attribute__((aligned(64)));
    int64_t blocks = kp / TPAIRS;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint16_t *bk = b + kb * TPAIRS * NR * 2;
        if (next) {  // the next panel's same block, 48 lines, while this one multiplies (decode: bytes-bound)
            const char *pf = next + kb * TPAIRS * NR * 4;
            for (int line = 0; line < TPAIRS * NR * 4 / 64; line++) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
        }
        _tile_loadd(0, a + kb * TPAIRS * 2, lda * 2);
        _tile_loadd(1, bk, NR * 4);
        _tile_loadd(2, bk + 32, NR * 4);
        _tile_loadd(3, bk + 64, NR * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3);
    }
    _tile_stored(4, &c[0][0], NR * 4);
    _tile_stored(5, &c[0][16], NR * 4);
    _tile_stored(6, &c[0][32], NR * 4);
    __m512 add[3];
    __mmask16 live[3];
    for (int j = 0; j < 3; j++) {
        int64_t left = cols - 16 * j;
        live[j] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        add[j] = bias ? widen(_mm256_maskz_loadu_epi16(live[j], bias + 16 * j)) : _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < rows; i++) {
        __m512 acc[3];
        for (int j = 0; j < 3; j++) acc[j] = _mm512_load_ps(&c[i][16 * j]);
        for (int64_t kk = blocks * TPAIRS; kk < kp; kk++) {
            uint32_t pair;
            memcpy(&pair, a + i * lda + 2 * kk, 4);
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)pair);
            const uint16_t *bk = b + kk * NR * 2;
            acc[0] = _mm512_dpbf16_ps(acc[0], ai, (__m512bh)_mm512_loadu_si512(bk));
            acc[1] = _mm512_dpbf16_ps(acc[1], ai, (__m512bh)_mm512_loadu_si512(bk + 32));
            acc[2] = _mm512_dpbf16_ps(acc[2], ai, (__m512bh)_mm512_loadu_si512(bk + 64));
        }
        for (int j = 0; j < 3; j++) {
            __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j], add[j]));
            _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, live[j], out);
        }
    }
}

static _Thread_local uint16_t *pad;  // the last rows, zero-padded to TR, with an even k: grown once per thread
static _Thread_local int64_t pad_elems;

// As packed_gemm_bf16 (cpu_gemm_bf16.c): y (m rows, row stride ldy) = x (m rows of k, row stride
// ldx) . W^T + bias (NULL: none), W packed by pack_weight_bf16 for n columns. Returns 0, or -1 if
// the padding buffer cannot be allocated (y untouched).
int32_t packed_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2, full = m / TR * TR;
    if (m <= 0) return 0;
    int odd = k % 2 != 0;  // the last pair would read past a row: every row copied with a zero feature
    if (m > full || odd) {
        int64_t need = (odd ? m + TR : TR) * kp * 2;
        if (pad_elems < need) {
            free(pad);
            pad = aligned_alloc(64, (size_t)((need * 2 + 63) / 64 * 64));
            pad_elems = pad ? need : 0;
            if (!pad) return -1;
        }
    }
    configure();
    // panels outer, row blocks inner: a panel (kp x 192 bytes) stays in L2 while every row
    // block reads it, so the weights stream from memory once a call, as in cpu_gemm_bf16.c
    const uint16_t *a = x;
    int64_t lda = ldx, whole = full;
    if (odd) {  // every row copied with its k padded to whole pairs (k odd): rare, not a model's shape
        int64_t rows = (m + TR - 1) / TR * TR;
        memset(pad, 0, (size_t)(rows * kp * 4));
        for (int64_t i = 0; i < m; i++) memcpy(pad + i * kp * 2, x + i * ldx, (size_t)(k * 2));
        a = pad;
        lda = kp * 2;
        whole = rows;
    } else if (m > full) {  // the last rows, zero-padded to a tile
        memset(pad, 0, (size_t)(TR * kp * 4));
        for (int64_t i = full; i < m; i++) memcpy(pad + (i - full) * kp * 2, x + i * ldx, (size_t)(k * 2));
    }
    // rows in chunks of at most A_CHUNK_BYTES of input, so a chunk's rows stay in L2 beside the panel
    int64_t chunk = (A_CHUNK_BYTES / (4 * (kp > 0 ? kp : 1))) / TR * TR;
    if (chunk < TR) chunk = TR;
    int64_t r0 = 0;
    do {  // once at least: with fewer than TR rows there is only the padded tail
        int64_t r1 = r0 + chunk < whole ? r0 + chunk : whole;
        int last = r1 == whole;  // the padded tail rows go with the last chunk
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *b = bp + p * kp * NR * 2, *bias_p = bias ? bias + p * NR : NULL;
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const char *next = p + 1 < panels ? (const char *)(b + kp * NR * 2) : NULL;  // prefetched by the first tile
            for (int64_t r = r0; r < r1; r += TR)
                panel(a + r * lda, lda, kp, b, bias_p, cols, y + r * ldy + p * NR, ldy, m - r < TR ? m - r : TR,
                      r == r0 ? next : NULL);
            if (last && !odd && m > full)
                panel(pad, kp * 2, kp, b, bias_p, cols, y + full * ldy + p * NR, ldy, m - full, r1 == r0 ? next : NULL);
        }
        r0 = r1;
    } while (r0 < whole);
    _tile_release();
    return 0;
}

#else  // no AMX-BF16 on the CPU this was built for: the library says so and does nothing

int32_t gemm_amx_available(void) { return 0; }
int32_t packed_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)bp, (void)n, (void)bias, (void)y, (void)ldy;
    return -2;
}

#endif
