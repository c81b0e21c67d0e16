// allgrad-nn's fused element-wise kernels on CUDA: ReLU and add+ReLU with their backward,
// GELU with its backward, per-channel moments, batch norm's forward (with its tails) and
// backward, and layer norm's forward and backward. Each is the CUDA twin of a CPU kernel in
// src/activation.rs, src/channel.rs, src/batch_norm/cpu.rs or src/norm.rs and
// evaluates the same expressions in the same order (compiled with --fmad=false, so no
// multiply-add is contracted where the CPU rounds twice). bf16 tensors are computed in f32 and
// rounded to bf16 when stored, as the CPU kernels do. Per-channel sums are f64, in two stages
// over a partition fixed by the shape (deterministic, but not the CPU's order).
//
// Exported names end in _f32, _f64 or _bf16 (the tensor's dtype). Batch norm's per-channel
// coefficients are read from the f64 tables of the finalize ops (finalize.cu) and converted to
// the compute type (f32 for f32 and bf16 tensors, f64 for f64) in the kernel.
#include <cuda_bf16.h>
#include <stddef.h>

template <typename T> struct Compute { typedef T type; };
template <> struct Compute<__nv_bfloat16> { typedef float type; };

template <typename T> struct IsBf16 { static const bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static const bool value = true; };

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
// Round to nearest, ties to even: the rounding of the CPU kernels' bf16 outputs.
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// v rounded to bf16 and widened back (exact), as an unfused bf16 op stores its output.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

#define GRID_STRIDE(i, n) \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)blockDim.x * gridDim.x)

// out = max(a + b, 0) (has_b) or max(a, 0); NaN gives 0, as on the CPU.
template <typename T>
__device__ void relu_fwd(size_t n, const T* a, const T* b, int has_b, T* out) {
    typedef typename Compute<T>::type C;
    const C zero = C(0);
    GRID_STRIDE(i, n) {
        C s = widen(a[i]);
        if (has_b) s = s + widen(b[i]);
        store(out + i, s > zero ? s : zero);
    }
}

// out = g where y > 0, else 0.
template <typename T>
__device__ void relu_bwd(size_t n, const T* y, const T* g, T* out) {
    typedef typename Compute<T>::type C;
    const C zero = C(0);
    GRID_STRIDE(i, n) { store(out + i, widen(y[i]) > zero ? widen(g[i]) : zero); }
}

// Block size of the per-channel reductions (a power of two).
#define SUM_THREADS 256

// The two-stage per-channel reductions (channel moments, batch norm's backward sums): the m =
// n·inner values of each channel are cut into `parts` chunks, a number fixed by the shape
// (never by timing), so that small-channel layers still fill the GPU (ResNet's first stage has
// 64 channels for 132 SMs). Stage 1: block (ch, part) sums its chunk, each thread a strided run,
// then the block in a fixed tree; stage 2 (channel_finish): one thread per channel sums its
// parts in order. The same inputs give the same bits on every run. I is the index type: 32-bit
// where the tensor has fewer than 2^32 elements (no 64-bit division per element), else 64-bit.
// sums = 0: [Σx, Σx²]; sums = 1: [Σg', Σg'·(x − mean[ch])] with g' = g masked by y > 0 when relu.
template <typename T, typename I>
__device__ void channel_partial(I c, I inner, I m, I parts, const T* x, const T* g, const T* y, const double* mean,
                                int sums, int relu, double* partial) {
    __shared__ double s1[SUM_THREADS];
    __shared__ double s2[SUM_THREADS];
    const I ch = blockIdx.x, part = blockIdx.y;
    const I chunk = (m + parts - 1) / parts;
    const I lo = part * chunk;
    const I hi = lo + chunk < m ? lo + chunk : m;
    const double mu = sums ? mean[ch] : 0.0;
    double a1 = 0.0, a2 = 0.0;
    for (I k = lo + threadIdx.x; k < hi; k += SUM_THREADS) {
        const I img = k / inner;
        const I at = (img * c + ch) * inner + (k - img * inner);
        if (sums) {
            const double gv = (double)widen(g[at]);
            const double gp = (!relu || widen(y[at]) > 0) ? gv : 0.0;
            a1 += gp;
            a2 += gp * ((double)widen(x[at]) - mu);
        } else {
            const double v = (double)widen(x[at]);
            a1 += v;
            a2 += v * v;
        }
    }
    s1[threadIdx.x] = a1;
    s2[threadIdx.x] = a2;
    for (int stride = SUM_THREADS / 2; stride > 0; stride /= 2) {
        __syncthreads();
        if (threadIdx.x < stride) {
            s1[threadIdx.x] += s1[threadIdx.x + stride];
            s2[threadIdx.x] += s2[threadIdx.x + stride];
        }
    }
    if (threadIdx.x == 0) {
        partial[(size_t)ch * parts + part] = s1[0];
        partial[((size_t)c + ch) * parts + part] = s2[0];
    }
}

