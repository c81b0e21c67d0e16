//! The custom op: the tiled forward runs before it is applied (its value and each row's
//! log-sum-exp are stored in the op), the op's forward hands the value to Candle's graph with
//! the queries, keys and parameters as its inputs, and its backward recomputes the blocks.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, DType, Device, Layout, MetalStorage, Result, Shape, Storage, Tensor, Var, D,
};

use super::cpu::{self, Elem, Problem};
use super::pairs::{blocks, Pairs};
use super::TileScores;
use crate::error::fail;
use crate::ModelError;

/// How the logits of a block are computed.
#[derive(Clone)]
pub(super) enum Kernel {
    /// `q·k / τ` by the fused CPU kernel (f32, f64; `params` is τ).
    FusedDot,
    /// The scores function on tensor blocks (any device and dtype).
    Blocks(Arc<dyn TileScores>),
}

/// `Σ_i (lse_i − s_{i, target_i})` over the query rows against the keys and then the `extra`
/// keys (no gradient), computed in `tile x tile` blocks.
pub(super) fn apply(
    queries: &Tensor,
    keys: &Tensor,
    extra: Option<&Tensor>,
    params: &Tensor,
    pairs: Pairs,
    kernel: Kernel,
    tile: usize,
) -> Result<Tensor> {
    // A run's `loss.tile` was checked with its loss config ([`super::Tiling`]); this guards the
    // public functions' own `tile` argument, for callers of the library.
    if tile == 0 {
        return fail(ModelError::TiledInput("the tile must be at least 1".into()));
    }
    let named = [("queries", Some(queries)), ("keys", Some(keys)), ("extra keys", extra)];
    for (name, t) in named.iter().filter_map(|(n, t)| t.map(|t| (n, t))) {
        if t.rank() != 2 {
            return fail(ModelError::TiledInput(format!("{name} must be [rows, dim], got {:?}", t.dims())));
        }
        if t.dtype() != queries.dtype() || t.device().location() != queries.device().location() {
            return fail(ModelError::TiledInput(format!(
                "queries ({:?} on {:?}) and {name} ({:?} on {:?}) must share dtype and device",
                queries.dtype(),
                queries.device().location(),
                t.dtype(),
                t.device().location()
            )));
        }
    }
    if let Some(e) = extra {
        if e.dim(1)? != keys.dim(1)? {
            return fail(ModelError::TiledInput(format!("keys {:?} and extra keys {:?} differ in width", keys.dims(), e.dims())));
        }
    }
    let extra = extra.map(|e| e.detach());
    let (m, n) = (queries.dim(0)?, keys.dim(0)? + extra.as_ref().map_or(Ok(0), |e| e.dim(0))?);
    pairs.check(m, n)?;
    let (q, p) = (queries.detach().contiguous()?, params.detach());
    let k = all_keys(keys, extra.as_ref())?;
    let n_grad = keys.dim(0)?;
    let (value, lse) = match &kernel {
        Kernel::FusedDot => {
            crate::trace::count(|c| c.fused_forward += 1);
            fused_forward(&q, &k, &p, &pairs, tile)?
        }
        Kernel::Blocks(scores) => {
            crate::trace::count(|c| c.blocks_forward += 1);
            blocks_forward(&q, &k, &p, &pairs, scores.as_ref(), tile)?
        }
    };
    let value = Tensor::new(value, queries.device())?.to_dtype(queries.dtype())?;
    let op = TiledCrossEntropy { kernel, pairs: Arc::new(pairs), tile, value, lse, extra, n_grad };
    queries.apply_op3(keys, params, op)
}

/// The keys, then the extra keys, detached and contiguous.
fn all_keys(keys: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
    match extra {
        Some(e) => Tensor::cat(&[&keys.detach(), e], 0)?.contiguous(),
        None => keys.detach().contiguous(),
    }
}

/// The op; see the module docs.
struct TiledCrossEntropy {
    kernel: Kernel,
    pairs: Arc<Pairs>,
    tile: usize,
    /// The loss, a one-element tensor of its own on the inputs' device and dtype.
    value: Tensor,
    /// Each query row's log-sum-exp `[m]`, from the forward.
    lse: Tensor,
    /// Keys after the op's own (a queue of past batches), without a gradient.
    extra: Option<Tensor>,
    /// The op's own keys: the leading columns, the only ones with a gradient.
    n_grad: usize,
}

