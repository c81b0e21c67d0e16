//! Batch norm's CPU passes over the activations, shared by the layer's host path
//! ([`super`]) and the device path's CPU twins ([`super::finalize`]): the forward
//! `tail(a·x + b)` ([`forward_kernel`]), the backward's per-channel sums ([`channel_sums`]) and
//! its `∂x` (and `∂skip`) pass ([`backward_pass`], [`dx_kernel`]). Each takes its per-channel
//! constants as slices; what they are and where they come from is the layer's business.
//!
//! Every pass is parallel over runs of whole rows (or over channels for the sums), with copies
//! per SIMD level chosen by the plan of the op ([`crate::simd`], `ALLGRAD_CPU_SIMD`), which
//! all give the same bits, and sums in f64 in a fixed order.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::cpu::{Float, GRAIN};
use crate::simd::{dispatch, SimdPlan};

/// One normalisation's per-channel scale and shift `(a, b)`.
pub(super) type Affine<'a> = (&'a [f64], &'a [f64]);

/// `out = tail(a[c]·x + b[c])` (`third`: the skip input, or the shortcut's input), parallel
/// over runs of whole rows; `ab` the scale and shift per channel, `ab2` the shortcut's. The
/// tail: a ReLU with `relu` (always with `third`); `round_bf16`: each normalisation's output
/// rounded to bf16 before a residual sum, as an unfused bf16 batch norm stores it. `plan`: the
/// copies' level.
pub(super) fn forward_kernel<T: Float>(
    plan: SimdPlan,
    x: &[T],
    third: Option<&[T]>,
    (relu, round_bf16): (bool, bool),
    (ab, ab2): (Affine<'_>, Option<Affine<'_>>),
    inner: usize,
) -> Vec<T> {
    if x.is_empty() {
        return Vec::new();
    }
    let rounded = |v: &[f64]| -> Vec<T> { v.iter().map(|&v| T::from_f64(v)).collect() };
    let (a, b) = (rounded(ab.0), rounded(ab.1));
    let branch = ab2.map(|(a2, b2)| (rounded(a2), rounded(b2)));
    let rows = (GRAIN / inner).max(1);
    let split = x.len() > rows * inner;
    crate::trace::count(|t| if split { t.batch_norm_split += 1 } else { t.batch_norm_whole += 1 });
    let mut out = Vec::with_capacity(x.len());
    out.spare_capacity_mut()[..x.len()].par_chunks_mut(rows * inner).enumerate().for_each(|(t, o)| {
        let task = &ForwardTask {
            x,
            skip: third,
            a: &a,
            b: &b,
            branch: branch.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice())),
            relu,
            round_bf16,
            inner,
            start: t * rows * inner,
        };
        dispatch!(
            plan,
            fn rows<T: Float>(task: &ForwardTask<'_, T>, o: &mut [MaybeUninit<T>]) -> () {
                forward_rows(task, o)
            }
        )
    });
    // SAFETY: the chunks cover the first `x.len()` elements and `forward_rows` writes every
    // element of its chunk; the pool writes them first, so no page is zeroed and then rewritten.
    unsafe { out.set_len(x.len()) };
    out
}

/// What one task of [`forward_kernel`] reads: its output rows start at element `start`.
struct ForwardTask<'a, T> {
    x: &'a [T],
    /// The skip input, or with `branch` the shortcut's input.
    skip: Option<&'a [T]>,
    a: &'a [T],
    b: &'a [T],
    /// The shortcut's `(a', b')`.
    branch: Option<(&'a [T], &'a [T])>,
    relu: bool,
    /// Round each normalisation's output to bf16 before the residual sum.
    round_bf16: bool,
    inner: usize,
    start: usize,
}

