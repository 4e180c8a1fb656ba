/* Fused elementwise kernels of a Llama decoder layer for one CPU thread: the
 * residual add with RMSNorm, rotary embedding of the query and key heads, and
 * SwiGLU's SiLU-and-multiply; each in float32 and in bfloat16 (the `_bf16` names).
 *
 * Built and loaded by executor/models/cpu_fused.py (gcc -O3 -march=native
 * -ffp-contract=off, no -ffast-math: every product and sum is rounded as written,
 * so the norm and the rotary are bitwise the torch ops they replace), cached on
 * disk; plain C, no torch headers, called through ctypes. Each row is computed from that row alone:
 * batch-invariant.
 *
 * bfloat16 is stored as uint16_t (the high half of a float32), widened to float32 for
 * the arithmetic and rounded back to nearest even wherever the torch ops the kernels
 * replace round a bfloat16 result: each torch op on bfloat16 tensors computes in
 * float32 and rounds its output (ATen's binary_op_as_fp32, convert_from_float), so
 * the kernels round after the same operations, in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* bfloat16 bits -> float32 (exact). */
static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 bits, round to nearest even (c10's round_to_nearest_even; a NaN
 * becomes the quiet NaN 0x7fc0 as there; infinities stay, overflow rounds to them). */
static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to bfloat16, as float32: the value a torch op on bfloat16 leaves behind. */
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* ---- the RMSNorm statistic, summed in torch's order -------------------------------
 * torch's x.pow(2).mean(-1) on one CPU thread squares each element in float32, sums
 * each row in float32 in the order of ATen's cascade sum for a contiguous inner
 * reduction (aten/src/ATen/native/cpu/SumKernel.cpp, torch 2.x: vectorized_inner_sum ->
 * row_sum -> multi_row_sum with 4 accumulators and 4 levels, over vectors of `lanes`
 * floats: 8 for AVX2, 16 for AVX512; rows shorter than a vector: scalar_inner_sum),
 * then divides by the row length. The same additions in the same order give the same
 * float32 statistic bit for bit (another torch version may order its sum otherwise:
 * then the statistic can differ in its last bit). */
#define MAX_LANES 16
#define INLINE static inline __attribute__((always_inline)) /* constant bf16, w: loops the compiler vectorises */

static inline float square_at(const void *v, int bf16, int64_t i) {
    float a = bf16 ? bf16_load(((const uint16_t *)v)[i]) : ((const float *)v)[i];
    return a * a;
}

static inline int64_t ceil_log2(int64_t x) { /* c10's CeilLog2: 1 for x <= 2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t y = (uint64_t)x - 1; y; y >>= 1) bits++;
    return bits;
}

/* ATen's row_sum over `size` elements of w floats (a vector of w lanes, or w = 1):
 * the lane-wise sums of the squares into sum[0, w). */
INLINE void row_sum(const void *v, int bf16, int64_t size, int w, float *sum) {
    const int64_t rows = size / 4; /* multi_row_sum: 4 interleaved accumulators */
    float acc[4][4][MAX_LANES];   /* [level][accumulator][lane] */
    memset(acc, 0, sizeof acc);
    int64_t power = ceil_log2(rows) / 4;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) acc[0][k][l] += square_at(v, bf16, (i * 4 + k) * w + l);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += square_at(v, bf16, (i * 4 + k) * w + l);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t e = rows * 4; e < size; e++) /* row_sum's tail, then its accumulators */
        for (int l = 0; l < w; l++) acc[0][0][l] += square_at(v, bf16, e * w + l);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < w; l++) acc[0][0][l] += acc[0][k][l];
    for (int l = 0; l < w; l++) sum[l] = acc[0][0][l];
}

