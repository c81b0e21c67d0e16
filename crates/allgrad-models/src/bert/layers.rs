//! The two parameterised building blocks of BERT: a dense layer over the last dimension and a
//! LayerNorm with backward (allgrad-nn's kernel; Candle's fused one has none).

use candle_core::{Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// `y = x W^T + b` over the last dimension of `x` (any leading dimensions, one GEMM).
/// Parameters `weight` `[out, in]` and `bias` `[out]`, as in PyTorch.
#[derive(Clone, Debug)]
pub struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    /// Creates (or loads) `weight` and `bias` under `vb`; fresh weights are normal with
    /// standard deviation `std`, fresh biases zero (BERT's initialisation).
    pub fn new(vb: VarBuilder, inp: usize, out: usize, std: f64) -> Result<Self> {
        let weight = vb.get_with_hints((out, inp), "weight", Init::Randn { mean: 0.0, stdev: std })?;
        let bias = vb.get_with_hints(out, "bias", Init::Const(0.0))?;
        Ok(Dense { weight, bias })
    }

    /// Applies the layer.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let (inp, rest) = match dims.split_last() {
            Some((d, rest)) => (*d, rest.to_vec()),
            None => candle_core::bail!("dense: input must have at least one dimension"),
        };
        let rows: usize = rest.iter().product();
        let y = x.reshape((rows, inp))?.matmul(&self.weight.t()?)?.broadcast_add(&self.bias)?;
        let mut out = rest;
        out.push(self.weight.dim(0)?);
        y.reshape(out)
    }
}

/// LayerNorm over the last dimension with parameters `weight` (gamma) and `bias` (beta).
#[derive(Clone, Debug)]
pub struct Norm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl Norm {
    /// Creates (or loads) `weight` (fresh: ones) and `bias` (fresh: zeros) under `vb`.
    pub fn new(vb: VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.0))?;
        let bias = vb.get_with_hints(dim, "bias", Init::Const(0.0))?;
        Ok(Norm { weight, bias, eps })
    }

    /// Applies the normalisation (differentiable in the input and both parameters).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        allgrad_nn::layer_norm(&x.contiguous()?, &self.weight, &self.bias, self.eps)
    }
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2))` (BERT's `gelu`), composed from Candle's
/// `erf`, whose backward is exact. (Candle's fused `gelu_erf` has a backward with
/// `1/√(2π)` rounded to 6 digits: gradients off by about 1e-6 relative, which a finite-
/// difference check in f64 sees.)
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let half = x.affine(0.5, 0.0)?;
    half * x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()?.affine(1.0, 1.0)?
}
