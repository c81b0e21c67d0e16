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
//! Every reduction has a fixed order: the blocks depend only on the geometry and on rayon's
//! pool size, never on scheduling, so results are deterministic on a given machine.

use candle_core::Layout;
use rayon::prelude::*;

use crate::cpu::{matmul, BatchPlan, Float, MatRef, Strides4};
use crate::im2col::{col2im, im2col, ConvGeom};

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

/// Forward: per block of images and group, `Y_g = W_g · [im2col(x[n, g]) ...]`.
pub(crate) fn conv_fwd<T: Float>(x: &[T], xl: &Layout, w: &[T], g: &ConvGeom) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let st = Strides4::of(xl);
    let (p, kdim, og, cg, out_img) = (g.p(), g.kdim(), g.og(), g.cg(), g.out_img());
    // Keep at least one block per thread when the batch allows it.
    let threads = rayon::current_num_threads().max(1);
    let nb = block_images(p, g.n / threads);
    let plan = BatchPlan::new(g.n.div_ceil(nb), 1);
    let pointwise = nb == 1 && g.is_pointwise(&st);
    let ld = nb * p;
    let mut out = vec![zero; g.n * out_img];
    if out.is_empty() {
        return out;
    }
    let col_len = if pointwise { 0 } else { kdim * ld };
    let yb_len = if nb > 1 { og * ld } else { 0 };
    out.par_chunks_mut(nb * out_img).enumerate().for_each_init(
        || (vec![zero; col_len], vec![zero; yb_len]),
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
                for j in 0..imgs {
                    im2col(x, st.offset + (first + j) * st.n, &st, g, grp * cg, &mut col[j * p..], ld);
                }
                let rhs = MatRef::new(&col[..], ld, 1);
                if nb == 1 {
                    matmul(yg, p, false, lhs, rhs, (og, p, kdim), plan.gemm);
                } else {
                    matmul(yb, ld, false, lhs, rhs, (og, imgs * p, kdim), plan.gemm);
                    scatter_block(yb, ld, og, p, imgs, yg, out_img);
                }
            }
        },
    );
    out
}

/// Backward: per block of images and group, `∂W_g += ∂Y_g · colᵀ` and
/// `∂x[n, g] = col2im(W_gᵀ · ∂Y_g)`. Images are cut into a fixed number of chunks; each chunk
/// accumulates its own weight gradient and the chunks are summed in order, so the result does
/// not depend on scheduling.
pub(crate) fn conv_bwd<T: Float>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    gy: &[T],
    g: &ConvGeom,
    want_input: bool,
    want_weight: bool,
) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let st = Strides4::of(xl);
    let (p, kdim, og, cg, out_img) = (g.p(), g.kdim(), g.og(), g.cg(), g.out_img());
    let plan = BatchPlan::new(g.n, 2);
    let nb = block_images(p, plan.per_chunk);
    let pointwise = nb == 1 && g.is_pointwise(&st);
    let ld = nb * p;
    let in_img = g.in_img();
    let mut dx = vec![zero; if want_input { g.n * in_img } else { 0 }];
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
            let mut col = vec![zero; if want_weight && !pointwise { kdim * ld } else { 0 }];
            let mut dcol = vec![zero; if want_input && !pointwise { kdim * ld } else { 0 }];
            let mut gyb = vec![zero; if nb > 1 { og * ld } else { 0 }];
            let first = chunk * plan.per_chunk;
            let last = (first + plan.per_chunk).min(g.n);
            // Write the fresh (calloc'd, not yet mapped) ∂x pages before col2im reads them:
            // a first touch by a read maps the shared zero page, and the write after it costs a
            // copy-on-write fault with a TLB shootdown on every core.
            dxc.fill(zero);
            let mut n = first;
            while n < last {
                let imgs = nb.min(last - n);
                let cols = imgs * p;
                for grp in 0..g.groups {
                    // ∂Y_g of the block: og x cols (row stride ld), or the image itself.
                    let gyg = if nb == 1 {
                        MatRef::new(&gy[n * out_img + grp * og * p..], p, 1)
                    } else {
                        gather_block(&gy[n * out_img + grp * og * p..], out_img, og, p, imgs, &mut gyb, ld);
                        MatRef::new(&gyb[..], ld, 1)
                    };
                    if want_weight {
                        // ∂W_g (og x kdim) += ∂Y_g (og x cols) · colᵀ (cols x kdim)
                        let colt = if pointwise {
                            MatRef::new(&x[st.offset + n * st.n + grp * cg * st.c..], 1, st.c)
                        } else {
                            for j in 0..imgs {
                                im2col(x, st.offset + (n + j) * st.n, &st, g, grp * cg, &mut col[j * p..], ld);
                            }
                            MatRef::new(&col[..], 1, ld)
                        };
                        let dwg = &mut dw[grp * og * kdim..(grp + 1) * og * kdim];
                        matmul(dwg, kdim, n > first, gyg, colt, (og, kdim, cols), plan.gemm);
                    }
                    if want_input {
                        // ∂col (kdim x cols) = W_gᵀ (kdim x og) · ∂Y_g (og x cols)
                        let wt = MatRef::new(&w[grp * og * kdim..], 1, kdim);
                        if pointwise {
                            let img = &mut dxc[(n - first) * in_img..(n - first + 1) * in_img];
                            let dxg = &mut img[grp * cg * g.h * g.w..(grp + 1) * cg * g.h * g.w];
                            matmul(dxg, p, false, wt, gyg, (kdim, p, og), plan.gemm);
                        } else {
                            matmul(&mut dcol, ld, false, wt, gyg, (kdim, cols, og), plan.gemm);
                            for j in 0..imgs {
                                let img = &mut dxc[(n + j - first) * in_img..(n + j - first + 1) * in_img];
                                let dxg = &mut img[grp * cg * g.h * g.w..(grp + 1) * cg * g.h * g.w];
                                col2im(&dcol[j * p..], g, dxg, ld);
                            }
                        }
                    }
                }
                n += imgs;
            }
            dw
        })
        .collect();
    let mut out = dx;
    if want_weight {
        let mut parts = dw_parts.into_iter();
        let mut dw = parts.next().unwrap_or_else(|| vec![zero; g.weight_len()]);
        for part in parts {
            for (a, b) in dw.iter_mut().zip(&part) {
                *a += *b;
            }
        }
        out.extend_from_slice(&dw);
    }
    out
}
