//! The fused CPU kernel of the scaled dot product `s_ij = q_i·k_j / τ` (f32 and f64): the
//! logits of one `tile x tile` block at a time, per worker thread.
//!
//! **Forward**, parallel over blocks of query rows: for each block of key columns, one GEMM
//! writes the block's logits, the special columns are applied, and each row's running maximum
//! and scaled sum are updated (online log-sum-exp: `sum ← sum·e^(max_old − max_new) +
//! Σ e^(s − max_new)`). Keeps `lse` per row for the backward.
//!
//! **Backward**, with the logits of each block recomputed: `dS = g·(softmax − onehot)`,
//! then `dQ_i += dS·K_j / τ` and `dK_j += dSᵀ·Q_i / τ` (two GEMMs) and `Σ dS·s` for the
//! temperature. Blocks run in waves: in wave `w`, row block `i` pairs with column block
//! `(i + w) mod nk`, so no two tasks of a wave write the same rows of `dQ` or `dK`, every
//! block of `dQ` and `dK` sums its contributions in a fixed order (results do not depend on
//! the number of threads), and no per-thread copies of `dK` are needed.
//!
//! The row loops around the GEMMs (the online log-sum-exp, the softmax's gradient) run in the
//! copy of allgrad-nn's SIMD dispatch that `ALLGRAD_CPU_SIMD` picks (`allgrad_nn::simd_dispatch`,
//! counted in `allgrad_nn::simd_paths`), every copy with the same bits; f64's `exp` is the C
//! library's (one copy, inside them).
//!
//! Memory: one `tile x tile` buffer per running task (at most one per thread), from a pool
//! that lives for one call, plus `dQ` and `dK` themselves.

use std::ops::Range;
use std::sync::Mutex;

use allgrad_nn::{simd_dispatch, SimdPlan};
use candle_core::WithDType;
use rayon::prelude::*;

use super::pairs::{blocks, Pairs};

/// The element types of the kernel.
pub(crate) trait Elem: WithDType + 'static {
    /// `v ← e^v` over a slice (f32: vectorised, in `plan`'s copy; f64: the C library).
    fn exp_slice(plan: SimdPlan, xs: &mut [Self]);
}

impl Elem for f32 {
    fn exp_slice(plan: SimdPlan, xs: &mut [f32]) {
        allgrad_nn::exp_in_place_at(plan, xs)
    }
}

impl Elem for f64 {
    fn exp_slice(_: SimdPlan, xs: &mut [f64]) {
        xs.iter_mut().for_each(|v| *v = v.exp());
    }
}

/// One call: row-major queries `[m, d]` and keys `[n, d]`, `1/τ`, the special columns.
pub(super) struct Problem<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub m: usize,
    pub n: usize,
    /// The leading keys that get a gradient (the rest are a queue's, without one).
    pub n_grad: usize,
    pub d: usize,
    pub inv_t: T,
    pub pairs: &'a Pairs,
    pub tile: usize,
}

/// What the backward computes: the gradients asked for, and `Σ dS ⊙ (s − boost)` over all
/// pairs, from which the caller forms the temperature's gradient.
pub(super) struct Grads<T> {
    pub dq: Option<Vec<T>>,
    pub dk: Option<Vec<T>>,
    pub ds_dot_s: f64,
}

/// Buffers of one call, reused by its tasks (at most one per running task).
struct Pool<T>(Mutex<Vec<Vec<T>>>);

impl<T: Elem> Pool<T> {
    fn new() -> Self {
        Pool(Mutex::new(Vec::new()))
    }

    fn with<R>(&self, len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
        let taken = self.0.lock().map(|mut p| p.pop()).unwrap_or(None);
        let mut buf = taken.unwrap_or_default();
        // Every element the kernel reads it writes first; the fill only sizes the buffer.
        buf.resize(len, T::from_f64(0.0));
        let out = f(&mut buf[..len]);
        if let Ok(mut p) = self.0.lock() {
            p.push(buf);
        }
        out
    }
}

