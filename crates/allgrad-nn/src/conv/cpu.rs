//! The CPU kernels behind [`crate::conv2d`]: the forward and the backward as im2col + GEMM.
//!
//! A GEMM per image is efficient while an image has many output pixels `p`, but late stages of
//! a ResNet have `p` = 64 or 16: the forward's GEMM is then a thin `og x p` product, and the
//! weight gradient `∂W += ∂y · colᵀ` re-reads and re-writes the whole `og x kdim` weight for an
//! inner dimension of only `p` (memory-bound: for the last stage of ResNet-18 that is 9 MiB of
//! traffic per 16 pixels of one image). So images are taken in blocks of `nb` (at least
//! [`TARGET_COLS`] output columns per GEMM): their column matrices sit side by side in one
//! buffer (`kdim x nb·p`), and each GEMM covers the whole block. With `p >= TARGET_COLS` the
//! block is one image, exactly the per-image scheme.
//!
//! The weight gradient of the image-chunked scheme is a partial sum per chunk of images, each
//! as large as the weight, summed at the end. For the last stages' weights (up to 9 MiB) that
//! is a whole weight written, re-read and summed per chunk; there the weight gradient is
//! instead split over slabs of input channels, one task each, every slab accumulated over
//! blocks of images in one buffer of its own ([`conv_dw_slabs`]).
//!
//! Every reduction has a fixed order: the blocks depend only on the geometry and on rayon's
//! pool size, never on scheduling, so results are deterministic on a given machine.

use candle_core::Layout;
use rayon::prelude::*;

use super::im2col::{col2im, im2col, ConvGeom};
use super::winograd;
use crate::cpu::{matmul, zeros, BatchPlan, Float, MatRef, Scratch, Strides4};
use crate::simd::SimdPlan;

/// Output columns a GEMM should cover at least (see the module docs).
const TARGET_COLS: usize = 512;

/// Images per block for `p` output pixels, with at most `max_images` in a block.
fn block_images(p: usize, max_images: usize) -> usize {
    (TARGET_COLS / p.max(1)).clamp(1, max_images.max(1))
}

/// Copies the `rows x p` matrices of `imgs` images (image j at `src[j * img_stride..]`, row
/// stride `p`) side by side into `dst` (`rows x imgs·p`, row stride `ld`); `back` copies the
/// other way.
fn gather_block<T: Float>(src: &[T], img_stride: usize, rows: usize, p: usize, imgs: usize, dst: &mut [T], ld: usize) {
    for j in 0..imgs {
        for r in 0..rows {
            dst[r * ld + j * p..][..p].copy_from_slice(&src[j * img_stride + r * p..][..p]);
        }
    }
}

fn scatter_block<T: Float>(src: &[T], ld: usize, rows: usize, p: usize, imgs: usize, dst: &mut [T], img_stride: usize) {
    for j in 0..imgs {
        for r in 0..rows {
            dst[j * img_stride + r * p..][..p].copy_from_slice(&src[r * ld + j * p..][..p]);
        }
    }
}

/// Elements of a column matrix that should stay in a core's L2 cache while it is written by
/// im2col and read back by the GEMM's packing (1 MiB of f32).
const COL_BUDGET: usize = 1 << 18;

/// Output rows per band of an image whose column matrix alone would exceed `budget` elements
/// (all of them otherwise): an early ResNet layer's `kdim x p` matrix is 2.3 MB, more than L2,
/// so im2col + GEMM (and GEMM + col2im) go band by band.
fn band_rows(g: &ConvGeom, budget: usize) -> usize {
    (budget / (g.kdim() * g.ow).max(1)).clamp(1, g.oh.max(1))
}