impl TiledCrossEntropy {
    /// The stored value's storage, for the forward of each device.
    fn value_storage(&self) -> Result<Storage> {
        let (storage, layout) = self.value.storage_and_layout();
        storage.try_clone(layout)
    }
}

impl CustomOp3 for TiledCrossEntropy {
    fn name(&self) -> &'static str {
        "tiled_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.value_storage()? {
            Storage::Cpu(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("tiled_cross_entropy: the loss was computed on another device than its inputs"),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match self.value_storage()? {
            Storage::Cuda(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("tiled_cross_entropy: the loss was computed on another device than its inputs"),
        }
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        match self.value_storage()? {
            Storage::Metal(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("tiled_cross_entropy: the loss was computed on another device than its inputs"),
        }
    }

    fn bwd(
        &self,
        queries: &Tensor,
        keys: &Tensor,
        params: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let need = [queries.track_op(), keys.track_op(), params.track_op()];
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let (q, p) = (queries.detach().contiguous()?, params.detach());
        let k = all_keys(keys, self.extra.as_ref())?;
        let n_grad = self.n_grad;
        let [dq, dk, dp] = match &self.kernel {
            Kernel::FusedDot => {
                crate::trace::count(|c| c.fused_backward += 1);
                fused_backward(&q, &k, n_grad, &p, &self.pairs, self.tile, &self.lse, g, need)?
            }
            Kernel::Blocks(scores) => {
                crate::trace::count(|c| c.blocks_backward += 1);
                blocks_backward(&q, &k, n_grad, &p, &self.pairs, scores.as_ref(), self.tile, &self.lse, g, need)?
            }
        };
        Ok((dq, dk, dp))
    }
}

/// The temperature held by `params` of the fused kernel, checked.
fn temperature(params: &Tensor) -> Result<f64> {
    if params.elem_count() != 1 {
        return fail(ModelError::TiledInput(format!("the temperature must be one number, got shape {:?}", params.dims())));
    }
    let t = params.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?[0];
    if !(t > 0.0 && t.is_finite()) {
        return fail(ModelError::LossValue { key: "temperature", expected: "positive", value: t });
    }
    Ok(t)
}

/// The contiguous elements of a CPU tensor.
fn cpu_slice<T: Elem>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

fn fused_forward(q: &Tensor, k: &Tensor, p: &Tensor, pairs: &Pairs, tile: usize) -> Result<(f64, Tensor)> {
    let t = temperature(p)?;
    fn run<T: Elem>(q: &Tensor, k: &Tensor, t: f64, pairs: &Pairs, tile: usize) -> Result<(f64, Tensor)> {
        let (qs, ks) = (cpu_slice::<T>(q)?, cpu_slice::<T>(k)?);
        let prob = problem(&qs, &ks, q, k, t, pairs, tile)?;
        let (lse, value) = cpu::forward(&prob)?;
        Ok((value, Tensor::from_vec(lse, prob.m, &Device::Cpu)?))
    }
    match q.dtype() {
        DType::F32 => run::<f32>(q, k, t, pairs, tile),
        DType::F64 => run::<f64>(q, k, t, pairs, tile),
        other => candle_core::bail!("tiled_cross_entropy: the fused CPU kernel takes f32 or f64, got {other:?}"),
    }
}

fn problem<'a, T: Elem>(
    qs: &'a [T],
    ks: &'a [T],
    q: &Tensor,
    k: &Tensor,
    t: f64,
    pairs: &'a Pairs,
    tile: usize,
) -> Result<Problem<'a, T>> {
    let (m, d) = q.dims2()?;
    let (n, dk) = k.dims2()?;
    if d != dk {
        return fail(ModelError::TiledInput(format!("queries [{m}, {d}] and keys [{n}, {dk}] differ in width")));
    }
    Ok(Problem { q: qs, k: ks, m, n, n_grad: n, d, inv_t: T::from_f64(1.0 / t), pairs, tile })
}