/// `(lse per row, Σ_i (lse_i − s_{i, target_i}))`.
///
/// # Errors
/// A bad `ALLGRAD_CPU_SIMD` (see `allgrad_nn::simd_level`).
pub(super) fn forward<T: Elem>(p: &Problem<T>) -> candle_core::Result<(Vec<T>, f64)> {
    let plan = allgrad_nn::simd_plan()?;
    let pool = Pool::new();
    let parts: Vec<(Vec<T>, f64)> = blocks(p.m, p.tile).into_par_iter().map(|rows| forward_rows(plan, p, rows, &pool)).collect();
    let mut lse = Vec::with_capacity(p.m);
    let mut total = 0f64;
    for (l, s) in parts {
        lse.extend(l);
        total += s;
    }
    Ok((lse, total))
}

fn forward_rows<T: Elem>(plan: SimdPlan, p: &Problem<T>, rows: Range<usize>, pool: &Pool<T>) -> (Vec<T>, f64) {
    let tq = rows.len();
    let neg_inf = T::from_f64(f64::NEG_INFINITY);
    let mut run = Running { max: vec![neg_inf; tq], sum: vec![T::from_f64(0.0); tq], pos: vec![T::from_f64(0.0); tq] };
    for cols in blocks(p.n, p.tile) {
        pool.with(tq * cols.len(), |s| {
            logits(p, &rows, &cols, s);
            forward_block(plan, p, &rows, &cols, s, &mut run)
        });
    }
    let mut total = 0f64;
    let lse: Vec<T> = (0..tq)
        .map(|r| {
            let l = T::from_f64(run.max[r].to_f64() + run.sum[r].to_f64().ln());
            let has_target = p.pairs.target.is_some();
            total += l.to_f64() - if has_target { run.pos[r].to_f64() } else { 0.0 };
            l
        })
        .collect();
    (lse, total)
}

/// A block of rows' running maximum, scaled sum of exponentials and target logit.
struct Running<T> {
    max: Vec<T>,
    sum: Vec<T>,
    pos: Vec<T>,
}

/// Folds one block of logits `s` (`rows x cols`, special columns applied) into the rows'
/// running maximum and sum (the online log-sum-exp), and records the target logits.
fn forward_block<T: Elem>(
    plan: SimdPlan,
    p: &Problem<T>,
    rows: &Range<usize>,
    cols: &Range<usize>,
    s: &mut [T],
    run: &mut Running<T>,
) {
    simd_dispatch!(
        plan,
        fn block<T: Elem>(
            plan: SimdPlan,
            p: &Problem<T>,
            rows: &Range<usize>,
            cols: &Range<usize>,
            s: &mut [T],
            run: &mut Running<T>,
        ) -> () {
            forward_block_body(plan, p, rows, cols, s, run)
        }
    )
}

#[inline(always)]
fn forward_block_body<T: Elem>(
    plan: SimdPlan,
    p: &Problem<T>,
    rows: &Range<usize>,
    cols: &Range<usize>,
    s: &mut [T],
    run: &mut Running<T>,
) {
    let (tq, tk) = (rows.len(), cols.len());
    let neg_inf = T::from_f64(f64::NEG_INFINITY);
    for r in 0..tq {
        let row = &mut s[r * tk..(r + 1) * tk];
        if let Some(t) = p.pairs.target_in(rows.start + r, cols) {
            run.pos[r] = row[t];
        }
        let top = lanes::max(row);
        if top == neg_inf {
            // Every column of this block is excluded, or a logit is NaN: it must reach the loss.
            #[allow(clippy::eq_op)]
            if row.iter().any(|v| v != v) {
                run.sum[r] = T::from_f64(f64::NAN);
            }
            continue;
        }
        let old = run.max[r];
        let new = if top > old { top } else { old };
        if new != old {
            run.sum[r] *= T::from_f64((old - new).to_f64().exp());
            run.max[r] = new;
        }
        lanes::add(row, T::from_f64(0.0) - new);
        T::exp_slice(plan, row);
        run.sum[r] += lanes::sum(row);
    }
}

/// Row loops written with `LANES` independent accumulators, so that the compiler vectorises
/// them; the lanes are combined in a fixed order, so results do not depend on the CPU.
mod lanes {
    use super::Elem;

    const LANES: usize = 16;