/// Forward: 3x3 convolutions with stride 1 and padding 1 by Winograd's F(2x2, 3x3) where
/// [`winograd::applies`], every other one by [`conv_fwd_im2col`].
pub(crate) fn conv_fwd<T: Float>(simd: SimdPlan, x: &[T], xl: &Layout, w: &[T], g: &ConvGeom) -> Vec<T> {
    if winograd::applies(g) {
        return winograd::forward(x, &Strides4::of(xl), w, g);
    }
    conv_fwd_im2col(simd, x, xl, w, g)
}

/// Forward by im2col + GEMM: per block of images and group, `Y_g = W_g · [im2col(x[n, g]) ...]`;
/// a single image with a large column matrix in bands of output rows.
pub(crate) fn conv_fwd_im2col<T: Float>(simd: SimdPlan, x: &[T], xl: &Layout, w: &[T], g: &ConvGeom) -> Vec<T> {
    conv_fwd_with(simd, x, xl, w, g, COL_BUDGET)
}

fn conv_fwd_with<T: Float>(simd: SimdPlan, x: &[T], xl: &Layout, w: &[T], g: &ConvGeom, budget: usize) -> Vec<T> {
    let st = Strides4::of(xl);
    let (p, kdim, og, cg, out_img) = (g.p(), g.kdim(), g.og(), g.cg(), g.out_img());
    // Keep at least one block per thread when the batch allows it.
    let threads = rayon::current_num_threads().max(1);
    let nb = block_images(p, g.n / threads);
    let plan = BatchPlan::new(g.n.div_ceil(nb), 1);
    let pointwise = nb == 1 && g.is_pointwise(&st);
    crate::trace::count(|t| if pointwise { t.conv_pointwise += 1 } else { t.conv_im2col += 1 });
    let band = if nb == 1 { band_rows(g, budget) } else { g.oh };
    let ld = nb * p;
    let mut out = zeros(g.n * out_img);
    if out.is_empty() {
        return out;
    }
    let col_len = if pointwise { 0 } else { kdim * (ld / p.max(1)).max(1) * band * g.ow };
    let yb_len = if nb > 1 { og * ld } else { 0 };
    out.par_chunks_mut(nb * out_img).enumerate().for_each_init(
        || (Scratch::take(col_len), Scratch::take(yb_len)),
        |(col, yb), (blk, y)| {
            let first = blk * nb;
            let imgs = y.len() / out_img;
            for grp in 0..g.groups {
                let lhs = MatRef::new(&w[grp * og * kdim..], kdim, 1);
                let yg = &mut y[grp * og * p..];
                if pointwise {
                    let rhs = MatRef::new(&x[st.offset + first * st.n + grp * cg * st.c..], st.c, 1);
                    matmul(yg, p, false, lhs, rhs, (og, p, kdim), plan.gemm);
                    continue;
                }
                if nb == 1 {
                    let base = st.offset + first * st.n;
                    let mut r0 = 0;
                    while r0 < g.oh {
                        let r1 = (r0 + band).min(g.oh);
                        let cols = (r1 - r0) * g.ow;
                        im2col(simd, x, base, &st, g, grp * cg, (r0, r1), col, cols);
                        let rhs = MatRef::new(&col[..], cols, 1);
                        matmul(&mut yg[r0 * g.ow..], p, false, lhs, rhs, (og, cols, kdim), plan.gemm);
                        r0 = r1;
                    }
                    continue;
                }
                for j in 0..imgs {
                    im2col(simd, x, st.offset + (first + j) * st.n, &st, g, grp * cg, (0, g.oh), &mut col[j * p..], ld);
                }
                let rhs = MatRef::new(&col[..], ld, 1);
                matmul(yb, ld, false, lhs, rhs, (og, imgs * p, kdim), plan.gemm);
                scatter_block(yb, ld, og, p, imgs, yg, out_img);
            }
        },
    );
    out
}