// Stage 2: out[ch] and out[c + ch] are the sums of the channel's parts, in order; with
// `count` >= 0, out[2c] = count (the moments' value count, [Σx; Σx²; n]).
extern "C" __global__ void channel_finish(size_t c, size_t parts, const double* partial, double count, double* out) {
    for (size_t ch = blockIdx.x * (size_t)blockDim.x + threadIdx.x; ch < c; ch += (size_t)blockDim.x * gridDim.x) {
        double a1 = 0.0, a2 = 0.0;
        for (size_t p = 0; p < parts; ++p) {
            a1 += partial[ch * parts + p];
            a2 += partial[(c + ch) * parts + p];
        }
        out[ch] = a1;
        out[c + ch] = a2;
    }
    if (count >= 0.0 && blockIdx.x == 0 && threadIdx.x == 0) out[2 * c] = count;
}

// Batch norm's forward over len elements of an [n, c, inner] tensor, with
// u = a[ch]·x + b[ch], a and b rows 2 and 3 of the coefficients table coef (coef2: the
// shortcut's, mode 3):
//   mode 0: u;  mode 1: max(u, 0);  mode 2: max(u + third, 0) (a skip input);
//   mode 3: max(u + (a2[ch]·third + b2[ch]), 0) (third: a normalised shortcut's input).
// bf16: each normalisation's output is rounded to bf16 before the residual sum, as unfused
// bf16 ops store it (the CPU kernel's round_bf16).
template <typename T>
__device__ void bn_forward(size_t len, size_t c, size_t inner, const T* x, const T* third, const double* coef,
                           const double* coef2, int mode, T* out) {
    typedef typename Compute<T>::type C;
    const C zero = C(0);
    const double *a = coef + 2 * c, *b = coef + 3 * c, *a2 = coef2 + 2 * c, *b2 = coef2 + 3 * c;
    GRID_STRIDE(i, len) {
        const size_t ch = (i / inner) % c;
        const C v = widen(x[i]);
        C z;
        const C ac = (C)a[ch], bc = (C)b[ch];
        if (mode < 2) {
            z = v * ac + bc;
            if (mode == 1) z = z > zero ? z : zero;
        } else {
            const C w = widen(third[i]);
            const C a2c = (C)a2[ch], b2c = (C)b2[ch];
            if (IsBf16<T>::value) {
                const C main = (C)round_bf16((float)(v * ac + bc));
                z = mode == 3 ? main + (C)round_bf16((float)(w * a2c + b2c)) : main + w;
            } else if (mode == 3) {
                z = v * ac + bc + (w * a2c + b2c);
            } else {
                z = v * ac + bc + w;
            }
            z = z > zero ? z : zero;
        }
        store(out + i, z);
    }
}

