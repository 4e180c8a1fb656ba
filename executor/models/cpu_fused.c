/* Fused float32 elementwise kernels of a Llama decoder layer for one CPU thread:
 * the residual add with RMSNorm, and rotary embedding of the query and key heads.
 *
 * Built and loaded by executor/models/cpu_fused.py (gcc -O3 -march=native
 * -ffp-contract=off, no -ffast-math: every product and sum is rounded as written,
 * so the rotary is bitwise the torch ops it replaces), cached on disk; plain C, no
 * torch headers, called through ctypes. Each row is computed from that row alone:
 * batch-invariant.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* residual[r] += x[r]; out[r] = (residual[r] * 1/sqrt(mean(residual[r]^2) + eps)) * weight
 * for r in [0, n); rows of `hidden` floats, contiguous. The sum of squares is taken in
 * double over eight interleaved partial sums (torch sums float32 in its own vector
 * order, so the statistic can differ from torch's in its last bit; the products are
 * rounded as torch rounds them). x may be NULL: no add (the first layer's norm). */
void add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t n, int64_t hidden,
                  float eps) {
    for (int64_t r = 0; r < n; r++) {
        float *res = residual + r * hidden;
        float *o = out + r * hidden;
        if (x) {
            const float *xr = x + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] += xr[i];
        }
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8)
            for (int j = 0; j < 8; j++) part[j] += (double)res[i + j] * (double)res[i + j];
        for (; i < hidden; i++) part[0] += (double)res[i] * (double)res[i];
        double sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        float variance = (float)(sum / (double)hidden);
        float inv = 1.0f / sqrtf(variance + eps);
        for (i = 0; i < hidden; i++) {
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
 * without calls or branches so the compiler vectorises the loop that calls it. */
static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, -87.3365447504f), 88.3762626647949f);
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
    int32_t bits = ((int32_t)fl + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
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