/* mean of the squares of v[0, size) (float32, or bfloat16 when bf16) as torch computes it. */
INLINE float mean_of_squares(const void *v, int bf16, int64_t size, int lanes) {
    float part[MAX_LANES];
    if (lanes != 16) lanes = 8;
    if (size < lanes) { /* scalar_inner_sum */
        row_sum(v, bf16, size, 1, part);
        return part[0] / (float)size;
    }
    const int64_t vecs = size / lanes;
    if (lanes == 16)
        row_sum(v, bf16, vecs, 16, part);
    else
        row_sum(v, bf16, vecs, 8, part);
    float total = 0.0f;
    for (int64_t e = vecs * lanes; e < size; e++) total += square_at(v, bf16, e);
    for (int l = 0; l < lanes; l++) total += part[l];
    return total / (float)size;
}

/* residual[r] += x[r]; out[r] = (residual[r] * 1/sqrt(mean(residual[r]^2) + eps)) * weight
 * for r in [0, n); rows of `hidden` floats, contiguous; the statistic as
 * mean_of_squares (torch's order for `lanes`-float vectors), every product rounded as
 * torch rounds it: bitwise the torch ops. x may be NULL: no add (the first layer's norm). */
void add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t n, int64_t hidden,
                  float eps, int32_t lanes) {
    for (int64_t r = 0; r < n; r++) {
        float *res = residual + r * hidden;
        float *o = out + r * hidden;
        if (x) {
            const float *xr = x + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] += xr[i];
        }
        float inv = 1.0f / sqrtf(mean_of_squares(res, 0, hidden, lanes) + eps);
        for (int64_t i = 0; i < hidden; i++) {
            float v = res[i] * inv;
            o[i] = v * weight[i];
        }
    }
}

/* Rotates, in place, `heads` heads of D floats in each of n rows (row r's heads start
 * at x + r * row_stride, head h at + h * D), GPT-NeoX layout: with x1, x2 the halves,
 *   x1' = x1 * cos - x2 * sin,  x2' = x2 * cos + x1 * sin,
 * each product rounded, then the sum (torch's rotate_). cos/sin: (n, D / 2) rows. */
void rotary_inplace(float *x, int64_t row_stride, int64_t n, int64_t heads, int64_t D, const float *cos_,
                    const float *sin_) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *c = cos_ + r * half, *s = sin_ + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * row_stride + h * D, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                float a_cos = a * c[i], b_sin = b * s[i], b_cos = b * c[i], a_sin = a * s[i];
                x1[i] = a_cos - b_sin;
                x2[i] = b_cos + a_sin;
            }
        }
    }
}

/* e^x for x in float32 (Cephes' expf: range reduction by ln 2 in two parts, a degree-6
 * polynomial, the exponent set in the bits), within 2 ulp of the exact value; written
 * without calls or branches so the compiler vectorises the loop that calls it. The
 * power of two is applied as two factors 2^(n/2) 2^(n - n/2), each a normal float, so
 * that above ln(FLT_MAX) ~ 88.72 the result overflows to infinity as torch's
 * exponential does (Cephes clamps at 88.38 instead): silu(g) for g < -88.72 is then
 * g / inf = -0, as torch has it. Below -87.34 the input is clamped (e^x ~ 1e-38, which
 * 1 + e^x does not see). */
static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, -87.3365447504f), 89.0f);
    float fx = x * 1.44269504088896341f + 0.5f;
    float fl = (float)(int32_t)fx;
    fl -= (float)(fl > fx); /* floor */
    x = x - fl * 0.693359375f;
    x = x - fl * -2.12194440e-4f;
    float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    int32_t n = (int32_t)fl, half = n / 2; /* n in [-126, 128]: both factors normal */
    int32_t bits_a = (half + 127) << 23, bits_b = (n - half + 127) << 23;
    float scale_a, scale_b;
    memcpy(&scale_a, &bits_a, 4);
    memcpy(&scale_b, &bits_b, 4);
    return (y * scale_a) * scale_b;
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] for r in [0, n), i in [0, inter):
 * SwiGLU's activation on the fused gate/up projection (rows of 2 * inter floats),
 * silu(g) = g / (1 + e^-g). out: (n, inter). */
void silu_mul(const float *gate_up, float *out, int64_t n, int64_t inter) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* ---- bfloat16 ---------------------------------------------------------------- */

