// Batch norm's finalize kernels: the per-channel f64 arithmetic between its reductions, on the
// device, so that the host never reads a statistic inside a training step. Each is the CUDA
// twin of a function in src/batch_norm/finalize.rs (channel_statistics, channel_constants,
// channel_backward) and evaluates the same expressions in the same order; compiled with
// --fmad=false (build.rs), so nothing is contracted into a fused multiply-add, and f64 division
// and square root are correctly rounded in CUDA as in Rust: the results equal the CPU's bit for
// bit. One thread per channel (C is at most a few thousand).
//
// Tables (flat f64, C values per row): moments [Σx; Σx²; n], statistics [mean; var; unbiased
// var; n], coefficients [mean; 1/σ; a; b; n], backward [k; c1; c0; μ_T; ∂γ; ∂β].
#include <stddef.h>

#define PER_CHANNEL(ch, c) \
    for (size_t ch = blockIdx.x * (size_t)blockDim.x + threadIdx.x; ch < (c); ch += (size_t)blockDim.x * gridDim.x)

// moments (2c + 1) -> statistics (3c + 1).
extern "C" __global__ void bn_statistics(size_t c, const double* m, double* out) {
    const double n = m[2 * c];
    PER_CHANNEL(ch, c) {
        const double mean = m[ch] / n;
        const double v = m[c + ch] / n - mean * mean;
        const double var = v < 0.0 ? 0.0 : v;
        out[ch] = mean;
        out[c + ch] = var;
        out[2 * c + ch] = var * (n / fmax(n - 1.0, 1.0)) + 0.0;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) out[3 * c] = n;
}

// statistics (3c + 1) and the parameters gb = [γ (c); β (c)] -> coefficients (4c + 1).
template <typename P>
__device__ void bn_coefficients(size_t c, const double* t, const P* gb, double eps, double* out) {
    PER_CHANNEL(ch, c) {
        const double mean = t[ch];
        const double inv_std = 1.0 / sqrt(t[c + ch] + eps);
        const double a = (double)gb[ch] * inv_std;
        out[ch] = mean;
        out[c + ch] = inv_std;
        out[2 * c + ch] = a;
        out[3 * c + ch] = (double)gb[c + ch] - mean * a;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) out[4 * c] = t[3 * c];
}

extern "C" __global__ void bn_coefficients_f32(size_t c, const double* t, const float* gb, double eps, double* out) {
    bn_coefficients<float>(c, t, gb, eps, out);
}
extern "C" __global__ void bn_coefficients_f64(size_t c, const double* t, const double* gb, double eps, double* out) {
    bn_coefficients<double>(c, t, gb, eps, out);
}

__device__ __forceinline__ double round_to(double v, int f32) { return f32 ? (double)(float)v : v; }

// (global sums [Σg'; Σg'·(x − μ)] over the ranks, this rank's sums, coefficients) -> backward
// table (6c). batch: batch statistics (else fixed: dx = a·g'); f32: k, c1, c0, μ rounded to f32.
extern "C" __global__ void bn_backward_coefficients(size_t c, const double* global, const double* local,
                                                    const double* coef, int batch, int f32, double* out) {
    const double count = coef[4 * c];
    PER_CHANNEL(ch, c) {
        const double mean = coef[ch], inv_std = coef[c + ch], a = coef[2 * c + ch];
        const double mu_t = round_to(mean, f32);
        double k = round_to(a, f32), c1 = 0.0, c0 = 0.0;
        if (batch) {
            const double g1 = global[ch], g2 = global[c + ch];
            const double lin = -a * inv_std * inv_std * g2 / count;
            c1 = round_to(lin, f32);
            c0 = round_to(-a * g1 / count + lin * (mu_t - mean), f32);
        }
        out[ch] = k;
        out[c + ch] = c1;
        out[2 * c + ch] = c0;
        out[3 * c + ch] = mu_t;
        out[4 * c + ch] = local[c + ch] * inv_std;
        out[5 * c + ch] = local[ch];
    }
}
