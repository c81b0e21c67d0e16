// The optimizer's in-place updates on CUDA, one kernel per pass over a parameter: the CUDA
// twins of allgrad-train's fused CPU updates (src/optim_fused.rs there), evaluating the same
// expressions in the same order in the parameter's dtype (compiled with --fmad=false, so no
// multiply-add is contracted where the CPU rounds twice): f32 and f64 parameters.
//
// Exported names end in _f32 or _f64. Scalars arrive already rounded to the element type, as
// the CPU kernels round them (T::from_f64). With `guarded`, `ok` points to a one-byte flag on
// the device (the trainer's "loss and gradient norm are finite"): a zero flag leaves every
// element as it was, so a step with a non-finite gradient is skipped without the host reading
// the flag first.
#include <stddef.h>

#define SKIPPED (guarded && *ok == 0)

#define GRID_STRIDE(i, n) \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)blockDim.x * gridDim.x)

// AdamW's moment: m = m·β + (1−β)·g, or with `squared` m = m·β + g·g·(1−β).
template <typename T>
__device__ void adam_moment(size_t n, T* m, const T* g, T beta, T one_minus_beta, int squared,
                            const unsigned char* ok, int guarded) {
    if (SKIPPED) return;
    GRID_STRIDE(i, n) {
        const T gi = g[i];
        m[i] = m[i] * beta + (squared ? gi * gi * one_minus_beta : gi * one_minus_beta);
    }
}

// AdamW's step: w = w − (m̂ / (√v̂ + ε) + wd·w)·lr, with m̂ = m / bc1 and v̂ = v / bc2 (the square
// root taken in f64 and rounded to T, as on the CPU).
template <typename T>
__device__ void adam_step(size_t n, T* w, const T* m, const T* v, T bc1, T bc2, T eps, T wd, T lr,
                          const unsigned char* ok, int guarded) {
    if (SKIPPED) return;
    GRID_STRIDE(i, n) {
        const T step = (m[i] / bc1) / ((T)sqrt((double)(v[i] / bc2)) + eps);
        w[i] = w[i] - (step + w[i] * wd) * lr;
    }
}

// SGD's momentum buffer: d = g (+ wd·w when `decay`), buf = buf·μ + d.
template <typename T>
__device__ void sgd_momentum(size_t n, T* buf, const T* g, const T* w, T mo, T wd, int decay,
                             const unsigned char* ok, int guarded) {
    if (SKIPPED) return;
    GRID_STRIDE(i, n) {
        const T d = decay ? g[i] + w[i] * wd : g[i];
        buf[i] = buf[i] * mo + d;
    }
}

// SGD's step from g and the already updated buffer: d = g (+ wd·w); with momentum d = buf, or
// nesterov d + buf·μ; w = w − d·lr.
template <typename T>
__device__ void sgd_step(size_t n, T* w, const T* g, const T* buf, T mo, T wd, T lr, int decay, int momentum, int nesterov,
                         const unsigned char* ok, int guarded) {
    if (SKIPPED) return;
    GRID_STRIDE(i, n) {
        T d = decay ? g[i] + w[i] * wd : g[i];
        if (momentum) d = nesterov ? d + buf[i] * mo : buf[i];
        w[i] = w[i] - d * lr;
    }
}

#define OPTIM_KERNELS(T, SUF)                                                                                   \
    extern "C" __global__ void adam_moment_##SUF(size_t n, T* m, const T* g, T beta, T one_minus_beta,          \
                                                 int squared, const unsigned char* ok, int guarded) {          \
        adam_moment<T>(n, m, g, beta, one_minus_beta, squared, ok, guarded);                                    \
    }                                                                                                           \
    extern "C" __global__ void adam_step_##SUF(size_t n, T* w, const T* m, const T* v, T bc1, T bc2, T eps,     \
                                               T wd, T lr, const unsigned char* ok, int guarded) {              \
        adam_step<T>(n, w, m, v, bc1, bc2, eps, wd, lr, ok, guarded);                                           \
    }                                                                                                           \
    extern "C" __global__ void sgd_momentum_##SUF(size_t n, T* buf, const T* g, const T* w, T mo, T wd,         \
                                                  int decay, const unsigned char* ok, int guarded) {            \
        sgd_momentum<T>(n, buf, g, w, mo, wd, decay, ok, guarded);                                              \
    }                                                                                                           \
    extern "C" __global__ void sgd_step_##SUF(size_t n, T* w, const T* g, const T* buf, T mo, T wd, T lr,       \
                                              int decay, int momentum, int nesterov, const unsigned char* ok,   \
                                              int guarded) {                                                    \
        sgd_step<T>(n, w, g, buf, mo, wd, lr, decay, momentum, nesterov, ok, guarded);                          \
    }

OPTIM_KERNELS(float, f32)
OPTIM_KERNELS(double, f64)