/// Backward: the input gradient of a convolution that [`winograd::applies`] to by Winograd's
/// F(2x2, 3x3), everything else by [`conv_bwd_im2col`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_bwd<T: Float>(
    simd: SimdPlan,
    x: &[T],
    xl: &Layout,
    w: &[T],
    gy: &[T],
    g: &ConvGeom,
    want_input: bool,
    want_weight: bool,
) -> (Vec<T>, Vec<T>) {
    if want_input && winograd::applies(g) {
        let dx = winograd::input_grad(w, gy, g);
        let (_, dw) = conv_bwd_im2col(simd, x, xl, w, gy, g, false, want_weight);
        return (dx, dw);
    }
    conv_bwd_im2col(simd, x, xl, w, gy, g, want_input, want_weight)
}

/// Backward by im2col + GEMM: per block of images and group, `∂W_gᵀ += col · ∂Y_gᵀ` and
/// `∂x[n, g] = col2im(W_gᵀ · ∂Y_g)` (a single image with a large column matrix in bands of output
/// rows). Images are cut into a fixed number of chunks; each chunk accumulates its own weight
/// gradient and the chunks are summed in order, so the result does not depend on scheduling.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_bwd_im2col<T: Float>(
    simd: SimdPlan,
    x: &[T],
    xl: &Layout,
    w: &[T],
    gy: &[T],
    g: &ConvGeom,
    want_input: bool,
    want_weight: bool,
) -> (Vec<T>, Vec<T>) {
    conv_bwd_with(simd, x, xl, w, gy, g, (want_input, want_weight), COL_BUDGET)
}