/// Writes every element of `out`.
#[inline(always)]
fn forward_rows<T: Float>(task: &ForwardTask<'_, T>, out: &mut [MaybeUninit<T>]) {
    let zero = T::from_f64(0.0);
    let (inner, c) = (task.inner, task.a.len());
    for (r, orow) in out.chunks_mut(inner).enumerate() {
        let at = task.start + r * inner;
        let ch = (at / inner) % c;
        let (s, t) = (task.a[ch], task.b[ch]);
        let xs = &task.x[at..at + inner];
        match (task.skip, task.relu) {
            (Some(sk), _) if task.round_bf16 => {
                let ss = &sk[at..at + inner];
                let round = |v: T| T::from_f64(half::bf16::from_f64(v.to_f64()).to_f64());
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    let z = match task.branch {
                        Some((a2, b2)) => round(v * s + t) + round(w * a2[ch] + b2[ch]),
                        None => round(v * s + t) + w,
                    };
                    o.write(if z > zero { z } else { zero });
                }
            }
            (Some(sk), _) if task.branch.is_some() => {
                let (a2, b2) = task.branch.expect("checked");
                let (s2, t2) = (a2[ch], b2[ch]);
                let ss = &sk[at..at + inner];
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    // As `bn(x) + bn'(x')` with each batch norm's output rounded to T.
                    let z = v * s + t + (w * s2 + t2);
                    o.write(if z > zero { z } else { zero });
                }
            }
            (Some(sk), _) => {
                let ss = &sk[at..at + inner];
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    let z = v * s + t + w;
                    o.write(if z > zero { z } else { zero });
                }
            }
            (None, true) => {
                for (o, &v) in orow.iter_mut().zip(xs) {
                    let z = v * s + t;
                    o.write(if z > zero { z } else { zero });
                }
            }
            (None, false) => orow.iter_mut().zip(xs).for_each(|(o, &v)| {
                o.write(v * s + t);
            }),
        }
    }
}

/// Independent f64 partial sums per channel (eight chains keep the adds pipelined).
const LANES: usize = 8;

/// Per channel, this rank's `(Σ g', Σ g'·(x − μ))` in f64, each channel summed by one task in a
/// fixed order, in `plan`'s copies.
pub(super) fn channel_sums<T: Float>(
    plan: SimdPlan,
    g: &[T],
    x: &[T],
    y: &[T],
    mean: &[f64],
    relu: bool,
    (n, c, inner): (usize, usize, usize),
) -> Vec<(f64, f64)> {
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let (mu, dims) = (mean[ch], (n, c, inner));
            dispatch!(
                plan,
                fn sum<T: Float>(
                    g: &[T],
                    x: &[T],
                    y: &[T],
                    mu: f64,
                    relu: bool,
                    dims: (usize, usize, usize),
                    ch: usize,
                ) -> (f64, f64) {
                    if relu {
                        channel_sum::<T, true>(g, x, y, mu, dims, ch)
                    } else {
                        channel_sum::<T, false>(g, x, y, mu, dims, ch)
                    }
                }
            )
        })
        .collect()
}

/// `(Σ g', Σ g'·(x − μ))` of channel `ch` of `(n, c, inner)` values, `g'` being `g` where `y > 0`
/// with `RELU`. Element `i` of a run goes to lane `i % LANES`: whole chunks of lanes, then the
/// rest, in fixed-width loops without branches, so that they vectorise.
#[inline(always)]
fn channel_sum<T: Float, const RELU: bool>(
    g: &[T],
    x: &[T],
    y: &[T],
    mu: f64,
    (n, c, inner): (usize, usize, usize),
    ch: usize,
) -> (f64, f64) {
    let zero = T::from_f64(0.0);
    let (mut s1, mut s2) = ([0f64; LANES], [0f64; LANES]);
    let full = inner / LANES * LANES;
    let mut add = |j: usize, gv: T, xv: T, yv: T| {
        let gv = gv.to_f64();
        let gp = if !RELU || yv > zero { gv } else { 0.0 };
        s1[j] += gp;
        s2[j] += gp * (xv.to_f64() - mu);
    };
    for img in 0..n {
        let off = (img * c + ch) * inner;
        let (gs, xs, ys) = (&g[off..off + inner], &x[off..off + inner], &y[off..off + inner]);
        let chunks = gs[..full].chunks_exact(LANES).zip(xs[..full].chunks_exact(LANES)).zip(ys[..full].chunks_exact(LANES));
        for ((gc, xc), yc) in chunks {
            for j in 0..LANES {
                add(j, gc[j], xc[j], yc[j]);
            }
        }
        for j in 0..inner - full {
            add(j, gs[full + j], xs[full + j], ys[full + j]);
        }
    }
    (s1.iter().sum(), s2.iter().sum())
}

/// `∂x = k·g' + c1·(x − μ) + c0` per channel (`[k, c1, c0, μ]` rounded to `T`), parallel over
/// runs of whole rows: the device path's `∂x` on the CPU (the host path computes the same with
/// [`backward_pass`], with `∂skip` in the same pass).
pub(super) fn dx_kernel<T: Float>(
    plan: SimdPlan,
    g: &[T],
    x: &[T],
    y: &[T],
    [k, c1, c0, mu]: [&[T]; 4],
    relu: bool,
    inner: usize,
) -> Vec<T> {
    backward_pass(plan, &RowCoefficients { g, x, y, k, c1, c0, mu, relu, inner }, false).0
}

