//! The face head's tests set up alike: a head configuration, one rank's head with its
//! centres, that rank's part of a global batch, and a gradient that may be absent.

use allgrad_models::face::{CentreUpdate, FaceHead, HeadConfig, MarginConfig, RowRange};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Var};
use candle_nn::{VarBuilder, VarMap};

/// A head over `classes` classes with `margin`, Partial FC at `rate` and the centres'
/// gradient `update`, the other keys at their defaults.
pub fn config(classes: usize, margin: MarginConfig, rate: f64, update: CentreUpdate) -> HeadConfig {
    HeadConfig { margin, sample_rate: rate, update, ..HeadConfig::with_classes(classes) }
}

/// The head of `rank` of `world` for `dim`-wide embeddings, built in f64 on a fresh VarMap
/// under `head`, and its centres (`[c_r, dim]`, the map's one variable).
pub fn head(cfg: &HeadConfig, dim: usize, seed: u64, rank: usize, world: usize) -> Result<(FaceHead, Var)> {
    let map = VarMap::new();
    let mut head = FaceHead::new(cfg.clone(), dim, seed, rank, world)?;
    head.build(VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu).pp("head"))?;
    let centres = map.all_vars().remove(0);
    Ok((head, centres))
}

/// Rows `rows` of a global batch stored row-major, `width` values a row.
pub fn rows_of<T: Clone>(all: &[T], rows: RowRange, width: usize) -> Vec<T> {
    all[rows.start * width..rows.end() * width].to_vec()
}

/// This rank's part (`rows`) of the global batch's embeddings (`[B, dim]` row-major), as a
/// variable `[rows.len, dim]`, and of its labels.
pub fn rank_batch(emb: &[f64], labels: &[usize], dim: usize, rows: RowRange) -> Result<(Var, Vec<usize>)> {
    let x = Var::from_vec(rows_of(emb, rows, dim), (rows.len, dim), &Device::Cpu)?;
    Ok((x, rows_of(labels, rows, 1)))
}

/// The gradient of `var` in `grads` as f64 values, zeros where the backward formed none.
pub fn grad_or_zeros(grads: &GradStore, var: &Var) -> Result<Vec<f64>> {
    match grads.get(var) {
        Some(t) => t.flatten_all()?.to_vec1::<f64>(),
        None => Ok(vec![0.0; var.elem_count()]),
    }
}