// Batch norm's input gradient, dx = k[ch]·g' + c1[ch]·(x − mu[ch]) + c0[ch] with g' = g masked
// by y > 0 when relu; k, c1, c0, mu are rows 0-3 of the backward table (already rounded to the
// compute type, so the conversion is exact). (A skip input's gradient is relu_bwd's.)
template <typename T>
__device__ void bn_backward_dx(size_t len, size_t c, size_t inner, const T* g, const T* x, const T* y,
                               const double* table, int relu, T* dx) {
    typedef typename Compute<T>::type C;
    const C zero = C(0);
    GRID_STRIDE(i, len) {
        const size_t ch = (i / inner) % c;
        const C gp = (!relu || widen(y[i]) > zero) ? widen(g[i]) : zero;
        const C k = (C)table[ch], c1 = (C)table[c + ch], c0 = (C)table[2 * c + ch], mu = (C)table[3 * c + ch];
        store(dx + i, k * gp + c1 * (widen(x[i]) - mu) + c0);
    }
}

__device__ __forceinline__ float erf_c(float v) { return erff(v); }
__device__ __forceinline__ double erf_c(double v) { return erf(v); }
__device__ __forceinline__ float exp_c(float v) { return expf(v); }
__device__ __forceinline__ double exp_c(double v) { return exp(v); }

// GELU, exact form: out = (1/2·x)·(1 + erf(x·(1/√2))), as the CPU kernel (src/activation.rs)
// evaluates it. The CPU's f32 erf is a vectorised formula (absolute error below 3e-7), CUDA's
// erff is within 2 ulp: the two agree to f32 tolerance, and f64 to a few ulp.
template <typename T>
__device__ void gelu_fwd(size_t n, const T* x, T* out) {
    typedef typename Compute<T>::type C;
    const C half = C(0.5), one = C(1), r = C(0.7071067811865476);
    GRID_STRIDE(i, n) {
        const C v = widen(x[i]);
        store(out + i, half * v * (one + erf_c(v * r)));
    }
}

// GELU's backward from its input: dx = g·((1/2)·(1 + erf(x/√2)) + x·e^(−x²/2)·(1/√(2π))).
template <typename T>
__device__ void gelu_bwd(size_t n, const T* x, const T* g, T* out) {
    typedef typename Compute<T>::type C;
    const C half = C(0.5), one = C(1), r = C(0.7071067811865476);
    const C neg_half = C(-0.5), inv_sqrt_2pi = C(0.3989422804014327);
    GRID_STRIDE(i, n) {
        const C v = widen(x[i]);
        const C e = exp_c(neg_half * v * v);
        store(out + i, widen(g[i]) * (half * (one + erf_c(v * r)) + v * e * inv_sqrt_2pi));
    }
}

#define INSTANTIATE(T, SUF)                                                                                     \
    extern "C" __global__ void gelu_fwd_##SUF(size_t n, const T* x, T* out) { gelu_fwd<T>(n, x, out); }        \
    extern "C" __global__ void gelu_bwd_##SUF(size_t n, const T* x, const T* g, T* out) {                      \
        gelu_bwd<T>(n, x, g, out);                                                                              \
    }                                                                                                           \
    extern "C" __global__ void relu_fwd_##SUF(size_t n, const T* a, const T* b, int has_b, T* out) {            \
        relu_fwd<T>(n, a, b, has_b, out);                                                                       \
    }                                                                                                           \
    extern "C" __global__ void relu_bwd_##SUF(size_t n, const T* y, const T* g, T* out) {                      \
        relu_bwd<T>(n, y, g, out);                                                                              \
    }                                                                                                           \
    extern "C" __global__ void bn_forward_##SUF(size_t len, size_t c, size_t inner, const T* x, const T* third,   \
                                                const double* coef, const double* coef2, int mode, T* out) {    \
        bn_forward<T>(len, c, inner, x, third, coef, coef2, mode, out);                                         \
    }                                                                                                           \
    extern "C" __global__ void bn_backward_dx_##SUF(size_t len, size_t c, size_t inner, const T* g, const T* x,  \
                                                    const T* y, const double* table, int relu, T* dx) {         \
        bn_backward_dx<T>(len, c, inner, g, x, y, table, relu, dx);                                             \
    }

