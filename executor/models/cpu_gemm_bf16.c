// The bfloat16 CPU GEMM of the linear layers: y[m, n] = x[m, k] . W[n, k]^T (+ bias[n]),
// bfloat16 in and out, float32 sums. One thread, AVX512-BF16 (Zen 4, Sapphire Rapids and
// later): each VDPBF16PS multiplies 16 columns by one pair of the input's features and adds
// both products to 16 float32 sums.
//
// The structure is cpu_gemm.c's, after BLIS (Van Zee & van de Geijn, ACM TOMS 2015; Goto &
// van de Geijn, ACM TOMS 2008): a register-blocked micro-kernel of MR x NR = 8 x 48 outputs
// (24 zmm accumulators, three zmm of the weight panel, one broadcast pair of the input),
// the weight packed once into column panels of feature pairs so that the micro-kernel reads
// it contiguously, the input rows packed MR-interleaved per call. As there:
//  - no blocking over k: each output is one chain of VDPBF16PS over the feature pairs in
//    order, started from zero (the bias added once at the end), so a row's result never
//    depends on m or on where the row falls in a tile: batch-invariant by construction.
//  - the next weight panel is prefetched while the current one is multiplied, spread over
//    the row tiles (at decode sizes the weights stream from memory).
// Rows past the last full tile go through a micro-kernel of that many rows (1-7, the same
// chain per output); columns past the last full panel are stored under a mask.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MR 8
#define NR 48
#define A_BLOCK_BYTES (384 * 1024)  // packed input rows per block: within a 1 MiB L2 with a weight panel

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)

int32_t gemm_bf16_available(void) { return 1; }
int32_t gemm_bf16_panel_width(void) { return NR; }

// w: (n, k) row-major bfloat16 -> bp: ceil(n / NR) panels of (ceil(k / 2) pairs, NR columns,
// 2 features), columns past n and the feature past an odd k zero.
void pack_weight_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *bp) {
    int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2;
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = bp + p * kp * NR * 2;
        for (int64_t kk = 0; kk < kp; kk++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                for (int64_t h = 0; h < 2; h++) {
                    int64_t f = 2 * kk + h;
                    dst[(kk * NR + j) * 2 + h] = col < n && f < k ? w[col * k + f] : 0;
                }
            }
    }
}

// The compiler would fold the weight loads into the dot products (24 loads a step instead
// of 3); this keeps them in registers.
#define IN_REGISTERS(x, y, z) __asm__("" : "+v"(x), "+v"(y), "+v"(z))

static inline __m512 widen(__m256i bf16) {  // 16 bfloat16 -> 16 float32, exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// c (rows of NR, row stride ldc, the first `cols` columns) = a (kp steps of MR interleaved
// input pairs) . b (kp steps of NR column pairs) + bias; prefetches pf, pf + pf_step, ...
// (one a step), and as many lines after each as pf_lines - 1, when pf is not NULL. `rows` is
// a constant in each instantiation below.
static inline __attribute__((always_inline)) void kernel(const int rows, int64_t kp, const uint32_t *a,
                                                         const uint16_t *b, uint16_t *c, int64_t ldc,
                                                         const uint16_t *bias, int64_t cols,
                                                         const char *pf, int64_t pf_step, int64_t pf_lines) {
    __m512 acc[MR][3];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kp; kk++) {
        __m512i b0 = _mm512_load_si512(b), b1 = _mm512_load_si512(b + 32), b2 = _mm512_load_si512(b + 64);
        IN_REGISTERS(b0, b1, b2);
        if (pf) {
            _mm_prefetch(pf, _MM_HINT_T0);
            if (pf_lines > 1) _mm_prefetch(pf + 64, _MM_HINT_T0);
            if (pf_lines > 2) _mm_prefetch(pf + 128, _MM_HINT_T0);
            pf += pf_step;
        }
        for (int i = 0; i < rows; i++) {
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, (__m512bh)b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, (__m512bh)b1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], ai, (__m512bh)b2);
        }
        a += MR;
        b += NR * 2;
    }
    __m512 add[3];
    __mmask16 live[3];  // the columns of each 16 that exist
    for (int j = 0; j < 3; j++) {
        int64_t left = cols - 16 * j;
        live[j] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        add[j] = bias ? widen(_mm256_maskz_loadu_epi16(live[j], bias + 16 * j)) : _mm512_setzero_ps();
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 3; j++) {
            __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], add[j]));
            _mm256_mask_storeu_epi16(c + i * ldc + 16 * j, live[j], out);
        }
}