#[allow(clippy::too_many_arguments)]
fn conv_bwd_with<T: Float>(
    simd: SimdPlan,
    x: &[T],
    xl: &Layout,
    w: &[T],
    gy: &[T],
    g: &ConvGeom,
    (want_input, want_weight): (bool, bool),
    budget: usize,
) -> (Vec<T>, Vec<T>) {
    let zero = T::from_f64(0.0);
    let st = Strides4::of(xl);
    if want_weight && weight_by_slabs(g) {
        let dw = conv_dw_slabs(simd, x, &st, gy, g, SLAB_COL_BUDGET);
        let (dx, _) =
            if want_input { conv_bwd_with(simd, x, xl, w, gy, g, (true, false), budget) } else { (Vec::new(), Vec::new()) };
        return (dx, dw);
    }
    let (p, kdim, og, cg, out_img) = (g.p(), g.kdim(), g.og(), g.cg(), g.out_img());
    let plan = BatchPlan::new(g.n, 2);
    let nb = block_images(p, plan.per_chunk);
    let pointwise = nb == 1 && g.is_pointwise(&st);
    crate::trace::count(|t| if pointwise { t.conv_pointwise += 1 } else { t.conv_im2col += 1 });
    let band = if nb == 1 { band_rows(g, budget) } else { g.oh };
    let ld = nb * p;
    let col_len = if nb == 1 { kdim * band * g.ow } else { kdim * ld };
    let in_img = g.in_img();
    // Zeroed by writes from the pool (`zeros`), so col2im's first touch of a page is never a read
    // (a read maps the shared zero page, and the write after it costs a copy-on-write fault).
    let mut dx = zeros(if want_input { g.n * in_img } else { 0 });
    // One task per chunk of images; each task owns its slice of ∂x.
    let mut dx_chunks: Vec<&mut [T]> = if want_input && !dx.is_empty() {
        dx.chunks_mut(plan.per_chunk * in_img).collect()
    } else {
        (0..plan.chunks).map(|_| &mut [][..]).collect()
    };
    let dw_parts: Vec<Vec<T>> = dx_chunks
        .par_iter_mut()
        .enumerate()
        .map(|(chunk, dxc)| {
            let mut dw = vec![zero; if want_weight { g.weight_len() } else { 0 }];
            let mut col = Scratch::take(if want_weight && !pointwise { col_len } else { 0 });
            let mut dcol = Scratch::take(if want_input && !pointwise { col_len } else { 0 });
            let mut gyb = Scratch::take(if nb > 1 { og * ld } else { 0 });
            let first = chunk * plan.per_chunk;
            let last = (first + plan.per_chunk).min(g.n);
            let mut n = first;
            while n < last {
                let imgs = nb.min(last - n);
                let cols = imgs * p;
                for grp in 0..g.groups {
                    let wt = MatRef::new(&w[grp * og * kdim..], 1, kdim);
                    let dwg_range = grp * og * kdim..(grp + 1) * og * kdim;
                    let dxg_range = |j: usize| {
                        let at = (n + j - first) * in_img + grp * cg * g.h * g.w;
                        at..at + cg * g.h * g.w
                    };
                    if nb == 1 && !pointwise {
                        // One image, band by band of output rows.
                        let base = st.offset + n * st.n;
                        let mut r0 = 0;
                        while r0 < g.oh {
                            let r1 = (r0 + band).min(g.oh);
                            let bc = (r1 - r0) * g.ow;
                            let gyg = MatRef::new(&gy[n * out_img + grp * og * p + r0 * g.ow..], p, 1);
                            if want_weight {
                                // ∂W_gᵀ (kdim x og) += col (kdim x bc) · ∂Y_g bandᵀ (bc x og)
                                im2col(simd, x, base, &st, g, grp * cg, (r0, r1), &mut col, bc);
                                let gyt = MatRef::new(gyg.data, 1, p);
                                let colm = MatRef::new(&col[..], bc, 1);
                                matmul(&mut dw[dwg_range.clone()], og, n > first || r0 > 0, colm, gyt, (kdim, og, bc), plan.gemm);
                            }
                            if want_input {
                                // ∂col (kdim x bc) = W_gᵀ (kdim x og) · ∂Y_g band (og x bc)
                                matmul(&mut dcol, bc, false, wt, gyg, (kdim, bc, og), plan.gemm);
                                col2im(simd, &mut dcol, g, (r0, r1), &mut dxc[dxg_range(0)], bc);
                            }
                            r0 = r1;
                        }
                        continue;
                    }
                    // ∂Y_g of the block: og x cols (row stride ld), or the image itself.
                    let gyg = if nb == 1 {
                        MatRef::new(&gy[n * out_img + grp * og * p..], p, 1)
                    } else {
                        gather_block(&gy[n * out_img + grp * og * p..], out_img, og, p, imgs, &mut gyb, ld);
                        MatRef::new(&gyb[..], ld, 1)
                    };
                    if want_weight {
                        // ∂W_gᵀ (kdim x og) += col (kdim x cols) · ∂Y_gᵀ (cols x og)
                        let colm = if pointwise {
                            MatRef::new(&x[st.offset + n * st.n + grp * cg * st.c..], st.c, 1)
                        } else {
                            for j in 0..imgs {
                                im2col(simd, x, st.offset + (n + j) * st.n, &st, g, grp * cg, (0, g.oh), &mut col[j * p..], ld);
                            }
                            MatRef::new(&col[..], ld, 1)
                        };
                        let gyt = MatRef::new(gyg.data, 1, gyg.rs);
                        matmul(&mut dw[dwg_range.clone()], og, n > first, colm, gyt, (kdim, og, cols), plan.gemm);
                    }
                    if want_input {
                        // ∂col (kdim x cols) = W_gᵀ (kdim x og) · ∂Y_g (og x cols)
                        if pointwise {
                            matmul(&mut dxc[dxg_range(0)], p, false, wt, gyg, (kdim, p, og), plan.gemm);
                        } else {
                            matmul(&mut dcol, ld, false, wt, gyg, (kdim, cols, og), plan.gemm);
                            for j in 0..imgs {
                                col2im(simd, &mut dcol[j * p..], g, (0, g.oh), &mut dxc[dxg_range(j)], ld);
                            }
                        }
                    }
                }
                n += imgs;
            }
            dw
        })
        .collect();
    if !want_weight {
        return (dx, Vec::new());
    }
    (dx, sum_transposed(&dw_parts, g.groups, kdim, og))
}