#[allow(clippy::too_many_arguments)]
fn fused_backward(
    q: &Tensor,
    k: &Tensor,
    n_grad: usize,
    p: &Tensor,
    pairs: &Pairs,
    tile: usize,
    lse: &Tensor,
    g: f64,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    let t = temperature(p)?;
    #[allow(clippy::too_many_arguments)]
    fn run<T: Elem>(
        q: &Tensor,
        k: &Tensor,
        n_grad: usize,
        p: &Tensor,
        t: f64,
        pairs: &Pairs,
        tile: usize,
        lse: &Tensor,
        g: f64,
        need: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let (qs, ks, ls) = (cpu_slice::<T>(q)?, cpu_slice::<T>(k)?, cpu_slice::<T>(lse)?);
        let prob = Problem { n_grad, ..problem(&qs, &ks, q, k, t, pairs, tile)? };
        let grads = cpu::backward(&prob, &ls, T::from_f64(g), need)?;
        let dq = grads.dq.map(|v| Tensor::from_vec(v, (prob.m, prob.d), &Device::Cpu)).transpose()?;
        let dk = grads.dk.map(|v| Tensor::from_vec(v, (n_grad, prob.d), &Device::Cpu)).transpose()?;
        // s = raw / τ (+ boost): ∂s/∂τ = −(s − boost) / τ.
        let dp = if need[2] {
            Some(Tensor::new(-grads.ds_dot_s / t, &Device::Cpu)?.to_dtype(p.dtype())?.reshape(p.shape())?)
        } else {
            None
        };
        Ok([dq, dk, dp])
    }
    match q.dtype() {
        DType::F32 => run::<f32>(q, k, n_grad, p, t, pairs, tile, lse, g, need),
        DType::F64 => run::<f64>(q, k, n_grad, p, t, pairs, tile, lse, g, need),
        other => candle_core::bail!("tiled_cross_entropy: the fused CPU kernel takes f32 or f64, got {other:?}"),
    }
}

/// The lowest finite value of a float dtype, as f64 (exactly representable in it).
fn lowest(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::MIN,
        DType::F32 => f32::MIN as f64,
        DType::BF16 => -3.389_531_389_251_535_5e38, // bf16::MIN
        DType::F16 => -65_504.0,                    // f16::MIN
        _ => f32::MIN as f64,
    }
}

/// A block's scores from the user's function, checked for shape.
fn block_scores(scores: &dyn TileScores, q: &Tensor, k: &Tensor, p: &Tensor) -> Result<Tensor> {
    let s = scores.scores(q, k, p)?;
    let want = [q.dim(0)?, k.dim(0)?];
    if s.dims() != want {
        return fail(ModelError::TiledInput(format!(
            "the scores function returned shape {:?} for {} queries and {} keys; expected {want:?}",
            s.dims(),
            want[0],
            want[1]
        )));
    }
    if s.dtype() != q.dtype() {
        return fail(ModelError::TiledInput(format!("the scores function returned {:?} for {:?} inputs", s.dtype(), q.dtype())));
    }
    Ok(s)
}

/// For each row of the block, `(column offset or 0, value or 0)` of one kind of special
/// column, as `[tq, 1]` tensors; `None` when no row of the block has one.
fn per_row(
    rows: &Range<usize>,
    dtype: DType,
    device: &Device,
    pick: impl Fn(usize) -> Option<(usize, f64)>,
) -> Result<Option<(Tensor, Tensor, Vec<bool>)>> {
    let found: Vec<Option<(usize, f64)>> = rows.clone().map(pick).collect();
    if found.iter().all(Option::is_none) {
        return Ok(None);
    }
    let idx: Vec<u32> = found.iter().map(|f| f.map_or(0, |(c, _)| c as u32)).collect();
    let val: Vec<f64> = found.iter().map(|f| f.map_or(0.0, |(_, v)| v)).collect();
    let mask: Vec<bool> = found.iter().map(Option::is_some).collect();
    let n = rows.len();
    Ok(Some((Tensor::from_vec(idx, (n, 1), device)?, Tensor::from_vec(val, (n, 1), device)?.to_dtype(dtype)?, mask)))
}