    /// The largest element (`-inf` for none; NaN is skipped, the callers catch it).
    #[inline(always)]
    pub(super) fn max<T: Elem>(xs: &[T]) -> T {
        let neg_inf = T::from_f64(f64::NEG_INFINITY);
        let mut acc = [neg_inf; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
            }
        }
        for &v in chunks.remainder() {
            acc[0] = if v > acc[0] { v } else { acc[0] };
        }
        acc.iter().fold(neg_inf, |a, &v| if v > a { v } else { a })
    }

    /// The sum of the elements.
    #[inline(always)]
    pub(super) fn sum<T: Elem>(xs: &[T]) -> T {
        let zero = T::from_f64(0.0);
        let mut acc = [zero; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                acc[l] += c[l];
            }
        }
        for &v in chunks.remainder() {
            acc[0] += v;
        }
        acc.iter().fold(zero, |a, &v| a + v)
    }

    /// `Σ a_i b_i`.
    #[inline(always)]
    pub(super) fn dot<T: Elem>(a: &[T], b: &[T]) -> T {
        let zero = T::from_f64(0.0);
        let mut acc = [zero; LANES];
        let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (x, y) in (&mut ca).zip(&mut cb) {
            for l in 0..LANES {
                acc[l] += x[l] * y[l];
            }
        }
        for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
            acc[0] += x * y;
        }
        acc.iter().fold(zero, |a, &v| a + v)
    }

    /// `x ← x + c` for every element.
    #[inline(always)]
    pub(super) fn add<T: Elem>(xs: &mut [T], c: T) {
        xs.iter_mut().for_each(|v| *v += c);
    }

    /// `x ← x · c` for every element.
    #[inline(always)]
    pub(super) fn scale<T: Elem>(xs: &mut [T], c: T) {
        xs.iter_mut().for_each(|v| *v *= c);
    }
}

/// The block's logits `q_i·k_j / τ` (row-major, `rows x cols`) with the special columns
/// applied: excluded ones `-inf`, boosted ones `+ boost`.
fn logits<T: Elem>(p: &Problem<T>, rows: &Range<usize>, cols: &Range<usize>, out: &mut [T]) {
    let (tq, tk, d) = (rows.len(), cols.len(), p.d);
    let q = Mat { data: &p.q[rows.start * d..rows.end * d], rs: d, cs: 1 };
    let kt = Mat { data: &p.k[cols.start * d..cols.end * d], rs: 1, cs: d };
    matmul(out, tk, false, q, kt, (tq, tk, d), p.inv_t);
    for r in 0..tq {
        let row = rows.start + r;
        if let Some(c) = p.pairs.exclude_in(row, cols) {
            out[r * tk + c] = T::from_f64(f64::NEG_INFINITY);
        }
        if let Some((c, w)) = p.pairs.boost_in(row, cols) {
            out[r * tk + c] += T::from_f64(w);
        }
    }
}

/// The gradients of `g · Σ_i (lse_i − s_{i, target_i})`; `need` = [dQ, dK, temperature].
///
/// # Errors
/// A bad `ALLGRAD_CPU_SIMD` (see `allgrad_nn::simd_level`).
pub(super) fn backward<T: Elem>(p: &Problem<T>, lse: &[T], g: T, need: [bool; 3]) -> candle_core::Result<Grads<T>> {
    let mut dq = vec![T::from_f64(0.0); if need[0] { p.m * p.d } else { 0 }];
    let mut dk = vec![T::from_f64(0.0); if need[1] { p.n_grad * p.d } else { 0 }];
    let ds_dot_s = backward_into(p, lse, g, need, &mut dq, &mut dk)?;
    Ok(Grads { dq: need[0].then_some(dq), dk: need[1].then_some(dk), ds_dot_s })
}

