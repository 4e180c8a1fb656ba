// The float32 CPU GEMM of the linear layers: y[m, n] = x[m, k] . W[n, k]^T, with W packed
// once at load time into column panels (pack_weight). One thread, AVX2 + FMA.
//
// The structure is BLIS's (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly
// Instantiating BLAS Functionality", ACM TOMS 2015; Goto & van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", ACM TOMS 2008): a register-blocked micro-kernel
// of MR x NR = 4 x 24 outputs (12 ymm accumulators, three ymm of the weight panel and one
// broadcast input), the weight packed so that the micro-kernel reads it contiguously, the
// input rows packed MR-interleaved per call. It differs from a general GEMM in two ways,
// both for the shapes of LLM serving (m from 1 to a few thousand tokens, k and n a few
// thousand):
//  - no blocking over k: each output is one chain of fused multiply-adds over k = 0..k-1,
//    started from zero and stored once. So every output is rounded the same way whatever
//    m is and wherever its row falls in a tile: the product is batch-invariant by
//    construction (a request decodes to the same bits alone or in a batch of 32).
//  - the next weight panel is prefetched while the current one is multiplied, spread over
//    the row tiles, since at decode sizes (m <= 64) each panel is used by few tiles and the
//    weights stream from memory (the LM head: 113 MB in float32 for SmolLM2-135M).
// Rows past the last full tile are computed as a zero-padded tile (the weight panel is
// read once whatever m is), or by a one-row kernel when one row is left; columns past the
// last full panel go through a scratch tile.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 4
#define NR 24
#define A_BLOCK_BYTES (160 * 1024)  // packed input rows per block: within the 512 KiB L2 with a weight panel

int32_t gemm_panel_width(void) { return NR; }

// w: (n, k) row-major float32 -> bp: ceil(n / NR) panels of (k, NR), columns past n zero.
void pack_weight(const float *w, int64_t n, int64_t k, float *bp) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = bp + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

// The compiler would fold the weight loads into the FMAs (12 loads a step instead of 3,
// which the load ports cannot feed); this keeps them in registers.
#define IN_REGISTERS(x, y, z) __asm__("" : "+x"(x), "+x"(y), "+x"(z))

// c (4 rows of 24, row stride ldc) = a (k steps of 4 interleaved rows) . b (k steps of 24);
// prefetches pf, pf + pf_step, ... (one a step) when pf is not NULL.
static inline void kernel_4x24(int64_t k, const float *a, const float *b, float *c, int64_t ldc,
                               const char *pf, int64_t pf_step) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    for (int64_t i = 0; i < k; i++) {
        __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8), b2 = _mm256_load_ps(b + 16);
        IN_REGISTERS(b0, b1, b2);
        if (pf) {
            _mm_prefetch(pf, _MM_HINT_T0);
            pf += pf_step;
        }
        __m256 a0 = _mm256_broadcast_ss(a);
        c00 = _mm256_fmadd_ps(a0, b0, c00); c01 = _mm256_fmadd_ps(a0, b1, c01); c02 = _mm256_fmadd_ps(a0, b2, c02);
        __m256 a1 = _mm256_broadcast_ss(a + 1);
        c10 = _mm256_fmadd_ps(a1, b0, c10); c11 = _mm256_fmadd_ps(a1, b1, c11); c12 = _mm256_fmadd_ps(a1, b2, c12);
        __m256 a2 = _mm256_broadcast_ss(a + 2);
        c20 = _mm256_fmadd_ps(a2, b0, c20); c21 = _mm256_fmadd_ps(a2, b1, c21); c22 = _mm256_fmadd_ps(a2, b2, c22);
        __m256 a3 = _mm256_broadcast_ss(a + 3);
        c30 = _mm256_fmadd_ps(a3, b0, c30); c31 = _mm256_fmadd_ps(a3, b1, c31); c32 = _mm256_fmadd_ps(a3, b2, c32);
        a += MR;
        b += NR;
    }
    _mm256_storeu_ps(c, c00); _mm256_storeu_ps(c + 8, c01); _mm256_storeu_ps(c + 16, c02);
    c += ldc;
    _mm256_storeu_ps(c, c10); _mm256_storeu_ps(c + 8, c11); _mm256_storeu_ps(c + 16, c12);
    c += ldc;
    _mm256_storeu_ps(c, c20); _mm256_storeu_ps(c + 8, c21); _mm256_storeu_ps(c + 16, c22);
    c += ldc;
    _mm256_storeu_ps(c, c30); _mm256_storeu_ps(c + 8, c31); _mm256_storeu_ps(c + 16, c32);
}