/// The block's logits with the special columns applied (excluded `-inf`, boosted `+ boost`).
fn with_specials(s: &Tensor, pairs: &Pairs, rows: &Range<usize>, cols: &Range<usize>) -> Result<Tensor> {
    let mut s = s.clone();
    let excl = per_row(rows, s.dtype(), s.device(), |r| pairs.exclude_in(r, cols).map(|c| (c, f64::NEG_INFINITY)))?;
    if let Some((idx, val, _)) = excl {
        s = s.scatter_add(&idx, &val, 1)?;
    }
    if let Some((idx, val, _)) = per_row(rows, s.dtype(), s.device(), |r| pairs.boost_in(r, cols))? {
        s = s.scatter_add(&idx, &val, 1)?;
    }
    Ok(s)
}

/// Each row's target logit where it lies in this block, 0 elsewhere (`[tq]`).
fn target_logits(s: &Tensor, pairs: &Pairs, rows: &Range<usize>, cols: &Range<usize>) -> Result<Option<Tensor>> {
    let Some((idx, _, mask)) = per_row(rows, s.dtype(), s.device(), |r| pairs.target_in(r, cols).map(|c| (c, 0.0)))? else {
        return Ok(None);
    };
    let mask = Tensor::from_vec(mask.iter().map(|&b| b as u8).collect::<Vec<_>>(), rows.len(), s.device())?;
    let picked = s.gather(&idx, 1)?.squeeze(1)?;
    Ok(Some(mask.where_cond(&picked, &picked.zeros_like()?)?))
}

fn blocks_forward(
    q: &Tensor,
    k: &Tensor,
    p: &Tensor,
    pairs: &Pairs,
    scores: &dyn TileScores,
    tile: usize,
) -> Result<(f64, Tensor)> {
    let (m, n) = (q.dim(0)?, k.dim(0)?);
    let (dtype, device) = (q.dtype(), q.device());
    let lowest = lowest(dtype);
    let mut total = 0f64;
    let mut lse_parts = Vec::new();
    for rows in blocks(m, tile) {
        let qi = q.narrow(0, rows.start, rows.len())?;
        let tq = rows.len();
        // Running reference (the largest logit so far, never below the dtype's lowest finite
        // value, so that `e^(s − shift)` of an excluded `-inf` is 0, never NaN) and the sum
        // of `e^(s − shift)`.
        let mut shift = Tensor::full(lowest, (tq, 1), device)?.to_dtype(dtype)?;
        let mut sum = Tensor::zeros((tq, 1), dtype, device)?;
        let mut pos = Tensor::zeros(tq, dtype, device)?;
        for cols in blocks(n, tile) {
            let kj = k.narrow(0, cols.start, cols.len())?;
            let raw = block_scores(scores, &qi, &kj, p)?;
            // The block's queries, keys and parameters come detached: logits that still carry
            // a graph depend on something else that needs a gradient (a `Var` the function
            // captured), which the backward could not reach.
            if raw.track_op() {
                return fail(ModelError::TiledInput(
                    "the scores function's logits depend on a tensor that needs a gradient other than its queries, keys \
                     and params (a captured Var?); it would get no gradient: pass it through params instead"
                        .into(),
                ));
            }
            let s = with_specials(&raw, pairs, &rows, &cols)?;
            if let Some(t) = target_logits(&s, pairs, &rows, &cols)? {
                pos = (pos + t)?;
            }
            let new_shift = shift.maximum(&s.max_keepdim(D::Minus1)?)?;
            let kept = (sum * (shift - &new_shift)?.exp()?)?;
            sum = (kept + s.broadcast_sub(&new_shift)?.exp()?.sum_keepdim(D::Minus1)?)?;
            shift = new_shift;
        }
        let lse = (shift + sum.log()?)?.squeeze(1)?;
        total += (&lse - pos)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        lse_parts.push(lse);
    }
    let lse = if lse_parts.is_empty() { Tensor::zeros(0, dtype, device)? } else { Tensor::cat(&lse_parts, 0)? };
    Ok((total, lse))
}

