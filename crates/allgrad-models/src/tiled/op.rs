//! The custom op: the tiled forward runs before it is applied (its value and each row's
//! log-sum-exp are stored in the op), the op's forward hands the value to Candle's graph with
//! the queries, keys and parameters as its inputs, and its backward recomputes the blocks.
//!
//! The block path (every device, and the CPU on the device path) neither reads from the device
//! nor uploads in a step: the loss is summed in a tensor, the incoming gradient stays a tensor,
//! and each row's special columns are found by comparing its column number with the block's
//! column numbers on the device ([`DevicePairs`], uploaded once per distinct pairs and kept).

use std::cell::RefCell;
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
    let pairs = Arc::new(pairs);
    let (value, lse, on_device) = match &kernel {
        Kernel::FusedDot => {
            crate::trace::count(|c| c.fused_forward += 1);
            let (value, lse) = fused_forward(&q, &k, &p, &pairs, tile)?;
            (Tensor::new(value, queries.device())?.to_dtype(queries.dtype())?, lse, None)
        }
        Kernel::Blocks(scores) => {
            crate::trace::count(|c| c.blocks_forward += 1);
            let on_device = DevicePairs::of(&pairs, n, queries.device())?;
            let (value, lse) = blocks_forward(&q, &k, &p, &on_device, scores.as_ref(), tile)?;
            (value.to_dtype(queries.dtype())?, lse, Some(on_device))
        }
    };
    let op = TiledCrossEntropy { kernel, pairs, on_device, tile, value, lse, extra, n_grad };
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
    /// The block path's pairs on the device.
    on_device: Option<Arc<DevicePairs>>,
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
        let (q, p) = (queries.detach().contiguous()?, params.detach());
        let k = all_keys(keys, self.extra.as_ref())?;
        let n_grad = self.n_grad;
        let [dq, dk, dp] = match (&self.kernel, &self.on_device) {
            (Kernel::FusedDot, _) => {
                crate::trace::count(|c| c.fused_backward += 1);
                // The fused kernel runs on the host path only: its gradient is read there.
                let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                fused_backward(&q, &k, n_grad, &p, &self.pairs, self.tile, &self.lse, g, need)?
            }
            (Kernel::Blocks(scores), Some(pairs)) => {
                crate::trace::count(|c| c.blocks_backward += 1);
                let g = grad.to_dtype(q.dtype())?.reshape((1, 1))?;
                blocks_backward(&q, &k, n_grad, &p, pairs, scores.as_ref(), self.tile, &self.lse, &g, need)?
            }
            (Kernel::Blocks(_), None) => candle_core::bail!("tiled_cross_entropy: the block path lost its pairs"),
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

/// A [`Pairs`] on a device: per query row, the column of its target, of its excluded column
/// and of its boosted column (each list that the pairs have, `[m, 1]` u32), with the column
/// numbers `[1, n]`. A block's special entries are where the two are equal, found on the
/// device; so the block path uploads only when it meets pairs it has not seen on this thread
/// (a few are kept: the last ones of each shape, as a step's pairs repeat from step to step).
pub(super) struct DevicePairs {
    pairs: Arc<Pairs>,
    location: candle_core::DeviceLocation,
    target: Option<Tensor>,
    exclude: Option<Tensor>,
    boost: Option<(Tensor, f64)>,
    cols: Tensor,
}

/// How many [`DevicePairs`] a thread keeps.
const KEPT_PAIRS: usize = 8;

thread_local! {
    static KEPT: RefCell<Vec<Arc<DevicePairs>>> = const { RefCell::new(Vec::new()) };
}

impl DevicePairs {
    /// `pairs` (over `n` columns) on `device`: kept from an earlier call on this thread with
    /// equal pairs, or uploaded now.
    fn of(pairs: &Arc<Pairs>, n: usize, device: &Device) -> Result<Arc<DevicePairs>> {
        let location = device.location();
        let found = KEPT.with(|k| {
            k.borrow().iter().find(|d| d.location == location && d.cols.dim(1).ok() == Some(n) && *d.pairs == **pairs).cloned()
        });
        if let Some(d) = found {
            return Ok(d);
        }
        let column = |list: &[usize]| -> Result<Tensor> {
            let v: Vec<u32> = list.iter().map(|&c| c as u32).collect();
            Tensor::from_vec(v, (list.len(), 1), device)
        };
        if n >= u32::MAX as usize {
            return fail(ModelError::TiledInput(format!("{n} key columns do not fit the block path's u32 column numbers")));
        }
        let cols = allgrad_nn::transfer::numbers(n, device)?.reshape((1, n))?;
        let d = Arc::new(DevicePairs {
            pairs: pairs.clone(),
            location,
            target: pairs.target.as_deref().map(column).transpose()?,
            exclude: pairs.exclude.as_deref().map(column).transpose()?,
            boost: pairs.boost.as_ref().map(|(list, w)| Ok::<_, candle_core::Error>((column(list)?, *w))).transpose()?,
            cols,
        });
        KEPT.with(|k| {
            let mut k = k.borrow_mut();
            if k.len() == KEPT_PAIRS {
                k.remove(0);
            }
            k.push(d.clone());
        });
        Ok(d)
    }

    /// Where, in the block of `rows` and `cols`, a row's special column of `list` lies
    /// (`[tq, tk]` u8).
    fn hits(&self, list: &Tensor, rows: &Range<usize>, cols: &Range<usize>) -> Result<Tensor> {
        let r = list.narrow(0, rows.start, rows.len())?;
        let c = self.cols.narrow(1, cols.start, cols.len())?;
        r.broadcast_eq(&c)
    }
}

/// The block's logits with the special columns applied (excluded `-inf`, boosted `+ boost`).
fn with_specials(s: &Tensor, pairs: &DevicePairs, rows: &Range<usize>, cols: &Range<usize>) -> Result<Tensor> {
    let mut s = s.clone();
    if let Some(ex) = &pairs.exclude {
        let hit = pairs.hits(ex, rows, cols)?;
        // -inf made on the device (0 · 0 − ∞), not uploaded.
        let minus_inf = s.zeros_like()?.affine(0.0, f64::NEG_INFINITY)?;
        s = hit.where_cond(&minus_inf, &s)?;
    }
    if let Some((b, w)) = &pairs.boost {
        let hit = pairs.hits(b, rows, cols)?.to_dtype(s.dtype())?;
        s = (s + hit.affine(*w, 0.0)?)?;
    }
    Ok(s)
}

/// Each row's target logit where it lies in this block, 0 elsewhere (`[tq]`).
fn target_logits(s: &Tensor, pairs: &DevicePairs, rows: &Range<usize>, cols: &Range<usize>) -> Result<Option<Tensor>> {
    let Some(t) = &pairs.target else { return Ok(None) };
    let hit = pairs.hits(t, rows, cols)?;
    Ok(Some(hit.where_cond(s, &s.zeros_like()?)?.sum(1)?))
}

fn blocks_forward(
    q: &Tensor,
    k: &Tensor,
    p: &Tensor,
    pairs: &DevicePairs,
    scores: &dyn TileScores,
    tile: usize,
) -> Result<(Tensor, Tensor)> {
    let (m, n) = (q.dim(0)?, k.dim(0)?);
    let (dtype, device) = (q.dtype(), q.device());
    let lowest = lowest(dtype);
    // The loss, summed in f64 on the device.
    let mut total = Tensor::zeros((), DType::F64, device)?;
    let mut lse_parts = Vec::new();
    for rows in blocks(m, tile) {
        let qi = q.narrow(0, rows.start, rows.len())?;
        let tq = rows.len();
        // Running reference (the largest logit so far, never below the dtype's lowest finite
        // value, so that `e^(s − shift)` of an excluded `-inf` is 0, never NaN) and the sum
        // of `e^(s − shift)`.
        let mut shift = Tensor::zeros((tq, 1), dtype, device)?.affine(1.0, lowest)?;
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
        total = (total + (&lse - pos)?.to_dtype(DType::F64)?.sum_all()?)?;
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
    pairs: &DevicePairs,
    scores: &dyn TileScores,
    tile: usize,
    lse: &Tensor,
    g: &Tensor,
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
            let mut ds = s.broadcast_sub(&lse_i)?.exp()?.broadcast_mul(g)?;
            if let Some(t) = &pairs.target {
                // The positive's `− g`.
                let hit = pairs.hits(t, &rows, cols)?.to_dtype(ds.dtype())?;
                ds = (ds - hit.broadcast_mul(g)?)?;
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
