//! CPU plumbing shared by the kernels: the float element trait, strided-to-contiguous copies,
//! a bounds-checked GEMM wrapper and the batch-parallel plan.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType};
use gemm::Parallelism;
use half::bf16;

use crate::error::{fail, NnError};
use crate::simd::{SimdLevel, SimdPlan, LANES};

/// Elements per parallel task of the element-wise kernels: large enough that a task outweighs
/// its scheduling.
pub(crate) const GRAIN: usize = 1 << 15;

/// The element types the CPU kernels are written for (`f32` and `f64`).
pub(crate) trait Float: WithDType {
    /// Negative infinity, the identity of `max`.
    const NEG_INFINITY: Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
    /// `v ← e^v` over a slice: f64 through the C library (one copy), f32 through
    /// [`crate::vmath`] in `level`'s copy.
    fn exp_in_place(level: SimdPlan, xs: &mut [Self]);
    /// `o[i] = x[i]/2 · (1 + erf(x[i]/√2))` in one pass: f64 through Candle's exact `erf` in
    /// one copy whatever the level (counted as baseline), f32 through the vectorised formula of [`crate::vmath`] (erf's absolute error below
    /// 3e-7, tested) in `level`'s copy ([`crate::simd`]).
    fn gelu_into(level: SimdPlan, o: &mut [MaybeUninit<Self>], xs: &[Self]);
    /// `o[i] = g[i] · GELU'(x[i])` in one pass, as [`Float::gelu_into`].
    fn gelu_grad_into(level: SimdPlan, o: &mut [MaybeUninit<Self>], xs: &[Self], gs: &[Self]);
    /// This thread's pool of scratch buffers of this type (see [`Scratch`]).
    fn scratch_pool() -> &'static std::thread::LocalKey<std::cell::RefCell<Vec<Vec<Self>>>>;
}

macro_rules! impl_float {
    ($t:ty, $exp:path, $gelu:path, $gelu_grad:path) => {
        impl Float for $t {
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn exp_in_place(level: SimdPlan, xs: &mut [Self]) {
                $exp(level, xs)
            }
            fn gelu_into(level: SimdPlan, o: &mut [MaybeUninit<Self>], xs: &[Self]) {
                $gelu(level, o, xs)
            }
            fn gelu_grad_into(level: SimdPlan, o: &mut [MaybeUninit<Self>], xs: &[Self], gs: &[Self]) {
                $gelu_grad(level, o, xs, gs)
            }
            fn scratch_pool() -> &'static std::thread::LocalKey<std::cell::RefCell<Vec<Vec<Self>>>> {
                thread_local! {
                    static POOL: std::cell::RefCell<Vec<Vec<$t>>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                &POOL
            }
        }
    };
}
impl_float!(f32, crate::vmath::exp_at, crate::vmath::gelu_at, crate::vmath::gelu_grad_at);
impl_float!(f64, exp_f64_in_place, gelu_f64, gelu_grad_f64);

/// f64 GELU: one copy, compiled for the baseline, whatever the level (its cost is Candle's exact
/// `erf`, a scalar function called per element, which a wider copy of this loop would not
/// vectorise), so it counts as a baseline run in [`crate::simd_paths`] at every level.
fn gelu_f64(plan: SimdPlan, o: &mut [MaybeUninit<f64>], xs: &[f64]) {
    plan.ran(SimdLevel::Baseline);
    let r = std::f64::consts::FRAC_1_SQRT_2;
    for (o, &x) in o.iter_mut().zip(xs) {
        o.write(0.5 * x * (1.0 + candle_core::cpu::erf::erf_f64(x * r)));
    }
}

/// f64 GELU's gradient: one copy, as [`gelu_f64`].
fn gelu_grad_f64(plan: SimdPlan, o: &mut [MaybeUninit<f64>], xs: &[f64], gs: &[f64]) {
    plan.ran(SimdLevel::Baseline);
    let (r, c) = (std::f64::consts::FRAC_1_SQRT_2, 1.0 / (2.0 * std::f64::consts::PI).sqrt());
    for (o, (&x, &g)) in o.iter_mut().zip(xs.iter().zip(gs)) {
        o.write(g * (0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x * r)) + x * (-0.5 * x * x).exp() * c));
    }
}

