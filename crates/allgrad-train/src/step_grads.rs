//! The gradients of one step, summed over its micro-batches: dense for most parameters,
//! row-sparse for those an objective reads row by row (Partial FC's sampled centres,
//! [`allgrad_models::Objective::sparse_rows`]): the rows used and their gradient, never a
//! tensor of the parameter's full size.

use allgrad_models::Objective;
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use crate::error::{TrainError, TrainResult};

/// Each parameter's gradient, and for a row-sparse one its rows (the gradient then holds
/// those rows only).
pub(crate) type Finished = (Vec<Tensor>, Vec<Option<Vec<u32>>>);

/// See the module docs.
pub(crate) struct StepGrads {
    /// Dense sums (None: no gradient yet).
    dense: Vec<Option<Tensor>>,
    /// Row-sparse sums: the rows (sorted, distinct) and their gradient.
    sparse: Vec<Option<(Vec<u32>, Tensor)>>,
}

impl StepGrads {
    /// No gradient yet for any of `n` parameters.
    pub(crate) fn new(n: usize) -> Self {
        StepGrads { dense: vec![None; n], sparse: vec![None; n] }
    }

    /// Adds what one backward (`store`) holds for `params`: a dense gradient, or, where the
    /// objective reports the parameter's rows as read through a leaf of their own, that leaf's
    /// gradient as the rows' gradient (only for sharded parameters).
    pub(crate) fn add(
        &mut self,
        params: &[(String, Var)],
        sharded: &[bool],
        objective: &dyn Objective,
        store: &GradStore,
    ) -> TrainResult<()> {
        for (i, (name, v)) in params.iter().enumerate() {
            if let Some(rows) = objective.sparse_rows(name) {
                if !sharded[i] {
                    return Err(TrainError::Setup(format!(
                        "the objective reads parameter {name} row by row (Objective::sparse_rows), but it is not \
                         sharded: only sharded parameters may have a row-sparse gradient"
                    )));
                }
                if self.dense[i].is_some() || store.get(v).is_some() {
                    return Err(TrainError::Setup(format!(
                        "the objective reports a row-sparse gradient for {name} but {name} also has a dense one"
                    )));
                }
                let values = match rows.leaf.as_ref().and_then(|l| store.get(l)) {
                    Some(t) => t.clone(),
                    None => {
                        let mut shape = v.dims().to_vec();
                        shape[0] = rows.rows.len();
                        Tensor::zeros(shape, v.dtype(), v.device())?
                    }
                };
                self.sparse[i] = Some(match self.sparse[i].take() {
                    None => (rows.rows, values),
                    Some(before) => add_rows(before, (rows.rows, values))?,
                });
            } else if let Some(g) = store.get(v) {
                if self.sparse[i].is_some() {
                    return Err(TrainError::Setup(format!(
                        "the objective reports a row-sparse gradient for {name} at one micro-batch and a dense one at another"
                    )));
                }
                let before = match self.dense[i].take() {
                    Some(t) => t,
                    None => v.as_tensor().zeros_like()?,
                };
                self.dense[i] = Some((before + g)?);
            }
        }
        Ok(())
    }

    /// The dense sums so far, zeros where there is none, taken out (for gradient caching,
    /// which adds into them; [`StepGrads::put_dense`] puts them back).
    pub(crate) fn take_dense(&mut self, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
        params
            .iter()
            .zip(self.dense.iter_mut())
            .map(|((_, v), d)| d.take().map_or_else(|| v.as_tensor().zeros_like(), Ok))
            .collect()
    }

    /// Puts back what [`StepGrads::take_dense`] took.
    pub(crate) fn put_dense(&mut self, grads: Vec<Tensor>) {
        self.dense = grads.into_iter().map(Some).collect();
    }

    /// Each parameter's gradient (zeros where it got none) and, for a row-sparse one, its
    /// rows: the gradient then holds those rows only.
    pub(crate) fn finish(self, params: &[(String, Var)]) -> Result<Finished> {
        let mut grads = Vec::with_capacity(params.len());
        let mut rows = Vec::with_capacity(params.len());
        for (((_, v), dense), sparse) in params.iter().zip(self.dense).zip(self.sparse) {
            let (g, r) = match (sparse, dense) {
                (Some((ids, values)), _) => (values, Some(ids)),
                (None, Some(t)) => (t, None),
                (None, None) => (v.as_tensor().zeros_like()?, None),
            };
            grads.push(g);
            rows.push(r);
        }
        Ok((grads, rows))
    }
}

/// The sum of two row-sparse gradients of one parameter: the union of their rows (sorted),
/// each row's gradient added from both (zero where one lacks it).
fn add_rows(a: (Vec<u32>, Tensor), b: (Vec<u32>, Tensor)) -> Result<(Vec<u32>, Tensor)> {
    let mut ids: Vec<u32> = a.0.iter().chain(&b.0).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    let dev = a.1.device().clone();
    let position = |rows: &[u32]| -> Result<Tensor> {
        let pos: Vec<u32> = rows.iter().map(|r| ids.binary_search(r).unwrap_or(0) as u32).collect();
        Tensor::new(pos.as_slice(), &dev)
    };
    let mut shape = a.1.dims().to_vec();
    shape[0] = ids.len();
    let sum = Tensor::zeros(shape, a.1.dtype(), &dev)?;
    let sum = if a.0.is_empty() { sum } else { sum.index_add(&position(&a.0)?, &a.1, 0)? };
    let sum = if b.0.is_empty() { sum } else { sum.index_add(&position(&b.0)?, &b.1, 0)? };
    Ok((ids, sum))
}