/// `∂x`, and with `want_skip` `∂skip` (the gradient through the ReLU), of every row, parallel
/// over runs of whole rows, in `plan`'s copies. Both are written once, by the pool, without zeroing them first (a
/// zeroing pass would add a third of this pass's memory traffic).
pub(super) fn backward_pass<T: Float>(
    plan: SimdPlan,
    coef: &RowCoefficients<'_, T>,
    want_skip: bool,
) -> (Vec<T>, Option<Vec<T>>) {
    let len = coef.x.len();
    if len == 0 {
        return (Vec::new(), want_skip.then(Vec::new));
    }
    let chunk = (GRAIN / coef.inner).max(1) * coef.inner;
    let split = len > chunk;
    crate::trace::count(|t| if split { t.batch_norm_split += 1 } else { t.batch_norm_whole += 1 });
    let run = |start: usize, dxc: &mut [MaybeUninit<T>], dsc: Option<&mut [MaybeUninit<T>]>| {
        dispatch!(
            plan,
            fn rows<T: Float>(
                coef: &RowCoefficients<'_, T>,
                start: usize,
                dxc: &mut [MaybeUninit<T>],
                dsc: Option<&mut [MaybeUninit<T>]>,
            ) -> () {
                backward_rows(coef, start, dxc, dsc)
            }
        )
    };
    let (mut dx, mut dskip) = (Vec::with_capacity(len), Vec::with_capacity(if want_skip { len } else { 0 }));
    let dxs = &mut dx.spare_capacity_mut()[..len];
    if want_skip {
        let dss = &mut dskip.spare_capacity_mut()[..len];
        dxs.par_chunks_mut(chunk)
            .zip(dss.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(t, (dxc, dsc))| run(t * chunk, dxc, Some(dsc)));
        // SAFETY: the chunks cover the first `len` elements and `backward_rows` writes every
        // element of its `∂skip` chunk.
        unsafe { dskip.set_len(len) };
    } else {
        dxs.par_chunks_mut(chunk).enumerate().for_each(|(t, dxc)| run(t * chunk, dxc, None));
    }
    // SAFETY: as above, for every element of each `∂x` chunk.
    unsafe { dx.set_len(len) };
    (dx, want_skip.then_some(dskip))
}

/// What [`backward_rows`] reads: the inputs and the per-channel coefficients of
/// `∂x = k·g' + c1·(x − μ_T) + c0`.
pub(super) struct RowCoefficients<'a, T> {
    pub g: &'a [T],
    pub x: &'a [T],
    pub y: &'a [T],
    pub k: &'a [T],
    pub c1: &'a [T],
    pub c0: &'a [T],
    pub mu: &'a [T],
    pub relu: bool,
    pub inner: usize,
}

/// `∂x` (and `∂skip`, the gradient through the ReLU) of the rows starting at element `start`:
/// writes every element of `dx` and of `dskip`.
#[inline(always)]
fn backward_rows<T: Float>(
    coef: &RowCoefficients<'_, T>,
    start: usize,
    dx: &mut [MaybeUninit<T>],
    mut dskip: Option<&mut [MaybeUninit<T>]>,
) {
    let zero = T::from_f64(0.0);
    let (inner, c) = (coef.inner, coef.k.len());
    for (r, dxr) in dx.chunks_mut(inner).enumerate() {
        let at = start + r * inner;
        let ch = (at / inner) % c;
        let (kc, c1c, c0c, mu) = (coef.k[ch], coef.c1[ch], coef.c0[ch], coef.mu[ch]);
        let (gs, xs, ys) = (&coef.g[at..at + inner], &coef.x[at..at + inner], &coef.y[at..at + inner]);
        for (d, ((&gv, &xv), &yv)) in dxr.iter_mut().zip(gs.iter().zip(xs).zip(ys)) {
            let gp = if !coef.relu || yv > zero { gv } else { zero };
            d.write(kc * gp + c1c * (xv - mu) + c0c);
        }
        if let Some(ds) = dskip.as_deref_mut() {
            for (d, (&gv, &yv)) in ds[r * inner..(r + 1) * inner].iter_mut().zip(gs.iter().zip(ys)) {
                d.write(if yv > zero { gv } else { zero });
            }
        }
    }
}
