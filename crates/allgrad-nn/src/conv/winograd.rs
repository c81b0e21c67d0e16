//! 3x3 convolutions with stride 1 and padding 1 by Winograd's minimal filtering F(2x2, 3x3):
//! the forward and the input gradient (itself such a convolution, with the kernel turned by
//! 180° and its channel axes swapped).
//!
//! The output is cut into 2x2 tiles. Each tile's 4x4 input patch `d` and each 3x3 kernel `g`
//! are transformed (`V = Bᵀ d B`, `U = G g Gᵀ`), the sixteen transformed positions `ξ` are
//! independent channel contractions `M[ξ] = U[ξ] · V[ξ]` (one GEMM per position over a block
//! of tiles), and each tile's output is `Aᵀ M A`. A tile takes 16 multiply-adds per channel
//! pair instead of im2col's 36: 2.25 times fewer, and the GEMMs run on the same kernel as the
//! im2col path. The transforms are sums and differences (and halves in `G`), so the rounding
//! stays close to that of a plain sum of products (in the tests, f32 within 1e-6 and f64
//! within 1e-14 of im2col, relative to the largest output; Lavin and Gray, "Fast Algorithms for Convolutional
//! Neural Networks", 2016, give the matrices; the larger F(4x4, 3x3) loses precision in f32
//! and is not used).
//!
//! Blocks of whole images are independent tasks. Every sum has a fixed order, so results are
//! deterministic on a given machine; they differ from the im2col path's in rounding only.
//!
//! `ALLGRAD_WINOGRAD=0` turns the path off (every convolution then takes im2col + GEMM).

use gemm::Parallelism;
use rayon::prelude::*;

use super::im2col::ConvGeom;
use crate::cpu::{matmul, zeros, Float, MatRef, Scratch, Strides4};

/// Fewest input and output channels that take the path: below it the transforms weigh more
/// against the GEMMs. Set by judgement; measured only down to 64 channels (the ResNet-18 layers).
const MIN_CHANNELS: usize = 16;

/// Elements of one block's transformed inputs and products together (`16·(cin + cout)` per
/// tile): 2 MiB of f32. Chosen by measurement on the ResNet-18 layers (`bench_conv --resnet18`,
/// budgets of 2^17 to 2^23 elements alternating): 2^19 was fastest or within the noise of it on
/// every layer, 10-28% faster than 2^21; below it the wide layers' GEMMs get too thin.
const BLOCK_BUDGET: usize = 1 << 19;

/// Most transformed elements (`16·(cin + cout)` per tile) one image may have: a block holds at
/// least one whole image, so larger images take im2col, which works in bands of rows.
const MAX_IMAGE_ELEMS: usize = 1 << 23;

/// Whether the path is on (`ALLGRAD_WINOGRAD`, [`crate::settings`]). A bad value never reaches
/// here: [`crate::conv2d`] fails with it first.
fn enabled() -> bool {
    matches!(crate::settings::winograd(), Ok(true))
}

/// Whether [`forward`] and [`input_grad`] compute this convolution.
pub(crate) fn applies(g: &ConvGeom) -> bool {
    enabled() && fits(g)
}

/// The geometry the path handles: 3x3, stride 1, padding 1, no dilation, one group, enough
/// channels, and images within [`MAX_IMAGE_ELEMS`].
fn fits(g: &ConvGeom) -> bool {
    let tiles = g.h.div_ceil(2) * g.w.div_ceil(2);
    g.kh == 3
        && g.kw == 3
        && g.stride == 1
        && g.pad == 1
        && g.dil == 1
        && g.groups == 1
        && g.c >= MIN_CHANNELS
        && g.o >= MIN_CHANNELS
        && g.n > 0
        && g.h > 0
        && g.w > 0
        && tiles.saturating_mul(16 * (g.c + g.o)) <= MAX_IMAGE_ELEMS
}

/// `conv2d(x, w)` for a geometry that [`applies`]: `[n, o, h, w]`, contiguous.
pub(crate) fn forward<T: Float>(x: &[T], st: &Strides4, w: &[T], g: &ConvGeom) -> Vec<T> {
    let u = transform_kernels(w, g.o, g.c, false);
    convolve(x, st, g.n, (g.h, g.w), &u, (g.c, g.o))
}

