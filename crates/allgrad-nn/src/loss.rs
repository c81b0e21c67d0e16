//! Cross-entropy from logits, fused and numerically stable (log-sum-exp), with backward.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, float_kernel, zeros, Float};
use crate::error::{fail, NnError};
use crate::softmax::{max_and_sum_exp, rows_per_task};

/// Mean cross-entropy of `logits (n, classes)` against integer class `targets (n,)` (u8, u32
/// or i64): `mean_i [logsumexp(logits_i) - logits_i[targets_i]]`, computed with the max
/// subtracted, so it stays finite for logits of any magnitude.
///
/// On the CPU with f32/f64 the per-row losses and the backward
/// `∂logits_i = (softmax(logits_i) - onehot(targets_i)) · ∂loss_i` are fused kernels that never
/// materialise the log-probabilities; elsewhere this is [`crate::log_softmax_last_dim`] followed
/// by a gather. The targets get no gradient.
///
/// Gradient convention: this is the local mean over this rank's rows; see the trainer for how
/// per-rank losses are combined.
///
/// # Errors
/// When the shapes do not match, the targets are not an integer dtype, or a target is out of
/// `0..classes` (the message names the row and the value).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    per_row_cross_entropy(logits, targets)?.mean_all()
}

/// The per-row losses of [`cross_entropy`], shaped `(n,)` (no reduction).
///
/// # Errors
/// As [`cross_entropy`].
pub fn per_row_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, k) = match *logits.dims() {
        [n, k] => (n, k),
        _ => {
            return fail(NnError::InputRank {
                op: "cross_entropy",
                expected: "(batch, classes) logits",
                shape: logits.shape().clone(),
            })
        }
    };
    if targets.dims() != [n] {
        return fail(NnError::TargetsShape { rows: n, logits: logits.shape().clone(), targets: targets.shape().clone() });
    }
    if !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        return fail(NnError::TargetsDType { dtype: targets.dtype() });
    }
    if k == 0 && n > 0 {
        return fail(NnError::NoClasses { shape: logits.shape().clone() });
    }
    if cpu_float(logits) {
        return logits.apply_op2(targets, CrossEntropyOp);
    }
    // Elsewhere: check the targets on the host, then gather the log-probabilities.
    let t = targets.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    for (i, &c) in t.iter().enumerate() {
        check_target(i, c, k)?;
    }
    let logp = crate::log_softmax_last_dim(logits)?;
    let picked = logp.gather(&targets.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?.squeeze(1)?;
    picked.neg()
}

fn check_target(row: usize, c: i64, classes: usize) -> Result<usize> {
    if c < 0 || c as u64 >= classes as u64 {
        return fail(NnError::TargetOutOfRange { row, target: c, classes });
    }
    Ok(c as usize)
}

/// Targets as class indices, validated against `classes`.
fn targets_of(s: &CpuStorage, l: &Layout, classes: usize) -> Result<Vec<usize>> {
    let raw: Vec<i64> = match s {
        CpuStorage::U8(t) => contiguous(t, l).iter().map(|&v| v as i64).collect(),
        CpuStorage::U32(t) => contiguous(t, l).iter().map(|&v| v as i64).collect(),
        CpuStorage::I64(t) => contiguous(t, l).into_owned(),
        _ => return fail(NnError::TargetsDType { dtype: s.dtype() }),
    };
    raw.iter().enumerate().map(|(i, &c)| check_target(i, c, classes)).collect()
}

struct CrossEntropyOp;

/// The backward kernel: inputs `(logits, targets, grad (n,))`, output ∂logits.
struct CrossEntropyBackward;

impl CustomOp2 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "allgrad-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = (l1.dims()[0], l1.dims()[1]);
        let t = targets_of(s2, l2, k)?;
        let out = float_kernel!("cross_entropy", s1 => x; ce_fwd(&contiguous(x, l1), &t, k));
        Ok((out, Shape::from(n)))
    }

    fn bwd(&self, logits: &Tensor, targets: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = logits.detach().apply_op3_no_bwd(targets, &grad.detach(), &CrossEntropyBackward)?;
        Ok((Some(d), None))
    }
}

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "allgrad-cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let k = l1.dims()[1];
        let t = targets_of(s2, l2, k)?;
        let out =
            float_kernel!("cross_entropy backward", s1 => x, s3 => g; ce_bwd(&contiguous(x, l1), &t, &contiguous(g, l3), k));
        Ok((out, l1.shape().clone()))
    }
}

fn ce_fwd<T: Float>(x: &[T], t: &[usize], k: usize) -> Vec<T> {
    let mut loss = vec![T::from_f64(0.0); t.len()];
    if k == 0 {
        return loss;
    }
    let rows = rows_per_task(k);
    loss.par_chunks_mut(rows).zip(x.par_chunks(rows * k)).zip(t.par_chunks(rows)).for_each(|((ls, xs), ts)| {
        for ((l, xr), &c) in ls.iter_mut().zip(xs.chunks(k)).zip(ts) {
            let (m, sum) = max_and_sum_exp(xr);
            *l = sum.ln() - (xr[c] - m);
        }
    });
    loss
}

fn ce_bwd<T: Float>(x: &[T], t: &[usize], g: &[T], k: usize) -> Vec<T> {
    let mut dx = zeros(x.len());
    if k == 0 || x.is_empty() {
        return dx;
    }
    let rows = rows_per_task(k);
    dx.par_chunks_mut(rows * k).zip(x.par_chunks(rows * k)).zip(t.par_chunks(rows).zip(g.par_chunks(rows))).for_each(
        |((ds, xs), (ts, gs))| {
            for (((dr, xr), &c), &gv) in ds.chunks_mut(k).zip(xs.chunks(k)).zip(ts).zip(gs) {
                let (m, sum) = max_and_sum_exp(xr);
                let scale = gv / sum;
                for (o, &v) in dr.iter_mut().zip(xr) {
                    *o = (v - m).exp() * scale;
                }
                dr[c] -= gv;
            }
        },
    );
    dx
}
