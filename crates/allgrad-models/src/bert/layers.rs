//! The two parameterised building blocks of BERT: a dense layer over the last dimension and a
//! LayerNorm with backward (allgrad-nn's kernels; Candle's fused LayerNorm has none).

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
        Self::with_init(vb, inp, out, Init::Randn { mean: 0.0, stdev: std }, Init::Const(0.0))
    }

    /// [`Dense::new`] with the fresh weights drawn from `weight` and the biases from `bias`.
    pub fn with_init(vb: VarBuilder, inp: usize, out: usize, weight: Init, bias: Init) -> Result<Self> {
        let weight = vb.get_with_hints((out, inp), "weight", weight)?;
        let bias = vb.get_with_hints(out, "bias", bias)?;
        Ok(Dense { weight, bias })
    }

    /// Applies the layer (allgrad-nn's fused `linear`: one GEMM, one-op backward).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        allgrad_nn::linear(x, &self.weight, Some(&self.bias))
    }

    /// The layers side by side as one: weights stacked along the outputs, biases concatenated
    /// (differentiable, so each part's gradient reaches its own parameters). Its output is the
    /// parts' outputs concatenated along the last dimension, from one GEMM.
    pub fn stacked(parts: &[&Dense]) -> Result<Dense> {
        let weights: Vec<&Tensor> = parts.iter().map(|p| &p.weight).collect();
        let biases: Vec<&Tensor> = parts.iter().map(|p| &p.bias).collect();
        Ok(Dense { weight: Tensor::cat(&weights, 0)?, bias: Tensor::cat(&biases, 0)? })
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