/// `∂x` of `conv2d(x, w)` for a geometry that [`applies`], from the contiguous `∂y`
/// (`[n, o, h, w]`): the convolution of `∂y` with `w` turned by 180° and its channels swapped.
pub(crate) fn input_grad<T: Float>(w: &[T], gy: &[T], g: &ConvGeom) -> Vec<T> {
    let u = transform_kernels(w, g.o, g.c, true);
    let plane = g.h * g.w;
    let st = Strides4 { offset: 0, n: g.o * plane, c: plane, h: g.w, w: 1 };
    convolve(gy, &st, g.n, (g.h, g.w), &u, (g.o, g.c))
}

/// `U[ξ] = G g Gᵀ` of every kernel, laid out `[rows][16][cols]` (so `U[ξ]` is the
/// `rows x cols` matrix at offset `ξ·cols` with row stride `16·cols`): for the forward (`flip`
/// false) rows are the `o` output channels and cols the `c` input channels of `w`
/// (`[o, c, 3, 3]`); for the input gradient rows are `c` and cols `o`, and each kernel is
/// turned by 180°. Rows in parallel.
fn transform_kernels<T: Float>(w: &[T], o: usize, c: usize, flip: bool) -> Vec<T> {
    let (rows, cols) = if flip { (c, o) } else { (o, c) };
    let mut u = vec![T::from_f64(0.0); 16 * rows * cols];
    let half = T::from_f64(0.5);
    u.par_chunks_mut(16 * cols).enumerate().for_each(|(r, ur)| {
        for col in 0..cols {
            let (k, ci) = if flip { (col, r) } else { (r, col) };
            let src = &w[(k * c + ci) * 9..][..9];
            let tap = |i: usize, j: usize| if flip { src[(2 - i) * 3 + (2 - j)] } else { src[i * 3 + j] };
            // G g: 4 x 3, then (G g) Gᵀ: 4 x 4.
            for j in 0..3 {
                let (a, b, cc) = (tap(0, j), tap(1, j), tap(2, j));
                let gg = [a, half * (a + b + cc), half * (a - b + cc), cc];
                for (i, v) in gg.into_iter().enumerate() {
                    // Column j of row i of G g, kept in the ξ = 4i + j slots until the row is done.
                    ur[(4 * i + j) * cols + col] = v;
                }
            }
            for i in 0..4 {
                let (a, b, cc) = (ur[4 * i * cols + col], ur[(4 * i + 1) * cols + col], ur[(4 * i + 2) * cols + col]);
                let v = [a, half * (a + b + cc), half * (a - b + cc), cc];
                for (j, v) in v.into_iter().enumerate() {
                    ur[(4 * i + j) * cols + col] = v;
                }
            }
        }
    });
    u
}

/// The convolution of `x` (`n` images of `cin` planes of `h x w`, strides `st`) with the
/// transformed kernels `u` (`[cout][16][cin]`), padding 1: `[n, cout, h, w]`, contiguous.
fn convolve<T: Float>(x: &[T], st: &Strides4, n: usize, (h, w): (usize, usize), u: &[T], (cin, cout): (usize, usize)) -> Vec<T> {
    let (th, tw) = (h.div_ceil(2), w.div_ceil(2));
    let tiles = th * tw;
    let threads = rayon::current_num_threads().max(1);
    let want_tiles = (BLOCK_BUDGET / (16 * (cin + cout))).max(1);
    let nb = (want_tiles / tiles).clamp(1, (n / threads).max(1));
    let blocks = n.div_ceil(nb);
    let par = if blocks < threads { Parallelism::Rayon(threads) } else { Parallelism::None };
    let out_img = cout * h * w;
    let mut out = zeros(n * out_img);
    out.par_chunks_mut(nb * out_img).enumerate().for_each(|(blk, y)| {
        let first = blk * nb;
        let imgs = y.len() / out_img;
        let tb = imgs * tiles;
        let mut v = Scratch::take(16 * cin * tb);
        let mut m = Scratch::take(16 * cout * tb);
        let mut rows = Scratch::take((2 * th + 10) * (2 * tw + 2));
        for j in 0..imgs {
            let img = st.offset + (first + j) * st.n;
            for ci in 0..cin {
                let plane = PlaneRef { x, at: img + ci * st.c, h, w, rs: st.h, cs: st.w };
                input_tiles(&plane, tw, th, &mut rows, &mut v[ci * tb + j * tiles..], cin * tb);
            }
        }
        for xi in 0..16 {
            let lhs = MatRef::new(&u[xi * cin..], 16 * cin, 1);
            let rhs = MatRef::new(&v[xi * cin * tb..], tb, 1);
            matmul(&mut m[xi * cout * tb..][..cout * tb], tb, false, lhs, rhs, (cout, tb, cin), par);
        }
        for j in 0..imgs {
            for k in 0..cout {
                output_tiles(
                    &m[k * tb + j * tiles..],
                    cout * tb,
                    tw,
                    th,
                    &mut rows,
                    &mut y[(j * cout + k) * h * w..][..h * w],
                    w,
                );
            }
        }
    });
    out
}