/// f64 `exp`: the C library's, one copy, called from inside the copies of the loops around it
/// (softmax, attention), which count the run.
fn exp_f64_in_place(_: SimdPlan, xs: &mut [f64]) {
    xs.iter_mut().for_each(|v| *v = v.exp());
}

/// `Σ acc`, pairwise in a fixed order (16 → 8 → 4 → 2 → 1).
#[inline(always)]
pub(crate) fn fold<T: Float>(mut acc: [T; LANES]) -> T {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            let v = acc[j + w];
            acc[j] += v;
        }
    }
    acc[0]
}

/// `Σ_i f(a[i], b[i])` over two rows of one length, in [`LANES`] partial sums (element `i` into
/// sum `i mod LANES`) combined by [`fold`]: the same operations in the same order on every SIMD
/// path, which the compiler vectorises.
#[inline(always)]
pub(crate) fn lane_sum<T: Float>(a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> T {
    let mut acc = [T::from_f64(0.0); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[T; LANES], &[T; LANES]) = (x.try_into().expect("exact chunk"), y.try_into().expect("exact chunk"));
        for j in 0..LANES {
            acc[j] += f(x[j], y[j]);
        }
    }
    for (j, (&x, &y)) in ta.iter().zip(tb).enumerate() {
        acc[j] += f(x, y);
    }
    fold(acc)
}

/// A zero-filled vector of `len` elements, zeroed by the rayon pool. A large `vec![0; len]` is
/// a calloc, and when the allocator hands back reused memory calloc clears it with one serial
/// memset on the calling thread while the pool waits (a few percent of a 2-core ResNet step).
pub(crate) fn zeros<T: Float>(len: usize) -> Vec<T> {
    use rayon::prelude::*;
    let zero = T::from_f64(0.0);
    // Below a few tasks' worth the pool's hand-off costs more than the memset.
    if len < 4 * GRAIN {
        return vec![zero; len];
    }
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len].par_chunks_mut(GRAIN).for_each(|c| {
        for e in c {
            e.write(zero);
        }
    });
    // SAFETY: the capacity is at least `len` and the first `len` elements were initialised above.
    unsafe { v.set_len(len) };
    v
}

/// Buffers a thread keeps between scratch requests (the convolution needs at most three at
/// once: column matrix, its gradient, a gathered block).
const SCRATCH_KEPT: usize = 4;

/// A scratch buffer of `len` elements whose contents are unspecified (stale values of an
/// earlier request): the kernel must write every element it reads. It comes from, and returns
/// to on drop, a small pool per thread, so that the convolution's column matrices (up to 9 MiB
/// per block) are neither zeroed nor faulted in again in every call, as a fresh `vec![0; len]`
/// would be (calloc clears reused memory with a serial memset: 2-6% of a ResNet layer).
///
/// Memory: each pool thread keeps up to [`SCRATCH_KEPT`] buffers, as large as the largest
/// requests it served. In debug builds a buffer is filled with NaN when handed out, so a kernel
/// that reads an element it did not write fails its tests instead of reading stale data.
pub(crate) struct Scratch<T: Float>(Vec<T>);

impl<T: Float> Scratch<T> {
    /// A buffer of `len` elements from this thread's pool (the smallest one that holds `len`,
    /// else the largest, grown), or a new one.
    pub fn take(len: usize) -> Self {
        if len == 0 {
            // Leaves the pool's buffers to the requests that need them.
            return Self(Vec::new());
        }
        let mut buf = T::scratch_pool().with(|pool| {
            let mut pool = pool.borrow_mut();
            let fits = (0..pool.len()).filter(|&i| pool[i].capacity() >= len).min_by_key(|&i| pool[i].capacity());
            let pick = fits.or_else(|| (0..pool.len()).max_by_key(|&i| pool[i].capacity()));
            pick.map(|i| pool.swap_remove(i)).unwrap_or_default()
        });
        if buf.len() > len {
            buf.truncate(len);
        } else {
            // Only the growth is written.
            buf.resize(len, T::from_f64(0.0));
        }
        if cfg!(debug_assertions) {
            buf.fill(T::from_f64(f64::NAN));
        }
        Self(buf)
    }
}