/* One row: c[24] = a (k steps, the row's values MR apart in the packed rows) . b. The
 * same chain of multiply-adds per output as kernel_4x24, so the same bits: a decode of
 * one request reads the weight panel once without computing three rows of padding. */
static inline void kernel_1x24(int64_t k, const float *a, const float *b, float *c) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0;
    for (int64_t i = 0; i < k; i++) {
        __m256 a0 = _mm256_broadcast_ss(a);
        c0 = _mm256_fmadd_ps(a0, _mm256_load_ps(b), c0);
        c1 = _mm256_fmadd_ps(a0, _mm256_load_ps(b + 8), c1);
        c2 = _mm256_fmadd_ps(a0, _mm256_load_ps(b + 16), c2);
        a += MR;
        b += NR;
    }
    _mm256_storeu_ps(c, c0); _mm256_storeu_ps(c + 8, c1); _mm256_storeu_ps(c + 16, c2);
}

static _Thread_local float *scratch;  // the packed input rows: grown once, kept for the thread
static _Thread_local int64_t scratch_floats;

// y (m rows, row stride ldy) = x (m rows of k, row stride ldx) . W^T, W packed by pack_weight
// for n columns. Returns 0, or -1 if the scratch buffer cannot be allocated (y untouched).
int32_t packed_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *bp, int64_t n,
                    float *y, int64_t ldy) {
    int64_t panels = (n + NR - 1) / NR;
    int64_t mc_max = (A_BLOCK_BYTES / (4 * k)) / MR * MR;
    if (mc_max < MR) mc_max = MR;
    if (mc_max > m) mc_max = (m + MR - 1) / MR * MR;
    if (scratch_floats < mc_max * k) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((mc_max * k * 4 + 63) / 64 * 64));
        scratch_floats = scratch ? mc_max * k : 0;
        if (!scratch) return -1;
    }
    float *apack = scratch;
    float ctile[MR * NR] __attribute__((aligned(32)));
    for (int64_t ic = 0; ic < m; ic += mc_max) {
        int64_t mc = m - ic < mc_max ? m - ic : mc_max;
        int64_t tiles = (mc + MR - 1) / MR, full_tiles = mc / MR;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t kk = 0; kk < k; kk++)
                for (int64_t i = 0; i < MR; i++) {
                    int64_t row = ic + t * MR + i;
                    apack[(t * k + kk) * MR + i] = row < m ? x[row * ldx + kk] : 0.0f;
                }
        // the next panel, spread over this panel's full tiles: pf_step bytes a step of k
        int64_t pf_step = full_tiles ? (k * NR * 4 + full_tiles * k - 1) / (full_tiles * k) : 0;
        for (int64_t p = 0; p < panels; p++) {
            const float *b = bp + p * k * NR;
            const char *next = p + 1 < panels ? (const char *)(b + k * NR) : NULL;
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t t = 0; t < tiles; t++) {
                float *c = y + (ic + t * MR) * ldy + p * NR;
                int64_t rows = t < full_tiles ? MR : mc - full_tiles * MR;
                if (rows == MR && cols == NR) {
                    kernel_4x24(k, apack + t * k * MR, b, c, ldy, next ? next + t * pf_step * k : NULL, pf_step);
                } else if (rows == 1) {
                    kernel_1x24(k, apack + t * k * MR, b, ctile);
                    memcpy(c, ctile, (size_t)cols * 4);
                } else {
                    kernel_4x24(k, apack + t * k * MR, b, ctile, NR, NULL, 0);
                    for (int64_t i = 0; i < rows; i++) memcpy(c + i * ldy, ctile + i * NR, (size_t)cols * 4);
                }
            }
        }
    }
    return 0;
}