/// `acc + g`, where `acc` may not exist yet.
fn add(acc: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (a + g)?,
        None => g,
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn blocks_backward(
    q: &Tensor,
    k: &Tensor,
    n_grad: usize,
    p: &Tensor,
    pairs: &Pairs,
    scores: &dyn TileScores,
    tile: usize,
    lse: &Tensor,
    g: f64,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    let (m, n) = (q.dim(0)?, k.dim(0)?);
    let cols_all = blocks(n, tile);
    let mut dq_parts = Vec::new();
    let mut dk_blocks: Vec<Option<Tensor>> = vec![None; cols_all.len()];
    let mut dp: Option<Tensor> = None;
    for rows in blocks(m, tile) {
        let qi = q.narrow(0, rows.start, rows.len())?;
        let lse_i = lse.narrow(0, rows.start, rows.len())?.unsqueeze(1)?;
        let mut dqi: Option<Tensor> = None;
        for (j, cols) in cols_all.iter().enumerate() {
            let kj = k.narrow(0, cols.start, cols.len())?;
            // The block again: with a graph of its own unless the scores function gives its
            // gradients itself.
            let vars = if scores.has_backward() {
                None
            } else {
                Some((Var::from_tensor(&qi)?, Var::from_tensor(&kj)?, Var::from_tensor(p)?))
            };
            let raw = match &vars {
                Some((qv, kv, pv)) => block_scores(scores, qv.as_tensor(), kv.as_tensor(), pv.as_tensor())?,
                None => block_scores(scores, &qi, &kj, p)?,
            };
            let s = with_specials(&raw.detach(), pairs, &rows, cols)?;
            let mut ds = (s.broadcast_sub(&lse_i)?.exp()? * g)?;
            if let Some((idx, _, mask)) = per_row(&rows, ds.dtype(), ds.device(), |r| pairs.target_in(r, cols).map(|c| (c, 0.0)))?
            {
                let minus_g: Vec<f64> = mask.iter().map(|&b| if b { -g } else { 0.0 }).collect();
                let src = Tensor::from_vec(minus_g, (rows.len(), 1), ds.device())?.to_dtype(ds.dtype())?;
                ds = ds.scatter_add(&idx, &src, 1)?;
            }
            let [gq, gk, gp] = match &vars {
                None => scores.backward(&qi, &kj, p, &raw, &ds)?,
                Some((qv, kv, pv)) => {
                    let store = (raw * &ds)?.sum_all()?.backward()?;
                    let get = |v: &Var| store.get(v).cloned().map_or_else(|| v.as_tensor().zeros_like(), Ok);
                    [get(qv)?, get(kv)?, get(pv)?]
                }
            };
            if need[0] {
                add(&mut dqi, gq)?;
            }
            // Only the op's own keys (the leading `n_grad` columns) get a gradient.
            let own = cols.end.min(n_grad).saturating_sub(cols.start);
            if need[1] && own > 0 {
                add(&mut dk_blocks[j], gk.narrow(0, 0, own)?)?;
            }
            if need[2] {
                add(&mut dp, gp)?;
            }
        }
        if let Some(d) = dqi {
            dq_parts.push(d);
        }
    }
    let dq = if need[0] && !dq_parts.is_empty() { Some(Tensor::cat(&dq_parts, 0)?) } else { None };
    let dk_parts: Vec<Tensor> = dk_blocks.into_iter().flatten().collect();
    let dk = if need[1] && !dk_parts.is_empty() { Some(Tensor::cat(&dk_parts, 0)?) } else { None };
    // An empty side (no rows or no keys) gives zero gradients, never a missing one.
    let dq = match (need[0], dq) {
        (true, None) => Some(q.zeros_like()?),
        (_, d) => d,
    };
    let dk = match (need[1], dk) {
        (true, None) => Some(k.narrow(0, 0, n_grad)?.zeros_like()?),
        (_, d) => d,
    };
    let dp = match (need[2], dp) {
        (true, None) => Some(p.zeros_like()?),
        (_, d) => d,
    };
    Ok([dq, dk, dp])
}
