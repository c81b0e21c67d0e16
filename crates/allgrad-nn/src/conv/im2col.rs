//! The column kernels behind [`crate::conv2d`]: `im2col` unfolds the receptive fields of one
//! image into a matrix so that a convolution becomes one GEMM, `col2im` folds such a matrix
//! back, summing overlaps (the adjoint of `im2col`, used for the input gradient).

use crate::cpu::{Float, Strides4};
use crate::simd::{dispatch, SimdPlan};

/// The resolved geometry of one 2-D convolution (all sizes in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvGeom {
    /// Batch size.
    pub n: usize,
    /// Input channels (all groups).
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels (all groups).
    pub o: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Output height.
    pub oh: usize,
    /// Output width.
    pub ow: usize,
    /// Stride (both axes).
    pub stride: usize,
    /// Zero padding (both axes, both sides).
    pub pad: usize,
    /// Dilation (both axes).
    pub dil: usize,
    /// Number of groups.
    pub groups: usize,
}

impl ConvGeom {
    /// Input channels per group.
    pub fn cg(&self) -> usize {
        self.c / self.groups
    }
    /// Output channels per group.
    pub fn og(&self) -> usize {
        self.o / self.groups
    }
    /// Rows of a group's column matrix: `cg * kh * kw`.
    pub fn kdim(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    /// Output pixels per image: `oh * ow`.
    pub fn p(&self) -> usize {
        self.oh * self.ow
    }
    /// Elements of one input image.
    pub fn in_img(&self) -> usize {
        self.c * self.h * self.w
    }
    /// Elements of one output image.
    pub fn out_img(&self) -> usize {
        self.o * self.p()
    }
    /// Elements of the weight.
    pub fn weight_len(&self) -> usize {
        self.o * self.kdim()
    }
    /// A 1x1 convolution with stride 1 and no padding reads the input itself as its column
    /// matrix, provided each channel plane is one contiguous run of `h * w` elements.
    pub fn is_pointwise(&self, x: &Strides4) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == 1 && self.pad == 0 && x.w == 1 && (self.h == 1 || x.h == self.w)
    }

    /// Whether, at stride 1 with the output as wide as the input and input rows that are runs of
    /// `w` elements, each tap's column-matrix row is the input plane shifted by a constant: the
    /// valid block of a tap is then one contiguous run of the plane (with the padding columns
    /// between its rows, which [`ShiftedRun::zero_wrapped`] clears). Every 3x3 convolution with
    /// padding 1 and stride 1 is such a convolution.
    pub fn rows_are_shifted_runs(&self, x: &Strides4) -> bool {
        self.stride == 1 && self.ow == self.w && x.w == 1 && x.h == self.w
    }

    /// The run of a tap at kernel column `kj` over the valid output rows `ylo..yhi` of a band
    /// starting at output row `r0` (for [`Self::rows_are_shifted_runs`] geometry), or `None`
    /// when the tap reads only padding.
    fn shifted_run(&self, (ylo, yhi): (usize, usize), kj: usize, r0: usize) -> Option<ShiftedRun> {
        let (xlo, xhi) = self.valid(kj * self.dil, self.w, self.ow);
        if ylo == yhi || xlo == xhi {
            return None;
        }
        Some(ShiftedRun {
            start: (ylo - r0) * self.ow + xlo,
            end: (yhi - 1 - r0) * self.ow + xhi,
            first_x: xlo + kj * self.dil - self.pad,
            ow: self.ow,
            xlo,
            xhi,
        })
    }

    /// The output positions `lo..hi` along an axis of `size` input elements whose tap at
    /// kernel offset `off` (already multiplied by the dilation) lands inside the input.
    fn valid(&self, off: usize, size: usize, out: usize) -> (usize, usize) {
        let s = self.stride;
        let lo = if off >= self.pad { 0 } else { (self.pad - off).div_ceil(s) };
        let hi = if size + self.pad <= off { 0 } else { (size + self.pad - off).div_ceil(s) };
        let hi = hi.min(out);
        (lo.min(hi), hi)
    }
}