impl<T: Float> Deref for Scratch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T: Float> std::ops::DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.0
    }
}

impl<T: Float> Drop for Scratch<T> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        if buf.capacity() == 0 {
            return;
        }
        // `try_with`: during thread teardown the pool may already be gone; the buffer is then freed.
        let _ = T::scratch_pool().try_with(|pool| {
            let mut pool = pool.borrow_mut();
            pool.push(buf);
            if pool.len() > SCRATCH_KEPT {
                // Keep the largest ones.
                let smallest = (0..pool.len()).min_by_key(|&i| pool[i].capacity()).unwrap_or(0);
                pool.swap_remove(smallest);
            }
        });
    }
}

/// `v` widened to f32 (exact), in parallel.
pub(crate) fn widen(v: &[bf16]) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let mut out = zeros::<f32>(v.len());
    out.par_chunks_mut(GRAIN).zip(v.par_chunks(GRAIN)).for_each(|(o, i)| i.convert_to_f32_slice(o));
    out
}

/// `v` rounded to bf16 precision and kept as f32 (an f32 parameter as a bf16 operand).
pub(crate) fn bf16_values(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Whether `x` is a bf16 activation used with an f32 parameter `p` on the CPU: the parameter
/// enters the kernel rounded to bf16 ([`bf16_values`]) and its gradient comes back f32.
pub(crate) fn bf16_with_f32(x: &Tensor, p: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::BF16 && p.dtype() == DType::F32
}

/// `v` rounded to bf16 (to nearest, ties to even), in parallel.
pub(crate) fn narrow(v: Vec<f32>) -> Vec<bf16> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let mut out = vec![bf16::ZERO; v.len()];
    out.par_chunks_mut(GRAIN).zip(v.par_chunks(GRAIN)).for_each(|(o, i)| o.convert_from_f32_slice(i));
    out
}

/// Runs a kernel on CPU storages that all hold f32, all f64 or all bf16: binds each
/// `storage => slice`, evaluates `body` (a `Vec` of the same float type) and wraps it in the
/// matching `CpuStorage`; any other combination returns [`crate::NnError::UnsupportedDType`]
/// for `op` from the enclosing function. The one float dispatch of the CPU kernels.
///
/// bf16 storages (autocast, [`crate::autocast`]) are widened to f32 (exactly), the body runs
/// in f32, and its result is rounded to bf16: the arithmetic of PyTorch's CPU kernels for bf16
/// tensors, which compute in f32 and round what they store.
macro_rules! float_kernel {
    ($op:expr, $first:ident => $fv:ident $(, $s:ident => $v:ident)* ; $body:expr) => {
        match ($first, $($s,)*) {
            (candle_core::CpuStorage::F32($fv), $(candle_core::CpuStorage::F32($v),)*) => candle_core::CpuStorage::F32($body),
            (candle_core::CpuStorage::F64($fv), $(candle_core::CpuStorage::F64($v),)*) => candle_core::CpuStorage::F64($body),
            (candle_core::CpuStorage::BF16($fv), $(candle_core::CpuStorage::BF16($v),)*) => {
                let $fv = &$crate::cpu::widen($fv);
                $(let $v = &$crate::cpu::widen($v);)*
                candle_core::CpuStorage::BF16($crate::cpu::narrow($body))
            }
            _ => {
                let dtype = candle_core::backend::BackendStorage::dtype($first);
                return $crate::error::fail($crate::error::NnError::UnsupportedDType { op: $op, dtype });
            }
        }
    };
}
pub(crate) use float_kernel;