/// Output pixels per image at or below which a large weight's gradient goes by
/// [`conv_dw_slabs`].
const SLAB_MAX_PIXELS: usize = 64;

/// Elements of one group's weight at or above which its gradient goes by [`conv_dw_slabs`]
/// (4 MiB of f32: more than a core's L2 cache).
const SLAB_MIN_WEIGHT: usize = 1 << 20;

/// Elements of a slab's column matrix per block of images (8 MiB of f32), at least one image.
const SLAB_COL_BUDGET: usize = 1 << 21;

/// Whether the weight gradient of `g` goes by [`conv_dw_slabs`]: few output pixels per image
/// and a weight larger than a core's cache. The image-chunked scheme then re-reads and
/// re-writes a whole weight-sized partial for every block of a few hundred columns, and sums
/// one such partial per chunk at the end. Measured on the SimCLR step's ResNet-18 at 128 views
/// (`bench_conv --resnet18`, 2 threads): 1.2x faster for 3x3 512->512 at 4x4 and 256->512
/// stride 2 at 8x8, level for 256->256 at 8x8, slower for 1x1 convolutions and for 16x16 and
/// larger images.
fn weight_by_slabs(g: &ConvGeom) -> bool {
    let threads = rayon::current_num_threads().max(1);
    g.p() <= SLAB_MAX_PIXELS && g.og() * g.kdim() >= SLAB_MIN_WEIGHT && g.cg() >= threads
}

/// The weight gradient split over the weight instead of over the images: each task owns a slab
/// of one group's input channels (one slab per thread) and accumulates
/// `∂W_g[:, slab]ᵀ += col_slab(block) · ∂Y_g(block)ᵀ` over blocks of images (a column matrix of
/// at most `col_budget` elements) in a fixed order, so there are no partial weights to sum and
/// each GEMM's inner dimension is a whole block's output pixels. The result depends only on the
/// geometry and the pool size.
fn conv_dw_slabs<T: Float>(simd: SimdPlan, x: &[T], st: &Strides4, gy: &[T], g: &ConvGeom, col_budget: usize) -> Vec<T> {
    let (p, kdim, og, cg, out_img) = (g.p(), g.kdim(), g.og(), g.cg(), g.out_img());
    let kk = g.kh * g.kw;
    let threads = rayon::current_num_threads().max(1);
    let per = cg.div_ceil(threads.min(cg).max(1));
    let slabs = cg.div_ceil(per);
    let nb = (col_budget / (per * kk * p).max(1)).clamp(1, g.n.max(1));
    let ld = nb * p;
    crate::trace::count(|t| t.conv_weight_slabs += 1);
    // One task per (group, slab): the transpose of its block of ∂W, (channels · kk) x og.
    let parts: Vec<(usize, usize, Vec<T>)> = (0..g.groups * slabs)
        .into_par_iter()
        .map(|task| {
            let (grp, s) = (task / slabs, task % slabs);
            let c0 = s * per;
            let cs = per.min(cg - c0);
            let sub = ConvGeom { c: cs, groups: 1, o: og, ..*g };
            let rows = cs * kk;
            let mut part = vec![T::from_f64(0.0); og * rows];
            let mut col = Scratch::take(rows * ld);
            let mut gyb = Scratch::take(og * ld);
            let mut n = 0;
            while n < g.n {
                let imgs = nb.min(g.n - n);
                let cols = imgs * p;
                gather_block(&gy[n * out_img + grp * og * p..], out_img, og, p, imgs, &mut gyb, ld);
                for j in 0..imgs {
                    im2col(simd, x, st.offset + (n + j) * st.n, st, &sub, grp * cg + c0, (0, g.oh), &mut col[j * p..], ld);
                }
                // ∂W_g[:, slab]ᵀ (rows x og) += col (rows x cols) · ∂Y_gᵀ (cols x og)
                let lhs = MatRef::new(&col[..], ld, 1);
                let rhs = MatRef::new(&gyb[..], 1, ld);
                matmul(&mut part, og, n > 0, lhs, rhs, (rows, og, cols), gemm::Parallelism::None);
                n += imgs;
            }
            (grp, c0, part)
        })
        .collect();
    let mut dw = zeros(g.weight_len());
    for (grp, c0, part) in parts {
        let rows = part.len() / og.max(1);
        let at = grp * og * kdim + c0 * kk;
        // In square tiles, so that neither side is walked with a large stride.
        for o0 in (0..og).step_by(TRANSPOSE_TILE) {
            for r0 in (0..rows).step_by(TRANSPOSE_TILE) {
                for o in o0..(o0 + TRANSPOSE_TILE).min(og) {
                    for r in r0..(r0 + TRANSPOSE_TILE).min(rows) {
                        dw[at + o * kdim + r] = part[r * og + o];
                    }
                }
            }
        }
    }
    dw
}