/// Writes the column matrix of the output rows `r0..r1` (`kdim x (r1 - r0)·ow`, row-major with
/// row stride `ld`) of the channels `c0..c0 + cg` of the image starting at `x[base]` (channel
/// stride `st.c`, row stride `st.h`, column stride `st.w`). With `ld` wider than a matrix
/// several images' matrices sit side by side in one buffer, each starting `p` columns after
/// the previous; with fewer rows than `oh` the matrix is one band of the image's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col<T: Float>(
    plan: SimdPlan,
    x: &[T],
    base: usize,
    st: &Strides4,
    g: &ConvGeom,
    c0: usize,
    rows: (usize, usize),
    col: &mut [T],
    ld: usize,
) {
    dispatch!(
        plan,
        fn copy<T: Float>(
            x: &[T],
            base: usize,
            st: &Strides4,
            g: &ConvGeom,
            c0: usize,
            rows: (usize, usize),
            col: &mut [T],
            ld: usize,
        ) -> () {
            im2col_body(x, base, st, g, c0, rows, col, ld)
        }
    )
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn im2col_body<T: Float>(
    x: &[T],
    base: usize,
    st: &Strides4,
    g: &ConvGeom,
    c0: usize,
    (r0, r1): (usize, usize),
    col: &mut [T],
    ld: usize,
) {
    let zero = T::from_f64(0.0);
    let (cols, s) = ((r1 - r0) * g.ow, g.stride);
    let shifted = g.rows_are_shifted_runs(st);
    for ci in 0..g.cg() {
        let xc = base + (c0 + ci) * st.c;
        if shifted {
            for ki in 0..g.kh {
                let (ylo, yhi) = band(g.valid(ki * g.dil, g.h, g.oh), r0, r1);
                for kj in 0..g.kw {
                    let row = ((ci * g.kh + ki) * g.kw + kj) * ld;
                    let row = &mut col[row..row + cols];
                    let Some(run) = g.shifted_run((ylo, yhi), kj, r0) else {
                        row.fill(zero);
                        continue;
                    };
                    row[..run.start].fill(zero);
                    row[run.end..].fill(zero);
                    let src = xc + (ylo + ki * g.dil - g.pad) * g.w + run.first_x;
                    row[run.start..run.end].copy_from_slice(&x[src..src + run.end - run.start]);
                    run.zero_wrapped(row);
                }
            }
            continue;
        }
        for ki in 0..g.kh {
            let (ylo, yhi) = band(g.valid(ki * g.dil, g.h, g.oh), r0, r1);
            for kj in 0..g.kw {
                let row = ((ci * g.kh + ki) * g.kw + kj) * ld;
                let row = &mut col[row..row + cols];
                let (xlo, xhi) = g.valid(kj * g.dil, g.w, g.ow);
                row[..(ylo - r0) * g.ow].fill(zero);
                row[(yhi - r0) * g.ow..].fill(zero);
                for oy in ylo..yhi {
                    let dst = &mut row[(oy - r0) * g.ow..(oy - r0 + 1) * g.ow];
                    dst[..xlo].fill(zero);
                    dst[xhi..].fill(zero);
                    if xlo == xhi {
                        continue;
                    }
                    let iy = oy * s + ki * g.dil - g.pad;
                    let ix0 = xlo * s + kj * g.dil - g.pad;
                    let src = xc + iy * st.h + ix0 * st.w;
                    let dst = &mut dst[xlo..xhi];
                    if s == 1 && st.w == 1 {
                        dst.copy_from_slice(&x[src..src + dst.len()]);
                    } else {
                        let step = s * st.w;
                        for (j, d) in dst.iter_mut().enumerate() {
                            *d = x[src + j * step];
                        }
                    }
                }
            }
        }
    }
}

/// A tap's valid block as one run `start..end` of its column-matrix row; `first_x` is the input
/// column the run starts at. Inside the run, the output columns outside `xlo..xhi` of each row
/// but the last are padding that a plain shifted copy fills with neighbouring input.
struct ShiftedRun {
    start: usize,
    end: usize,
    first_x: usize,
    ow: usize,
    xlo: usize,
    xhi: usize,
}

impl ShiftedRun {
    /// Zeroes the padding columns inside the run.
    fn zero_wrapped<T: Float>(&self, row: &mut [T]) {
        let zero = T::from_f64(0.0);
        let gap = self.ow - self.xhi + self.xlo;
        if gap == 0 {
            return;
        }
        // From the end of one output row's valid columns to the start of the next row's.
        let mut at = self.start - self.xlo + self.xhi;
        while at < self.end {
            if gap == 1 {
                // The 3x3 case; a single store, not a call to memset.
                row[at] = zero;
            } else {
                row[at..at + gap].fill(zero);
            }
            at += self.ow;
        }
    }
}

/// The valid output rows `lo..hi` of a tap, cut to the band `r0..r1` (an empty range inside
/// the band when they miss it).
fn band((lo, hi): (usize, usize), r0: usize, r1: usize) -> (usize, usize) {
    let lo = lo.clamp(r0, r1);
    (lo, hi.clamp(lo, r1))
}

/// Adds the column matrix of the output rows `r0..r1` (`kdim x (r1 - r0)·ow`, row stride `ld`)
/// back into the contiguous `cg x h x w` block `dx` of one image: every column entry goes to
/// the input element it was read from.
///
/// `col` is scratch: the entries of taps that fall into the padding may be overwritten.
pub(crate) fn col2im<T: Float>(plan: SimdPlan, col: &mut [T], g: &ConvGeom, rows: (usize, usize), dx: &mut [T], ld: usize) {
    dispatch!(
        plan,
        fn copy<T: Float>(col: &mut [T], g: &ConvGeom, rows: (usize, usize), dx: &mut [T], ld: usize) -> () {
            col2im_body(col, g, rows, dx, ld)
        }
    )
}

#[inline(always)]
fn col2im_body<T: Float>(col: &mut [T], g: &ConvGeom, (r0, r1): (usize, usize), dx: &mut [T], ld: usize) {
    let (cols, s) = ((r1 - r0) * g.ow, g.stride);
    // `dx` is a contiguous block, so its rows are runs of `w` elements.
    let shifted = g.rows_are_shifted_runs(&Strides4 { offset: 0, n: 0, c: g.h * g.w, h: g.w, w: 1 });
    for ci in 0..g.cg() {
        let plane = &mut dx[ci * g.h * g.w..(ci + 1) * g.h * g.w];
        if shifted {
            for ki in 0..g.kh {
                let (ylo, yhi) = band(g.valid(ki * g.dil, g.h, g.oh), r0, r1);
                for kj in 0..g.kw {
                    let row = ((ci * g.kh + ki) * g.kw + kj) * ld;
                    let row = &mut col[row..row + cols];
                    let Some(run) = g.shifted_run((ylo, yhi), kj, r0) else { continue };
                    // Entries of the padding columns are not added anywhere: zero them so that
                    // the whole run adds in one pass.
                    run.zero_wrapped(row);
                    let at = (ylo + ki * g.dil - g.pad) * g.w + run.first_x;
                    let dst = &mut plane[at..at + run.end - run.start];
                    for (d, &v) in dst.iter_mut().zip(&row[run.start..run.end]) {
                        *d += v;
                    }
                }
            }
            continue;
        }
        for ki in 0..g.kh {
            let (ylo, yhi) = band(g.valid(ki * g.dil, g.h, g.oh), r0, r1);
            for kj in 0..g.kw {
                let row = ((ci * g.kh + ki) * g.kw + kj) * ld;
                let row = &col[row..row + cols];
                let (xlo, xhi) = g.valid(kj * g.dil, g.w, g.ow);
                if xlo == xhi {
                    continue;
                }
                for oy in ylo..yhi {
                    let iy = oy * s + ki * g.dil - g.pad;
                    let ix0 = xlo * s + kj * g.dil - g.pad;
                    let src = &row[(oy - r0) * g.ow + xlo..(oy - r0) * g.ow + xhi];
                    let dst = &mut plane[iy * g.w..(iy + 1) * g.w];
                    if s == 1 {
                        for (d, &v) in dst[ix0..ix0 + src.len()].iter_mut().zip(src) {
                            *d += v;
                        }
                    } else {
                        for (j, &v) in src.iter().enumerate() {
                            dst[ix0 + j * s] += v;
                        }
                    }
                }
            }
        }
    }
}