/// The elements of `data` seen through `layout`, in row-major order: borrowed when the layout is
/// already contiguous, copied otherwise.
pub(crate) fn contiguous<'a, T: Copy>(data: &'a [T], layout: &Layout) -> Cow<'a, [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Cow::Borrowed(&data[start..end]),
        None => {
            let out = gather_strided(data, layout);
            COPIES.fetch_add(1, Ordering::Relaxed);
            COPIED_BYTES.fetch_add((out.len() * std::mem::size_of::<T>()) as u64, Ordering::Relaxed);
            Cow::Owned(out)
        }
    }
}

static COPIES: AtomicU64 = AtomicU64::new(0);
static COPIED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Strided inputs the CPU kernels copied into row-major buffers so far in this process, and
/// their bytes (every thread; for the benchmarks, which count the copies of a backward pass).
/// Candle's own copies (`Tensor::contiguous`) are not among them.
#[doc(hidden)]
pub fn strided_copies() -> (u64, u64) {
    (COPIES.load(Ordering::Relaxed), COPIED_BYTES.load(Ordering::Relaxed))
}

/// Copies a strided view into a new row-major vector, one innermost run at a time.
fn gather_strided<T: Copy>(data: &[T], layout: &Layout) -> Vec<T> {
    let (dims, stride) = (layout.dims(), layout.stride());
    let len: usize = dims.iter().product();
    let mut out = Vec::with_capacity(len);
    if len == 0 {
        return out;
    }
    let Some((&inner, outer)) = dims.split_last() else {
        out.push(data[layout.start_offset()]);
        return out;
    };
    let inner_stride = stride[dims.len() - 1];
    let mut index = vec![0usize; outer.len()];
    loop {
        let base = layout.start_offset() + index.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend((0..inner).map(|j| data[base + j * inner_stride]));
        // Advance the outer multi-index like an odometer.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Offset and strides of a rank-4 layout, in elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strides4 {
    pub offset: usize,
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
}

impl Strides4 {
    /// Reads the strides of a rank-4 layout (the caller has checked the rank).
    pub fn of(layout: &Layout) -> Self {
        let s = layout.stride();
        Self { offset: layout.start_offset(), n: s[0], c: s[1], h: s[2], w: s[3] }
    }
}

/// How a batch of independent images is spread over the rayon pool.
#[derive(Clone, Copy)]
pub(crate) struct BatchPlan {
    /// Number of chunks the batch is cut into (each chunk is one task).
    pub chunks: usize,
    /// Images per chunk (the last chunk may hold fewer).
    pub per_chunk: usize,
    /// Parallelism for GEMMs inside a task: the whole pool when there are fewer images than
    /// threads, none otherwise (the tasks already occupy every thread).
    pub gemm: Parallelism,
}

impl BatchPlan {
    /// Plans `n` images into at most `max_chunks_per_thread` chunks per thread. The plan depends
    /// only on `n` and the pool size, never on scheduling, so reductions over chunks are
    /// deterministic on a given machine.
    pub fn new(n: usize, max_chunks_per_thread: usize) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let chunks = n.clamp(1, threads * max_chunks_per_thread.max(1));
        let per_chunk = n.div_ceil(chunks).max(1);
        let chunks = n.div_ceil(per_chunk).max(1);
        let gemm = if n < threads { Parallelism::Rayon(threads) } else { Parallelism::None };
        if n < threads {
            crate::trace::count(|t| t.parallel_gemm += 1);
        }
        Self { chunks, per_chunk, gemm }
    }
}

/// A read-only matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A view with row stride `rs` and column stride `cs`.
    pub fn new(data: &'a [T], rs: usize, cs: usize) -> Self {
        Self { data, rs, cs }
    }

    /// Panics (an internal bug, never user input) unless every element of a `rows x cols` view
    /// lies inside `data`.
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.rs + (cols - 1) * self.cs;
            assert!(last < self.data.len(), "allgrad-nn internal error: {what} view out of bounds");
        }
    }
}