/// Side of the square tiles in which a transpose is copied.
const TRANSPOSE_TILE: usize = 16;

/// `∂W` from the chunks' partial sums of the `groups` blocks `∂W_gᵀ` (`kdim x og` each,
/// row-major) that the backward accumulates, summed in chunk order. Accumulating the transpose
/// lets the GEMM pack the small `∂Y_g` block rather than transpose the whole column matrix
/// (`kdim x cols`, up to 9 MiB) in every call.
fn sum_transposed<T: Float>(parts: &[Vec<T>], groups: usize, kdim: usize, og: usize) -> Vec<T> {
    const TILE: usize = TRANSPOSE_TILE;
    let len = groups * kdim * og;
    let mut dw = Vec::with_capacity(len);
    let out = &mut dw.spare_capacity_mut()[..len];
    for grp in 0..groups {
        let at = grp * kdim * og;
        // In square tiles, so that neither side is walked with a large stride.
        for i0 in (0..kdim).step_by(TILE) {
            for o0 in (0..og).step_by(TILE) {
                for i in i0..(i0 + TILE).min(kdim) {
                    for o in o0..(o0 + TILE).min(og) {
                        let src = at + i * og + o;
                        let mut sum = parts[0][src];
                        for part in &parts[1..] {
                            sum += part[src];
                        }
                        out[at + o * kdim + i].write(sum);
                    }
                }
            }
        }
    }
    // SAFETY: the loops above wrote every one of the first `len` elements (each (grp, o, i) once).
    unsafe { dw.set_len(len) };
    dw
}

#[cfg(test)]
mod tests {
    //! Banding is invisible: the kernels with a column budget of one element (every band a
    //! single output row) equal the kernels with no budget (one band per image), which
    //! `tests/nn/conv.rs` checks against independent references.
    use super::*;
    use crate::test_data::{data, max_rel};

    /// The geometry of a `k x k` kernel over `n` images of `c x h x w`, `o` output channels.
    fn square_kernel(
        n: usize,
        c: usize,
        (h, w): (usize, usize),
        o: usize,
        k: usize,
        (stride, pad, dil, groups): (usize, usize, usize, usize),
    ) -> ConvGeom {
        let e = dil * (k - 1) + 1;
        let (oh, ow) = ((h + 2 * pad - e) / stride + 1, (w + 2 * pad - e) / stride + 1);
        ConvGeom { n, c, h, w, o, kh: k, kw: k, oh, ow, stride, pad, dil, groups }
    }