/// [`backward`], adding the gradients to `dq` (`[m, d]`, empty unless `need[0]`) and `dk`
/// (`[n_grad, d]`, empty unless `need[1]`) as they are; returns `Σ dS ⊙ s`.
pub(super) fn backward_into<T: Elem>(
    p: &Problem<T>,
    lse: &[T],
    g: T,
    need: [bool; 3],
    dq: &mut [T],
    dk: &mut [T],
) -> candle_core::Result<f64> {
    let plan = allgrad_nn::simd_plan()?;
    let (rb, cb) = (blocks(p.m, p.tile), blocks(p.n, p.tile));
    // Each column block's rows of dK: its columns below `n_grad` (none for a queue's).
    let cb_grad: Vec<Range<usize>> = cb.iter().map(|c| c.start.min(p.n_grad)..c.end.min(p.n_grad)).collect();
    let pool = Pool::new();
    let mut ds_dot_s = 0f64;
    if rb.is_empty() || cb.is_empty() {
        return Ok(ds_dot_s);
    }
    // Waves over the longer side: each task of a wave owns one block of dQ and one of dK.
    let rows_lead = rb.len() <= cb.len();
    let waves = if rows_lead { cb.len() } else { rb.len() };
    for w in 0..waves {
        let dq_blocks = split_blocks(&mut *dq, &rb, p.d);
        let dk_blocks = split_blocks(&mut *dk, &cb_grad, p.d);
        let tasks: Vec<(usize, &mut [T], usize, &mut [T])> = if rows_lead {
            let mut dk_blocks: Vec<Option<&mut [T]>> = dk_blocks.into_iter().map(Some).collect();
            dq_blocks
                .into_iter()
                .enumerate()
                .map(|(i, dqi)| {
                    let j = (i + w) % cb.len();
                    (i, dqi, j, dk_blocks[j].take().expect("distinct column blocks within a wave"))
                })
                .collect()
        } else {
            let mut dq_blocks: Vec<Option<&mut [T]>> = dq_blocks.into_iter().map(Some).collect();
            dk_blocks
                .into_iter()
                .enumerate()
                .map(|(j, dkj)| {
                    let i = (j + w) % rb.len();
                    (i, dq_blocks[i].take().expect("distinct row blocks within a wave"), j, dkj)
                })
                .collect()
        };
        let sums: Vec<f64> = tasks
            .into_par_iter()
            .map(|(i, dqi, j, dkj)| tile_backward(plan, p, (&rb[i], &cb[j]), lse, g, dqi, dkj, need, &pool))
            .collect();
        ds_dot_s += sums.iter().sum::<f64>();
    }
    Ok(ds_dot_s)
}

/// `buf` (rows of `d` elements) cut into the given consecutive blocks of rows; all empty when
/// `buf` is.
fn split_blocks<'a, T>(buf: &'a mut [T], blocks: &[Range<usize>], d: usize) -> Vec<&'a mut [T]> {
    if buf.is_empty() {
        return blocks.iter().map(|_| <&mut [T]>::default()).collect();
    }
    let mut rest = buf;
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(b.len() * d);
        out.push(head);
        rest = tail;
    }
    out
}

/// One block pair of the backward; returns its `Σ dS ⊙ (s − boost)`.
#[allow(clippy::too_many_arguments)]
fn tile_backward<T: Elem>(
    plan: SimdPlan,
    p: &Problem<T>,
    (rows, cols): (&Range<usize>, &Range<usize>),
    lse: &[T],
    g: T,
    dqi: &mut [T],
    dkj: &mut [T],
    need: [bool; 3],
    pool: &Pool<T>,
) -> f64 {
    let (tq, tk, d) = (rows.len(), cols.len(), p.d);
    pool.with(tq * tk + tk, |buf| {
        let (s, scaled) = buf.split_at_mut(tq * tk);
        logits(p, rows, cols, s);
        let acc = backward_block(plan, p, (rows, cols), s, scaled, lse, g, need[2]);
        let ds = Mat { data: &*s, rs: tk, cs: 1 };
        if need[0] {
            let kj = Mat { data: &p.k[cols.start * d..cols.end * d], rs: d, cs: 1 };
            matmul(dqi, d, true, ds, kj, (tq, d, tk), p.inv_t);
        }
        // dK of this block's own keys: its first `dkj.len() / d` columns.
        if need[1] && !dkj.is_empty() {
            let dst = Mat { data: &*s, rs: 1, cs: tk };
            let qi = Mat { data: &p.q[rows.start * d..rows.end * d], rs: d, cs: 1 };
            matmul(dkj, d, true, dst, qi, (dkj.len() / d, d, tq), p.inv_t);
        }
        acc
    })
}