/// `dst (m x n, row stride dst_rs, unit column stride) (+)= lhs (m x k) · rhs (k x n)`.
///
/// With `accumulate` the product is added to `dst`, otherwise `dst` is overwritten.
pub(crate) fn matmul<T: Float>(
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    (m, n, k): (usize, usize, usize),
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    MatRef::new(&*dst, dst_rs, 1).check(m, n, "dst");
    // SAFETY: `dst` holds the `m x n` view (checked above) and, borrowed mutably, aliases
    // neither operand.
    unsafe { gemm_raw(dst.as_mut_ptr(), dst_rs, accumulate, lhs, rhs, (m, n, k), parallelism) }
}

/// `lhs (m x k) · rhs (k x n)` as a new row-major `m x n` vector. The GEMM writes every element
/// without reading it (`gemm`'s `read_dst = false` sets its `alpha` to zero, and no path then
/// reads the destination), so the buffer is not zero-filled first: on a dense layer's `∂x` that
/// fill was a full pass over an activation-sized buffer per layer and step. In debug builds the
/// buffer is filled with NaN first, so a GEMM that read it would fail the tests.
pub(crate) fn matmul_new<T: Float>(
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    (m, n, k): (usize, usize, usize),
    parallelism: Parallelism,
) -> Vec<T> {
    let len = m * n;
    if cfg!(debug_assertions) || k == 0 || len == 0 {
        let mut v = vec![T::from_f64(if k == 0 { 0.0 } else { f64::NAN }); len];
        matmul(&mut v, n, false, lhs, rhs, (m, n, k), parallelism);
        return v;
    }
    let mut v = Vec::<T>::with_capacity(len);
    // SAFETY: the spare capacity holds `len` elements, the `m x n` view with row stride `n`;
    // it aliases neither operand; the GEMM writes every element of it without reading any
    // (see above, `k > 0`), so all `len` are initialised when the length is set.
    unsafe {
        gemm_raw(v.spare_capacity_mut().as_mut_ptr().cast::<T>(), n, false, lhs, rhs, (m, n, k), parallelism);
        v.set_len(len);
    }
    v
}

/// The GEMM behind [`matmul`] and [`matmul_new`], on a raw destination.
///
/// # Safety
/// `dst` must be valid for writes (and, with `accumulate`, for reads of initialised values) of
/// the `m x n` view with row stride `dst_rs` and unit column stride, and alias neither operand.
/// `m` and `n` are positive.
unsafe fn gemm_raw<T: Float>(
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    (m, n, k): (usize, usize, usize),
    parallelism: Parallelism,
) {
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst.add(i * dst_rs + j).write(T::from_f64(0.0));
                }
            }
        }
        return;
    }
    lhs.check(m, k, "lhs");
    rhs.check(k, n, "rhs");
    // SAFETY: the operands' views were bounds-checked above, the destination is the caller's
    // to vouch for, and `T` is f32 or f64, both supported by `gemm`.
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs.data.as_ptr(),
        lhs.cs as isize,
        lhs.rs as isize,
        rhs.data.as_ptr(),
        rhs.cs as isize,
        rhs.rs as isize,
        T::from_f64(1.0),
        T::from_f64(1.0),
        false,
        false,
        false,
        parallelism,
    )
}

/// A backward kernel that computes several gradients at once (`∂x`, `∂W`, `∂b`), each into a
/// `Vec` of its own; run by [`run_split`].
pub(crate) trait SplitKernel<const N: usize> {
    /// The op named in errors.
    const OP: &'static str;
    /// The outputs, in the order of the shapes given to [`run_split`], from the inputs' elements
    /// (each seen through its layout).
    fn run<T: Float>(&self, inputs: [(&[T], &Layout); N]) -> Result<Vec<Vec<T>>>;
}

/// Runs `kernel` on the storages of CPU tensors (untracked) and wraps each output `Vec` as a
/// tensor of its own, shaped by `shapes`, without a copy.
///
/// Why not one op with one flat output, narrowed per gradient: Candle's gradient store keeps a
/// gradient as it is only when it owns its whole buffer, and copies a narrow out (else a small
/// `∂W` would keep the whole `∂x` buffer alive), so a flat output costs a copy of every gradient,
/// activation-sized ones included, per layer and step.
///
/// bf16 inputs (all of them) are widened to f32, the kernel runs in f32 and each output is
/// rounded to bf16; see [`run_split_keeping_f32`] for outputs that stay f32.
pub(crate) fn run_split<const N: usize, K: SplitKernel<N>>(
    kernel: &K,
    inputs: [&Tensor; N],
    shapes: &[Shape],
) -> Result<Vec<Tensor>> {
    run_split_keeping_f32(kernel, inputs, shapes, &[])
}