    #[test]
    fn bands_of_output_rows_equal_whole_images() {
        // One image per block (n = 1), strided, padded, dilated and grouped; and a batch of 3.
        for (n, stride, pad, dil, groups) in [(1, 1, 1, 1, 1), (1, 2, 2, 2, 2), (3, 1, 1, 1, 1), (2, 3, 0, 1, 3)] {
            let (c, h, w, o, k) = (6, 11, 9, 6, 3);
            let g = square_kernel(n, c, (h, w), o, k, (stride, pad, dil, groups));
            let x = data(n * c * h * w, 1);
            let wt = data(g.weight_len(), 2);
            let gy = data(n * g.out_img(), 3);
            let xl = Layout::contiguous((n, c, h, w));
            let what = format!("n {n} stride {stride} pad {pad} dil {dil} groups {groups}");
            let (banded, whole) = (
                conv_fwd_with(crate::simd::active(), &x, &xl, &wt, &g, 1),
                conv_fwd_with(crate::simd::active(), &x, &xl, &wt, &g, usize::MAX),
            );
            assert!(max_rel(&banded, &whole) < 1e-14, "forward, {what}");
            let banded = conv_bwd_with(crate::simd::active(), &x, &xl, &wt, &gy, &g, (true, true), 1);
            let whole = conv_bwd_with(crate::simd::active(), &x, &xl, &wt, &gy, &g, (true, true), usize::MAX);
            assert!(max_rel(&banded.0, &whole.0) < 1e-14, "backward ∂x, {what}");
            assert!(max_rel(&banded.1, &whole.1) < 1e-14, "backward ∂w, {what}");
        }
    }

    /// `∂W[o, c, ki, kj] = Σ_n Σ_(oy, ox) ∂Y[n, o, oy, ox] · x[n, c, oy·s - pad + ki·dil, ox·s - pad + kj·dil]`
    /// summed term by term in f64, for a contiguous input.
    fn direct_weight_grad(x: &[f64], gy: &[f64], g: &ConvGeom) -> Vec<f64> {
        let (cg, og) = (g.cg(), g.og());
        let mut dw = vec![0.0; g.weight_len()];
        for o in 0..g.o {
            let grp = o / og;
            for c in 0..cg {
                for ki in 0..g.kh {
                    for kj in 0..g.kw {
                        let mut sum = 0.0;
                        for n in 0..g.n {
                            for oy in 0..g.oh {
                                for ox in 0..g.ow {
                                    let iy = (oy * g.stride + ki * g.dil) as isize - g.pad as isize;
                                    let ix = (ox * g.stride + kj * g.dil) as isize - g.pad as isize;
                                    if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                        continue;
                                    }
                                    let xi = ((n * g.c + grp * cg + c) * g.h + iy as usize) * g.w + ix as usize;
                                    sum += gy[((n * g.o + o) * g.oh + oy) * g.ow + ox] * x[xi];
                                }
                            }
                        }
                        dw[((o * cg + c) * g.kh + ki) * g.kw + kj] = sum;
                    }
                }
            }
        }
        dw
    }

    #[test]
    fn weight_gradient_by_slabs_equals_the_direct_sum() {
        // Padded, strided, dilated and grouped; pools of 1, 2 and 3 threads (slabs of uneven
        // size: 5 channels over 2 or 3 slabs); blocks of one image and one block for the batch.
        for (n, c, o, stride, pad, dil, groups) in [(3, 5, 4, 1, 1, 1, 1), (4, 10, 6, 2, 1, 1, 2), (2, 5, 3, 1, 2, 2, 1)] {
            let (h, w, k) = (6, 5, 3);
            let g = square_kernel(n, c, (h, w), o, k, (stride, pad, dil, groups));
            let x = data(n * c * h * w, 4);
            let gy = data(n * g.out_img(), 5);
            let st = Strides4::of(&Layout::contiguous((n, c, h, w)));
            let want = direct_weight_grad(&x, &gy, &g);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                for budget in [1, usize::MAX] {
                    let got = pool.install(|| conv_dw_slabs(crate::simd::active(), &x, &st, &gy, &g, budget));
                    let what = format!("n {n} c {c} o {o} stride {stride} pad {pad} dil {dil} groups {groups}, {threads} threads, budget {budget}");
                    assert!(max_rel(&got, &want) < 1e-13, "{what}: {}", max_rel(&got, &want));
                }
            }
        }
    }
}