/* add_rms_norm on bfloat16 rows, rounding as the torch ops of norm.py do:
 *   residual[r] = bf16(residual[r] + x[r])                   (residual += x, in bfloat16)
 *   inv = 1 / sqrt(mean(residual[r]^2) + eps)                 (float32, mean_of_squares)
 *   out[r] = bf16(bf16(residual[r] * inv) * weight)           (.to(bfloat16), then .mul_(weight))
 * Bitwise the torch ops. x may be NULL. */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t n,
                       int64_t hidden, float eps, int32_t lanes) {
    for (int64_t r = 0; r < n; r++) {
        uint16_t *res = residual + r * hidden;
        uint16_t *o = out + r * hidden;
        if (x) {
            const uint16_t *xr = x + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] = bf16_store(bf16_load(res[i]) + bf16_load(xr[i]));
        }
        float inv = 1.0f / sqrtf(mean_of_squares(res, 1, hidden, lanes) + eps);
        for (int64_t i = 0; i < hidden; i++)
            o[i] = bf16_store(bf16_round(bf16_load(res[i]) * inv) * bf16_load(weight[i]));
    }
}

/* rotary_inplace on bfloat16 heads with bfloat16 cos/sin (the model's table dtype),
 * rounding as rotary.py's torch ops do: every product rounded to bfloat16, then the
 * difference / sum of the rounded products rounded:
 *   x1' = bf16(bf16(x1 * cos) - bf16(x2 * sin)),  x2' = bf16(bf16(x2 * cos) + bf16(x1 * sin)).
 * Bitwise those ops. Layout as rotary_inplace (strides in elements). */
void rotary_inplace_bf16(uint16_t *x, int64_t row_stride, int64_t n, int64_t heads, int64_t D,
                         const uint16_t *cos_, const uint16_t *sin_) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *c = cos_ + r * half, *s = sin_ + r * half;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x1 = x + r * row_stride + h * D, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = bf16_load(x1[i]), b = bf16_load(x2[i]), ci = bf16_load(c[i]), si = bf16_load(s[i]);
                float a_cos = bf16_round(a * ci), b_sin = bf16_round(b * si);
                float b_cos = bf16_round(b * ci), a_sin = bf16_round(a * si);
                x1[i] = bf16_store(a_cos - b_sin);
                x2[i] = bf16_store(b_cos + a_sin);
            }
        }
    }
}

/* bf16(silu(g)) for each of the 65,536 bfloat16 gates g (by their bits), as float32: the
 * SiLU of a bfloat16 input rounded to bfloat16 depends on its 16 bits only, so it is
 * computed once, when the library loads, and looked up (2x faster than computing it per
 * element: 32 rows of 1,536, 45 -> 23 us on one Zen 4 core; the same bits). 256 KiB. */
static float silu_bf16_table[65536];

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float g = bf16_load((uint16_t)h);
        silu_bf16_table[h] = bf16_round(g / (1.0f + exp_approx(-g)));
    }
}

/* The address of silu_bf16_table, for the AMX GEMM that applies silu_mul_bf16 as it writes
 * (cpu_gemm_amx.c's packed_gemm_silu_bf16_amx): one table, so both round alike. */
const float *silu_bf16_table_address(void) { return silu_bf16_table; }

/* silu_mul on bfloat16 rows, rounding as torch's F.silu(gate).mul_(up) does: SiLU in
 * float32 rounded to bfloat16 (ATen's silu kernel for reduced floats), then the product
 * with up rounded: out = bf16(bf16(g / (1 + e^-g)) * u), the first factor from
 * silu_bf16_table. e^x is exp_approx (torch: Sleef), so where the float32 SiLU lies
 * within an ulp or two of a bfloat16 rounding boundary the rounded SiLU can differ from
 * torch's by one bfloat16 ulp. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t n, int64_t inter) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = bf16_store(silu_bf16_table[g[i]] * bf16_load(u[i]));
    }
}
