//! The per-op-kind breakdown on allgrad's side: every op of the step's BERT encoder (and the
//! head and loss) at its shape in the step, timed alone, as the step runs it. `layer_times`
//! mirrors `layer_times` in `scripts/bench/bench_simcse_step.py`, which times PyTorch's (transformers')
//! ops at the same shapes.
//!
//! Shapes: `2B` sequences of `max_len` tokens (the step pads to the batch's longest sequence,
//! at most `max_len`, so this is an upper bound), the model's hidden size, heads, intermediate
//! size and layer count. Kinds:
//!
//! - `linear`: the dense layers, as allgrad runs them: per encoder layer the stacked q/k/v
//!   projection (`h → 3h`), the attention output (`h → h`), the intermediate (`h → i`) and the
//!   output (`i → h`); and the head (`h → h`) on the pooled `[2B, h]`. (transformers runs q, k
//!   and v as three layers: its count is two higher per encoder layer.)
//! - `attention`: scores, key mask, softmax, dropout (p 0.1) and context over the packed
//!   projections (`allgrad_nn::attention`; PyTorch: `scaled_dot_product_attention`).
//! - `layer_norm`: two per encoder layer and the embeddings'.
//! - `gelu`: the intermediate activation (exact, erf form).
//! - `softmax`: a softmax over the attention scores' shape alone (`[2B, heads, len, len]`), for
//!   comparison: both steps compute it inside their attention.
//! - `dropout`: `dropout(x) + residual` after the attention output and the output layer, and the
//!   embeddings' dropout (no residual).
//! - `loss`: InfoNCE at temperature 0.05 on `[2B, h]` embeddings.
//!
//! As in the SimCLR benchmark, Candle cannot start a backward from a given output gradient: the
//! backward of `y = f(x)` is timed as that of `sum(y * g)` minus the same with `f` the identity.

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::bert::BertConfig;
use allgrad::models::simcse::info_nce;
use candle_core::{DType, Device, Tensor, Var};

/// The op kinds in table order.
pub const KINDS: [&str; 7] = ["linear", "attention", "layer_norm", "gelu", "softmax", "dropout", "loss"];

/// The dimensions the breakdown needs from the model's config.
#[derive(Clone, Copy)]
pub struct Shapes {
    /// Sequences (two views of each sentence).
    pub n: usize,
    pub len: usize,
    pub hidden: usize,
    pub heads: usize,
    pub inter: usize,
    pub layers: usize,
}

impl Shapes {
    pub fn new(cfg: &BertConfig, batch: usize, max_len: usize) -> Self {
        Shapes {
            n: 2 * batch,
            len: max_len,
            hidden: cfg.hidden_size,
            heads: cfg.num_attention_heads,
            inter: cfg.intermediate_size,
            layers: cfg.num_hidden_layers,
        }
    }
}

fn randn(dims: &[usize]) -> candle_core::Result<Var> {
    Var::from_tensor(&Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?)
}

/// A scaled keep mask of dropout at p = 0.1 (`0` or `1/0.9`).
fn keep_mask(dims: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::rand(0f32, 1.0, dims, &Device::Cpu)?.ge(0.1)?.to_dtype(DType::F32)?.affine(1.0 / 0.9, 0.0)
}

type Forward<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;

/// The forwards of one kind, with their inputs built (untimed).
fn instances<'a>(kind: &str, s: Shapes, pg: &'a ProcessGroup) -> candle_core::Result<Vec<Forward<'a>>> {
    let Shapes { n, len, hidden: h, heads, inter, layers } = s;
    let rows = n * len;
    let mut out: Vec<Forward<'a>> = Vec::new();
    match kind {
        "linear" => {
            let mut dense = |r: usize, i: usize, o: usize| -> candle_core::Result<()> {
                let (x, w, b) = (randn(&[r, i])?, randn(&[o, i])?, randn(&[o])?);
                out.push(Box::new(move || allgrad_nn::linear(&x, &w, Some(&b))));
                Ok(())
            };
            for _ in 0..layers {
                for (i, o) in [(h, 3 * h), (h, h), (h, inter), (inter, h)] {
                    dense(rows, i, o)?;
                }
            }
            dense(n, h, h)?;
        }
        "attention" => {
            for _ in 0..layers {
                let qkv = randn(&[n, len, 3 * h])?;
                let bias = Tensor::zeros((n, len), DType::F32, &Device::Cpu)?;
                let mask = keep_mask(&[n, heads, len, len])?;
                out.push(Box::new(move || allgrad_nn::attention(&qkv, &bias, heads, Some(&mask))));
            }
        }
        "layer_norm" => {
            for _ in 0..2 * layers + 1 {
                let (x, g, b) = (randn(&[n, len, h])?, randn(&[h])?, randn(&[h])?);
                out.push(Box::new(move || allgrad_nn::layer_norm(&x, &g, &b, 1e-12)));
            }
        }
        "gelu" => {
            for _ in 0..layers {
                let x = randn(&[n, len, inter])?;
                out.push(Box::new(move || allgrad_nn::gelu_erf(&x)));
            }
        }
        "softmax" => {
            for _ in 0..layers {
                let x = randn(&[n, heads, len, len])?;
                out.push(Box::new(move || allgrad_nn::softmax_last_dim(&x)));
            }
        }
        "dropout" => {
            for i in 0..2 * layers + 1 {
                let (x, res, mask) = (randn(&[n, len, h])?, randn(&[n, len, h])?, keep_mask(&[n, len, h])?);
                let residual = i > 0;
                out.push(Box::new(move || allgrad_nn::dropout_mask(&x, &mask, residual.then_some(res.as_tensor()))));
            }
        }
        "loss" => {
            let z = randn(&[n, h])?;
            out.push(Box::new(move || info_nce(&z.narrow(0, 0, n / 2)?, &z.narrow(0, n / 2, n / 2)?, 0.05, pg)));
        }
        other => candle_core::bail!("no op kind {other}"),
    }
    Ok(out)
}

/// Seconds of `f`.
fn timed<T>(f: impl FnOnce() -> candle_core::Result<T>) -> candle_core::Result<(T, f64)> {
    let t = Instant::now();
    let out = f()?;
    Ok((out, t.elapsed().as_secs_f64()))
}

/// (kind, count, forward s, backward s) per kind of `kinds`, each op timed alone.
pub fn layer_times(s: Shapes, kinds: &[&str]) -> candle_core::Result<Vec<(String, usize, f64, f64)>> {
    let pg = ProcessGroup::single();
    let mut table = Vec::new();
    for &kind in kinds {
        let (mut count, mut fwd, mut bwd) = (0, 0.0, 0.0);
        for forward in instances(kind, s, &pg)? {
            let (y, t_fwd) = timed(&*forward)?;
            let g = Tensor::randn(0f32, 1.0, y.dims(), &Device::Cpu)?;
            let objective = (&y * &g)?.sum_all()?;
            let (_, t_with) = timed(|| objective.backward())?;
            let identity = Var::zeros(y.dims(), DType::F32, &Device::Cpu)?;
            let objective = (identity.as_tensor() * &g)?.sum_all()?;
            let (_, t_without) = timed(|| objective.backward())?;
            count += 1;
            fwd += t_fwd;
            bwd += t_with - t_without;
        }
        table.push((kind.to_string(), count, fwd, bwd));
    }
    Ok(table)
}
