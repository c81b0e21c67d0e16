//! The column kernels behind [`crate::conv2d`]: `im2col` unfolds the receptive fields of one
//! image into a matrix so that a convolution becomes one GEMM, `col2im` folds such a matrix
//! back, summing overlaps (the adjoint of `im2col`, used for the input gradient).

use crate::cpu::{Float, Strides4};

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
    for ci in 0..g.cg() {
        let xc = base + (c0 + ci) * st.c;
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

/// The valid output rows `lo..hi` of a tap, cut to the band `r0..r1` (an empty range inside
/// the band when they miss it).
fn band((lo, hi): (usize, usize), r0: usize, r1: usize) -> (usize, usize) {
    let lo = lo.clamp(r0, r1);
    (lo, hi.clamp(lo, r1))
}

/// Adds the column matrix of the output rows `r0..r1` (`kdim x (r1 - r0)·ow`, row stride `ld`)
/// back into the contiguous `cg x h x w` block `dx` of one image: every column entry goes to
/// the input element it was read from.
pub(crate) fn col2im<T: Float>(col: &[T], g: &ConvGeom, (r0, r1): (usize, usize), dx: &mut [T], ld: usize) {
    let (cols, s) = ((r1 - r0) * g.ow, g.stride);
    for ci in 0..g.cg() {
        let plane = &mut dx[ci * g.h * g.w..(ci + 1) * g.h * g.w];
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