/// Turns one block of logits `s` (special columns applied) into `dS = g·(softmax − onehot)`
/// in place, with `lse` the rows' log-sum-exp; with `dot_s`, returns `Σ dS ⊙ (s − boost)`
/// (`scaled` is a row of scratch).
#[allow(clippy::too_many_arguments)]
fn backward_block<T: Elem>(
    plan: SimdPlan,
    p: &Problem<T>,
    block: (&Range<usize>, &Range<usize>),
    s: &mut [T],
    scaled: &mut [T],
    lse: &[T],
    g: T,
    dot_s: bool,
) -> f64 {
    simd_dispatch!(
        plan,
        fn block<T: Elem>(
            plan: SimdPlan,
            p: &Problem<T>,
            block: (&Range<usize>, &Range<usize>),
            s: &mut [T],
            scaled: &mut [T],
            lse: &[T],
            g: T,
            dot_s: bool,
        ) -> f64 {
            backward_block_body(plan, p, block, s, scaled, lse, g, dot_s)
        }
    )
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_block_body<T: Elem>(
    plan: SimdPlan,
    p: &Problem<T>,
    (rows, cols): (&Range<usize>, &Range<usize>),
    s: &mut [T],
    scaled: &mut [T],
    lse: &[T],
    g: T,
    dot_s: bool,
) -> f64 {
    let (tq, tk) = (rows.len(), cols.len());
    let mut acc = 0f64;
    for r in 0..tq {
        let row_id = rows.start + r;
        let row = &mut s[r * tk..(r + 1) * tk];
        // `scaled` keeps s (for the temperature's gradient); `row` becomes the softmax, then dS.
        if dot_s {
            scaled.copy_from_slice(row);
        }
        lanes::add(row, T::from_f64(0.0) - lse[row_id]);
        T::exp_slice(plan, row); // excluded columns: e^-inf = 0
        lanes::scale(row, g);
        if let Some(t) = p.pairs.target_in(row_id, cols) {
            row[t] -= g;
        }
        if dot_s {
            if let Some(c) = p.pairs.exclude_in(row_id, cols) {
                scaled[c] = T::from_f64(0.0); // its dS is 0; -inf would make 0·-inf
            }
            if let Some((c, w)) = p.pairs.boost_in(row_id, cols) {
                scaled[c] -= T::from_f64(w);
            }
            acc += lanes::dot(row, scaled).to_f64();
        }
    }
    acc
}

/// A read-only matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<T> Mat<'_, T> {
    /// Panics (an internal bug, never user input) unless a `rows x cols` view lies in `data`.
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            assert!((rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len(), "tiled loss: matrix view out of bounds");
        }
    }
}

/// `dst (m x n) = scale · a · b`, or `+=` with `accumulate`, on row-major host slices: `a` is
/// `m x k` (`a_t`: stored `k x m`, read transposed), `b` is `k x n` (`b_t`: stored `n x k`).
/// Single-threaded. For the ring losses' host loops.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Elem>(
    dst: &mut [T],
    accumulate: bool,
    a: &[T],
    a_t: bool,
    b: &[T],
    b_t: bool,
    (m, n, k): (usize, usize, usize),
    scale: f64,
) {
    let lhs = if a_t { Mat { data: a, rs: 1, cs: m } } else { Mat { data: a, rs: k, cs: 1 } };
    let rhs = if b_t { Mat { data: b, rs: 1, cs: k } } else { Mat { data: b, rs: n, cs: 1 } };
    matmul(dst, n, accumulate, lhs, rhs, (m, n, k), T::from_f64(scale));
}

/// `dst (m x n, row stride dst_rs) = scale · lhs (m x k) · rhs (k x n)`, or `+=` with
/// `accumulate`. Single-threaded: the kernel's tasks are the parallelism.
fn matmul<T: Elem>(
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<T>,
    rhs: Mat<T>,
    (m, n, k): (usize, usize, usize),
    scale: T,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.iter_mut().for_each(|v| *v = T::from_f64(0.0));
        }
        return;
    }
    Mat { data: &*dst, rs: dst_rs, cs: 1 }.check(m, n);
    lhs.check(m, k);
    rhs.check(k, n);
    // SAFETY: the three views were bounds-checked above; `dst` is borrowed mutably, so it
    // cannot alias `lhs` or `rhs`; `T` is f32 or f64, both supported by `gemm`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
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
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