typedef void (*kernel_fn)(int64_t, const uint32_t *, const uint16_t *, uint16_t *, int64_t, const uint16_t *,
                          int64_t, const char *, int64_t, int64_t);
#define ROWS(r)                                                                                         \
    static void kernel_##r(int64_t kp, const uint32_t *a, const uint16_t *b, uint16_t *c, int64_t ldc, \
                           const uint16_t *bias, int64_t cols, const char *pf, int64_t pf_step,       \
                           int64_t pf_lines) {                                                       \
        kernel(r, kp, a, b, c, ldc, bias, cols, pf, pf_step, pf_lines);                              \
    }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
static const kernel_fn kernels[MR + 1] = {0, kernel_1, kernel_2, kernel_3, kernel_4,
                                          kernel_5, kernel_6, kernel_7, kernel_8};

static _Thread_local uint32_t *scratch;  // the packed input pairs: grown once, kept for the thread
static _Thread_local int64_t scratch_pairs;

// y (m rows, row stride ldy) = x (m rows of k, row stride ldx) . W^T + bias (NULL: none),
// W packed by pack_weight_bf16 for n columns; all bfloat16. Returns 0, or -1 if the scratch
// buffer cannot be allocated (y untouched).
int32_t packed_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                         const uint16_t *bias, uint16_t *y, int64_t ldy) {
    int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2;
    if (m <= 0) return 0;  // (no block to size: the divisions below would be by zero)
    int64_t mc_max = (A_BLOCK_BYTES / (4 * (kp > 0 ? kp : 1))) / MR * MR;  // k = 0: each output its bias
    if (mc_max < MR) mc_max = MR;
    int64_t blocks = (m + mc_max - 1) / mc_max;  // as even as whole tiles allow: no small last block
    mc_max = ((m + blocks - 1) / blocks + MR - 1) / MR * MR;
    if (scratch_pairs < mc_max * kp) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((mc_max * kp * 4 + 63) / 64 * 64));
        scratch_pairs = scratch ? mc_max * kp : 0;
        if (!scratch) return -1;
    }
    uint32_t *apack = scratch;
    for (int64_t ic = 0; ic < m; ic += mc_max) {
        int64_t mc = m - ic < mc_max ? m - ic : mc_max;
        int64_t tiles = (mc + MR - 1) / MR, full_tiles = mc / MR;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t i = 0; i < MR; i++) {
                int64_t row = ic + t * MR + i;
                const uint16_t *src = x + row * ldx;
                uint32_t *dst = apack + t * kp * MR + i;
                for (int64_t kk = 0; kk < kp; kk++) {
                    uint32_t lo = row < m ? src[2 * kk] : 0, hi = row < m && 2 * kk + 1 < k ? src[2 * kk + 1] : 0;
                    dst[kk * MR] = lo | hi << 16;
                }
            }
        // the next panel, spread over this block's tiles: pf_step bytes a step of kp, in
        // pf_lines cache lines when a step has more than one line to fetch (few tiles)
        int64_t steps = tiles * kp > 0 ? tiles * kp : 1, per_step = (kp * NR * 4 + steps - 1) / steps;
        int64_t pf_lines = per_step > 128 ? 3 : per_step > 64 ? 2 : 1;
        int64_t pf_step = pf_lines > 1 ? 64 * pf_lines : per_step;
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *b = bp + p * kp * NR * 2;
            const char *next = p + 1 < panels ? (const char *)(b + kp * NR * 2) : NULL;
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const uint16_t *bias_p = bias ? bias + p * NR : NULL;
            for (int64_t t = 0; t < tiles; t++) {
                uint16_t *c = y + (ic + t * MR) * ldy + p * NR;
                int64_t rows = t < full_tiles ? MR : mc - full_tiles * MR;
                const char *pf = next ? next + t * pf_step * kp : NULL;
                kernels[rows](kp, apack + t * kp * MR, b, c, ldy, bias_p, cols, pf, pf_step, pf_lines);
            }
        }
    }
    return 0;
}

#else  // no AVX512-BF16 on the CPU this was built for: the library says so and does nothing

int32_t gemm_bf16_available(void) { return 0; }
int32_t gemm_bf16_panel_width(void) { return NR; }
void pack_weight_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *bp) {
    (void)w, (void)n, (void)k, (void)bp;
}
int32_t packed_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *bp, int64_t n,
                         const uint16_t *bias, uint16_t *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)bp, (void)n, (void)bias, (void)y, (void)ldy;
    return -2;
}

#endif