/// One input plane: element `(r, s)` is `x[at + r·rs + s·cs]`.
struct PlaneRef<'a, T> {
    x: &'a [T],
    at: usize,
    h: usize,
    w: usize,
    rs: usize,
    cs: usize,
}

impl<T: Float> PlaneRef<'_, T> {
    /// Row `r` (which may lie in the padding) with a zero before it and zeros after it, split
    /// into its even and odd columns: padded column `2k` goes to `even[k]`, `2k + 1` to `odd[k]`.
    fn row_into(&self, r: isize, even: &mut [T], odd: &mut [T]) {
        let zero = T::from_f64(0.0);
        even.fill(zero);
        odd.fill(zero);
        if r < 0 || r as usize >= self.h {
            return;
        }
        let start = self.at + r as usize * self.rs;
        // Input column s is padded column s + 1.
        for s in 0..self.w {
            let v = self.x[start + s * self.cs];
            if s % 2 == 0 {
                odd[s / 2] = v;
            } else {
                even[s / 2 + 1] = v;
            }
        }
    }
}

/// `out[i] = f(a[i], b[i])` over equal-length rows, written so that it vectorises.
#[inline(always)]
fn zip2<T: Float>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    let n = out.len();
    let (a, b) = (&a[..n], &b[..n]);
    for i in 0..n {
        out[i] = f(a[i], b[i]);
    }
}

/// `out[i] = f(a[i], b[i], c[i])` over equal-length rows, written so that it vectorises.
#[inline(always)]
fn zip3<T: Float>(out: &mut [T], a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> T) {
    let n = out.len();
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    for i in 0..n {
        out[i] = f(a[i], b[i], c[i]);
    }
}

/// `Bᵀ d B` of every tile of one plane. Tile `t` (row-major over `th x tw`) goes to
/// `v[ξ·xi_stride + t]`. `buf` is scratch for the padded plane, split into even and odd
/// columns, and eight rows (`(2·th + 10)·(2·tw + 2)` in all).
fn input_tiles<T: Float>(plane: &PlaneRef<'_, T>, tw: usize, th: usize, buf: &mut [T], v: &mut [T], xi_stride: usize) {
    // Padded columns 0 ..= 2tw + 1: tw + 1 even and tw + 1 odd ones.
    let (hw, ph) = (tw + 1, 2 * th + 2);
    let (ev, rest) = buf.split_at_mut(ph * hw);
    let (od, rest) = rest.split_at_mut(ph * hw);
    let (be, bo) = rest[..8 * hw].split_at_mut(4 * hw);
    for r in 0..ph {
        plane.row_into(r as isize - 1, &mut ev[r * hw..(r + 1) * hw], &mut od[r * hw..(r + 1) * hw]);
    }
    for ty in 0..th {
        // Bᵀ d along the rows (patch rows 2ty-1 .. 2ty+2), even and odd columns alike.
        for (src, dst) in [(&*ev, &mut *be), (&*od, &mut *bo)] {
            let row = |i: usize| &src[(2 * ty + i) * hw..(2 * ty + i + 1) * hw];
            let (b0, rest) = dst.split_at_mut(hw);
            let (b1, rest) = rest.split_at_mut(hw);
            let (b2, b3) = rest.split_at_mut(hw);
            zip2(b0, row(0), row(2), |a, c| a - c);
            zip2(b1, row(1), row(2), |a, c| a + c);
            zip2(b2, row(2), row(1), |a, c| a - c);
            zip2(b3, row(1), row(3), |a, c| a - c);
        }
        // Then along the columns of each tile: patch columns 2tx .. 2tx+3 are even[tx],
        // odd[tx], even[tx+1], odd[tx+1].
        let t0 = ty * tw;
        for i in 0..4 {
            let (e, o) = (&be[i * hw..(i + 1) * hw], &bo[i * hw..(i + 1) * hw]);
            let (e0, e1, o0, o1) = (&e[..tw], &e[1..], &o[..tw], &o[1..]);
            let (v0, rest) = v[4 * i * xi_stride..].split_at_mut(xi_stride);
            let (v1, rest) = rest.split_at_mut(xi_stride);
            let (v2, v3) = rest.split_at_mut(xi_stride);
            zip2(&mut v0[t0..t0 + tw], e0, e1, |a, c| a - c);
            zip2(&mut v1[t0..t0 + tw], o0, e1, |b, c| b + c);
            zip2(&mut v2[t0..t0 + tw], e1, o0, |c, b| c - b);
            zip2(&mut v3[t0..t0 + tw], o0, o1, |b, d| b - d);
        }
    }
}