/// [`run_split`], where with bf16 inputs the outputs `keep_f32[i]` stay f32 (the gradients of
/// f32 parameters used with bf16 activations: batch norm's `∂γ`, `∂β`); with f32 or f64 inputs
/// it is [`run_split`].
pub(crate) fn run_split_keeping_f32<const N: usize, K: SplitKernel<N>>(
    kernel: &K,
    inputs: [&Tensor; N],
    shapes: &[Shape],
    keep_f32: &[bool],
) -> Result<Vec<Tensor>> {
    fn go<T: Float, const N: usize, K: SplitKernel<N>, G: Deref<Target = Storage>>(
        kernel: &K,
        guards: &[(G, &Layout); N],
        shapes: &[Shape],
    ) -> Result<Vec<Tensor>> {
        let mut slices = Vec::with_capacity(N);
        for (storage, layout) in guards {
            match &**storage {
                Storage::Cpu(c) => slices.push((c.as_slice::<T>()?, *layout)),
                _ => return fail(NnError::DeviceMismatch { op: K::OP }),
            }
        }
        let Ok(inputs) = <[(&[T], &Layout); N]>::try_from(slices) else { unreachable!("one slice per input") };
        let outputs = kernel.run(inputs)?;
        assert_eq!(outputs.len(), shapes.len(), "allgrad-nn internal error: {} returned the wrong number of outputs", K::OP);
        outputs.into_iter().zip(shapes).map(|(v, s)| kernel_output(v, s.clone())).collect()
    }
    let Some(first) = inputs.first() else { return Ok(Vec::new()) };
    let dtype = first.dtype();
    let guards = inputs.map(Tensor::storage_and_layout);
    match dtype {
        DType::F32 => go::<f32, N, K, _>(kernel, &guards, shapes),
        DType::F64 => go::<f64, N, K, _>(kernel, &guards, shapes),
        DType::BF16 => {
            let mut wide = Vec::with_capacity(N);
            for (storage, _) in &guards {
                match &**storage {
                    Storage::Cpu(c) => wide.push(widen(c.as_slice::<bf16>()?)),
                    _ => return fail(NnError::DeviceMismatch { op: K::OP }),
                }
            }
            let slices: Vec<(&[f32], &Layout)> = wide.iter().zip(&guards).map(|(w, (_, l))| (w.as_slice(), *l)).collect();
            let Ok(inputs) = <[(&[f32], &Layout); N]>::try_from(slices) else { unreachable!("one slice per input") };
            let outputs = kernel.run(inputs)?;
            assert_eq!(outputs.len(), shapes.len(), "allgrad-nn internal error: {} returned the wrong number of outputs", K::OP);
            drop(wide);
            outputs
                .into_iter()
                .zip(shapes)
                .enumerate()
                .map(|(i, (v, s))| {
                    if keep_f32.get(i).copied().unwrap_or(false) {
                        kernel_output(v, s.clone())
                    } else {
                        kernel_output(narrow(v), s.clone())
                    }
                })
                .collect()
        }
        dtype => fail(NnError::UnsupportedDType { op: K::OP, dtype }),
    }
}

/// A CPU kernel's output as a tensor: the values the kernel wrote, in the memory it wrote them
/// in. Not an upload on the CPU's device path (`candle_core::host_traffic`), where the kernel
/// stands for the device's own, which writes its output in device memory.
pub fn kernel_output<T: WithDType>(v: Vec<T>, shape: Shape) -> Result<Tensor> {
    candle_core::host_traffic::uncounted(|| Tensor::from_vec(v, shape, &Device::Cpu))
}