INSTANTIATE(float, f32)
INSTANTIATE(double, f64)
INSTANTIATE(__nv_bfloat16, bf16)

#define PARTIAL(T, SUF, I, ISUF)                                                                                \
    extern "C" __global__ void channel_partial_##SUF##_##ISUF(I c, I inner, I m, I parts, const T* x, const T* g, \
                                                               const T* y, const double* mean, int sums, int relu, \
                                                               double* partial) {                               \
        channel_partial<T, I>(c, inner, m, parts, x, g, y, mean, sums, relu, partial);                          \
    }

PARTIAL(float, f32, unsigned int, u32)
PARTIAL(double, f64, unsigned int, u32)
PARTIAL(__nv_bfloat16, bf16, unsigned int, u32)
PARTIAL(float, f32, unsigned long long, u64)
PARTIAL(double, f64, unsigned long long, u64)
PARTIAL(__nv_bfloat16, bf16, unsigned long long, u64)

// Layer norm over rows of d values (src/norm.rs's CPU kernels, in the tensor's type T, f32 or
// f64): one block per row, its sums reduced over the block in a fixed tree order (not the CPU's
// sequential order: the two agree to f32 / f64 tolerance).
#define LN_THREADS 256

__device__ __forceinline__ float sqrt_c(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_c(double v) { return sqrt(v); }

// The sum of every thread's v over the block (blockDim.x == LN_THREADS), on every thread.
template <typename T>
__device__ T ln_block_sum(T v, T* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = LN_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    const T total = shared[0];
    __syncthreads();
    return total;
}

// Row r's mean and 1/sqrt(var + eps) (biased variance, two passes), as the CPU's `moments`.
template <typename T>
__device__ void ln_moments(const T* xr, size_t d, T eps, T* shared, T* mean, T* rstd) {
    T s = T(0);
    for (size_t i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
    const T m = ln_block_sum(s, shared) / (T)d;
    T ss = T(0);
    for (size_t i = threadIdx.x; i < d; i += blockDim.x) {
        const T c = xr[i] - m;
        ss += c * c;
    }
    *mean = m;
    *rstd = T(1) / sqrt_c(ln_block_sum(ss, shared) / (T)d + eps);
}

// y = (x − mean)·rstd·γ + β per row.
template <typename T>
__device__ void layer_norm_fwd(size_t rows, size_t d, const T* x, const T* gamma, const T* beta, T eps, T* y) {
    __shared__ T shared[LN_THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        T mean, rstd;
        ln_moments(xr, d, eps, shared, &mean, &rstd);
        for (size_t i = threadIdx.x; i < d; i += blockDim.x) y[r * d + i] = (xr[i] - mean) * rstd * gamma[i] + beta[i];
    }
}

// ∂x per row, with x̂ = (x − mean)·rstd and ĝ = ∂y·γ: rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)); each row's
// mean and rstd go to stats[2r], stats[2r + 1] for the column sums.
template <typename T>
__device__ void layer_norm_bwd_rows(size_t rows, size_t d, const T* x, const T* gamma, const T* gy, T eps, T inv_d,
                                    T* dx, T* stats) {
    __shared__ T shared[LN_THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        const T* gr = gy + r * d;
        T mean, rstd;
        ln_moments(xr, d, eps, shared, &mean, &rstd);
        T a = T(0), b = T(0);
        for (size_t i = threadIdx.x; i < d; i += blockDim.x) {
            const T xhat = (xr[i] - mean) * rstd;
            const T gh = gr[i] * gamma[i];
            a += gh;
            b += gh * xhat;
        }
        a = ln_block_sum(a, shared) * inv_d;
        b = ln_block_sum(b, shared) * inv_d;
        for (size_t i = threadIdx.x; i < d; i += blockDim.x) {
            const T xhat = (xr[i] - mean) * rstd;
            dx[r * d + i] = rstd * (gr[i] * gamma[i] - a - xhat * b);
        }
        if (threadIdx.x == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// ∂γ[j] = Σ_rows ∂y·x̂ and ∂β[j] = Σ_rows ∂y in two stages over a partition fixed by the shape
// (the same bits every run). Stage 1: block (column tile, row part) of LN_COLS x LN_ROWS threads
// reads LN_COLS adjacent columns (coalesced) of its rows, each thread every LN_ROWS-th row of
// the part in order; the LN_ROWS partial sums of a column are added in a fixed tree and written
// to partial[part][j] (∂γ) and partial[parts + part][j] (∂β). Stage 2: each column sums its
// parts in order.
#define LN_COLS 32
#define LN_ROWS 8

template <typename T>
__device__ void layer_norm_bwd_cols_partial(size_t rows, size_t d, size_t parts, const T* x, const T* gy, const T* stats,
                                            T* partial) {
    __shared__ T sg[LN_ROWS][LN_COLS];
    __shared__ T sb[LN_ROWS][LN_COLS];
    const size_t j = blockIdx.x * (size_t)LN_COLS + threadIdx.x;
    const size_t part = blockIdx.y;
    const size_t chunk = (rows + parts - 1) / parts;
    const size_t lo = part * chunk;
    const size_t hi = lo + chunk < rows ? lo + chunk : rows;
    T dg = T(0), db = T(0);
    if (j < d) {
        for (size_t r = lo + threadIdx.y; r < hi; r += LN_ROWS) {
            const T g = gy[r * d + j];
            dg += g * ((x[r * d + j] - stats[2 * r]) * stats[2 * r + 1]);
            db += g;
        }
    }
    sg[threadIdx.y][threadIdx.x] = dg;
    sb[threadIdx.y][threadIdx.x] = db;
    for (int s = LN_ROWS / 2; s > 0; s /= 2) {
        __syncthreads();
        if (threadIdx.y < s) {
            sg[threadIdx.y][threadIdx.x] += sg[threadIdx.y + s][threadIdx.x];
            sb[threadIdx.y][threadIdx.x] += sb[threadIdx.y + s][threadIdx.x];
        }
    }
    if (threadIdx.y == 0 && j < d) {
        partial[part * d + j] = sg[0][threadIdx.x];
        partial[(parts + part) * d + j] = sb[0][threadIdx.x];
    }
}

template <typename T>
__device__ void layer_norm_bwd_cols_finish(size_t d, size_t parts, const T* partial, T* dgamma, T* dbeta) {
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < d; j += (size_t)blockDim.x * gridDim.x) {
        T dg = T(0), db = T(0);
        for (size_t p = 0; p < parts; ++p) {
            dg += partial[p * d + j];
            db += partial[(parts + p) * d + j];
        }
        dgamma[j] = dg;
        dbeta[j] = db;
    }
}

#define LAYER_NORM(T, SUF)                                                                                      \
    extern "C" __global__ void layer_norm_fwd_##SUF(size_t rows, size_t d, const T* x, const T* gamma,          \
                                                    const T* beta, T eps, T* y) {                               \
        layer_norm_fwd<T>(rows, d, x, gamma, beta, eps, y);                                                     \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_bwd_rows_##SUF(size_t rows, size_t d, const T* x, const T* gamma,     \
                                                         const T* gy, T eps, T inv_d, T* dx, T* stats) {        \
        layer_norm_bwd_rows<T>(rows, d, x, gamma, gy, eps, inv_d, dx, stats);                                   \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_bwd_cols_partial_##SUF(size_t rows, size_t d, size_t parts, const T* x, \
                                                                 const T* gy, const T* stats, T* partial) {     \
        layer_norm_bwd_cols_partial<T>(rows, d, parts, x, gy, stats, partial);                                  \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_bwd_cols_finish_##SUF(size_t d, size_t parts, const T* partial,        \
                                                                T* dgamma, T* dbeta) {                          \
        layer_norm_bwd_cols_finish<T>(d, parts, partial, dgamma, dbeta);                                        \
    }

LAYER_NORM(float, f32)
LAYER_NORM(double, f64)
