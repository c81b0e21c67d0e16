//! The shape every per-channel kernel reads, CPU and CUDA alike: `(n, c, inner)` of an
//! `[N, C, ...]` tensor, with the error that names the op and the shape.

use candle_core::{Result, Shape};

use crate::error::{fail, NnError};

/// `(n, c, inner)` of an `[N, C, ...]` shape.
pub(crate) fn geometry(dims: &[usize], what: &'static str) -> Result<(usize, usize, usize)> {
    if dims.len() < 2 {
        return fail(NnError::InputRank { op: what, expected: "an [N, C, ...] tensor", shape: Shape::from(dims) });
    }
    Ok((dims[0], dims[1], dims[2..].iter().product()))
}