/// `Aᵀ M A` of every tile of one output plane: tile `t`'s products are `m[ξ·xi_stride + t]`;
/// the plane is `y` (`h x w`, row stride `w`, `h` from `y`'s length). `rows` is scratch for
/// twelve rows of `tw`.
fn output_tiles<T: Float>(m: &[T], xi_stride: usize, tw: usize, th: usize, rows: &mut [T], y: &mut [T], w: usize) {
    let h = y.len() / w;
    let (s, eo) = rows[..12 * tw].split_at_mut(8 * tw);
    for ty in 0..th {
        let t0 = ty * tw;
        let mm = |xi: usize| &m[xi * xi_stride + t0..][..tw];
        // Aᵀ M: s0[j] = M0j + M1j + M2j, s1[j] = M1j - M2j - M3j (eight rows of tw).
        for j in 0..4 {
            zip3(&mut s[j * tw..(j + 1) * tw], mm(j), mm(4 + j), mm(8 + j), |a, b, c| a + b + c);
            zip3(&mut s[(4 + j) * tw..(5 + j) * tw], mm(4 + j), mm(8 + j), mm(12 + j), |b, c, d| b - c - d);
        }
        // · A: even columns s[0] + s[1] + s[2], odd ones s[1] - s[2] - s[3], for both rows.
        for r in 0..2 {
            let yr = 2 * ty + r;
            if yr >= h {
                break;
            }
            let q = |j: usize| &s[(4 * r + j) * tw..(4 * r + j + 1) * tw];
            let (e, o) = eo.split_at_mut(2 * tw);
            zip3(&mut e[..tw], q(0), q(1), q(2), |a, b, c| a + b + c);
            zip3(&mut o[..tw], q(1), q(2), q(3), |b, c, d| b - c - d);
            let dst = &mut y[yr * w..(yr + 1) * w];
            let (pairs, tail) = dst.split_at_mut(w / 2 * 2);
            for ((p, a), b) in pairs.chunks_exact_mut(2).zip(e.iter()).zip(o.iter()) {
                p[0] = *a;
                p[1] = *b;
            }
            if let Some(t) = tail.first_mut() {
                *t = e[w / 2];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The Winograd path against the im2col path (`tests/nn/conv.rs` checks both against
    //! Candle's convolution and finite differences): odd and even planes, one image and
    //! batches that do not fill the last block, a strided input, f64 and f32.
    use super::*;
    use crate::conv::cpu::{conv_bwd_im2col, conv_fwd_im2col};
    use crate::test_data::{data, max_rel};
    use candle_core::Layout;

    fn geom(n: usize, c: usize, o: usize, h: usize, w: usize) -> ConvGeom {
        ConvGeom { n, c, h, w, o, kh: 3, kw: 3, oh: h, ow: w, stride: 1, pad: 1, dil: 1, groups: 1 }
    }

    #[test]
    fn forward_and_input_gradient_equal_im2col() {
        for (n, c, o, h, w) in [(1, 16, 16, 4, 4), (3, 17, 20, 5, 7), (5, 16, 24, 1, 1), (2, 32, 16, 8, 3), (9, 16, 16, 2, 6)] {
            let g = geom(n, c, o, h, w);
            assert!(fits(&g));
            let x = data(n * c * h * w, 1);
            let wt = data(g.weight_len(), 2);
            let gy = data(n * g.out_img(), 3);
            let xl = Layout::contiguous((n, c, h, w));
            let what = format!("n {n} c {c} o {o} {h}x{w}");
            let want = conv_fwd_im2col(crate::simd::active(), &x, &xl, &wt, &g);
            assert!(max_rel(&forward(&x, &Strides4::of(&xl), &wt, &g), &want) < 1e-14, "forward f64, {what}");
            let (want_dx, _) = conv_bwd_im2col(crate::simd::active(), &x, &xl, &wt, &gy, &g, true, false);
            assert!(max_rel(&input_grad(&wt, &gy, &g), &want_dx) < 1e-14, "∂x f64, {what}");

            let (x32, w32, gy32): (Vec<f32>, Vec<f32>, Vec<f32>) = (
                x.iter().map(|v| *v as f32).collect(),
                wt.iter().map(|v| *v as f32).collect(),
                gy.iter().map(|v| *v as f32).collect(),
            );
            let got = forward(&x32, &Strides4::of(&xl), &w32, &g);
            assert!(max_rel(&got, &conv_fwd_im2col(crate::simd::active(), &x32, &xl, &w32, &g)) < 1e-6, "forward f32, {what}");
            let want_dx32 = conv_bwd_im2col(crate::simd::active(), &x32, &xl, &w32, &gy32, &g, true, false).0;
            assert!(max_rel(&input_grad(&w32, &gy32, &g), &want_dx32) < 1e-6, "∂x f32, {what}");
        }
    }

    #[test]
    fn a_strided_input_equals_its_contiguous_copy() {
        // x stored as [c, n, w, h] and read through a permuted layout of shape [n, c, h, w].
        let (n, c, o, h, w) = (2, 16, 16, 5, 6);
        let g = geom(n, c, o, h, w);
        let stored = data(n * c * h * w, 4);
        let xl = Layout::contiguous((c, n, w, h)).permute(&[1, 0, 3, 2]).unwrap();
        let mut dense = vec![0.0; stored.len()];
        let st = Strides4::of(&xl);
        for (i, d) in dense.iter_mut().enumerate() {
            let (b, ci, r, s) = (i / (c * h * w), i / (h * w) % c, i / w % h, i % w);
            *d = stored[st.offset + b * st.n + ci * st.c + r * st.h + s * st.w];
        }
        let wt = data(g.weight_len(), 5);
        let got = forward(&stored, &st, &wt, &g);
        let want = forward(&dense, &Strides4::of(&Layout::contiguous((n, c, h, w))), &wt, &g);
        assert_eq!(got, want);
    }

    #[test]
    fn only_3x3_stride_1_padding_1_with_enough_channels_and_bounded_planes_fits() {
        let g = geom(2, 16, 16, 8, 8);
        assert!(fits(&g));
        // ResNet-50's 56x56 stage on ImageNet fits.
        assert!(fits(&geom(2, 64, 64, 56, 56)));
        for bad in [
            ConvGeom { stride: 2, oh: 4, ow: 4, ..g },
            ConvGeom { pad: 0, oh: 6, ow: 6, ..g },
            ConvGeom { dil: 2, oh: 6, ow: 6, ..g },
            ConvGeom { groups: 2, ..g },
            ConvGeom { kh: 1, kw: 1, pad: 0, ..g },
            ConvGeom { c: 15, ..g },
            ConvGeom { o: 8, ..g },
            // 224x224 planes of 64 channels: 12,544 tiles, 25.7 million transformed values.
            ConvGeom { c: 64, o: 64, h: 224, w: 224, oh: 224, ow: 224, ..g },
        ] {
            assert!(!fits(&bad), "{bad:?}");
        }
    }
}
