//! The lazy update of row-sparse gradients (Partial FC's sampled class centres).
//!
//! A dense step of SGD (momentum, nesterov, weight decay) or AdamW moves every row of a
//! parameter, the rows whose gradient is zero too: weight decay shrinks them, momentum (Adam's
//! moments) carries them on. With a row-sparse gradient
//! ([`crate::optim::RowUpdate::Sparse`]) only the rows in the gradient are updated at their
//! step; every other row falls behind, and the optimizer keeps, per row, the number of updates
//! it has had. When a row is next in a gradient, or when the trainer flushes (before a
//! checkpoint, an evaluation, and at the end of `Trainer::train_until`), the updates it missed
//! are applied first: the dense step's formulas with a zero gradient, each with its own
//! learning rate and (AdamW) bias correction, element by element in the parameter's dtype, in
//! the order of operations of the fused dense kernel (`fused.rs`). A bf16 parameter
//! (bf16 face centres, with bf16 state and an f32 gradient) is updated in f32 and stored back
//! to bf16 after every update, missed ones included, as a dense step that loads, updates and
//! stores bf16 would ([`Stored`]).
//!
//! The result is the dense update bit for bit, for every learning-rate schedule, and it does
//! not depend on when a row is brought up to date: a checkpoint (written after a flush) holds
//! what a dense run would hold, so it resumes bitwise and re-shards like any other.
//!
//! Why the missed steps are replayed rather than applied in closed form: SGD's zero-gradient
//! step is linear in (value, momentum), a 2x2 matrix per step, so k missed steps are a product
//! of k matrices that could be applied in one pass over a row; but its rounding differs from
//! the dense steps' and depends on when the row is brought up to date, so a run that wrote a
//! checkpoint would differ from one that did not in the last bits. AdamW has no closed form at
//! all: a missed step's `m·β1^k / (sqrt(v·β2^k / bc2) + ε)` does not factor through ε. The
//! replay's cost: over a run, each row gets every update, as in the dense step, but an update
//! a row missed is a few vector operations on a row that sits in cache, where the dense step
//! streams every row of the parameter, its gradient and its state through memory every step.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Tensor, WithDType};
use half::bf16;
use rayon::prelude::*;

use crate::config::OptimConfig;

/// Rows per task are chosen so that a task's copy of the state rows stays about this size.
const BLOCK_BYTES: usize = 16 << 20;

/// The update rule of one step, as the fused kernel computes it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rule {
    Sgd { momentum: f64, nesterov: bool, weight_decay: f64 },
    Adamw { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

impl Rule {
    /// The rule of `cfg`; `None` for LARS, whose step depends on the norms of the whole
    /// parameter (every row's current value) and so cannot be deferred row by row.
    pub(crate) fn of(cfg: &OptimConfig) -> Option<Rule> {
        match *cfg {
            OptimConfig::Sgd { momentum, nesterov, weight_decay, .. } => Some(Rule::Sgd { momentum, nesterov, weight_decay }),
            OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => Some(Rule::Adamw { beta1, beta2, eps, weight_decay }),
            OptimConfig::Lars { .. } => None,
        }
    }

    /// Whether a step with a zero gradient leaves a row as it is (SGD without momentum and
    /// weight decay): then nothing needs to be deferred.
    pub(crate) fn zero_step_is_identity(&self) -> bool {
        matches!(*self, Rule::Sgd { momentum, weight_decay, .. } if momentum == 0.0 && weight_decay == 0.0)
    }

    /// State slots per element (as `optim::slot_names`).
    fn slots(&self) -> usize {
        match *self {
            Rule::Sgd { momentum, .. } => usize::from(momentum > 0.0),
            Rule::Adamw { .. } => 2,
        }
    }

    /// Update number `t` (from 1) of one row: value `w`, state slots `s0`, `s1` (empty when
    /// the rule keeps fewer), gradient `g` (`None`: zero), learning rate `lr`. The operations
    /// and their order are those of `fused.rs` (`Sgd` after `SgdMomentum`; `Adam` after
    /// the two `Moment`s), so the result is the fused dense step's, bit for bit.
    fn apply<T: WithDType>(&self, w: &mut [T], s0: &mut [T], s1: &mut [T], g: Option<&[T]>, lr: f64, t: u64) {
        match g {
            Some(g) => self.apply_with(w, s0, s1, |k| g[k], lr, t),
            None => {
                let zero = T::from_f64(0.0);
                self.apply_with(w, s0, s1, |_| zero, lr, t)
            }
        }
    }

    #[inline(always)]
    fn apply_with<T: WithDType>(&self, w: &mut [T], s0: &mut [T], s1: &mut [T], g: impl Fn(usize) -> T, lr: f64, t: u64) {
        let c = T::from_f64;
        match *self {
            Rule::Sgd { momentum, nesterov, weight_decay } => {
                let (mo, wd, lr) = (c(momentum), c(weight_decay), c(lr));
                let (with_momentum, decay) = (momentum > 0.0, weight_decay > 0.0);
                for k in 0..w.len() {
                    let g = g(k);
                    if with_momentum {
                        let d = if decay { g + w[k] * wd } else { g };
                        s0[k] = s0[k] * mo + d;
                    }
                    let d = if decay { g + w[k] * wd } else { g };
                    let d = match (with_momentum, nesterov) {
                        (false, _) => d,
                        (true, false) => s0[k],
                        (true, true) => d + s0[k] * mo,
                    };
                    w[k] -= d * lr;
                }
            }
            Rule::Adamw { beta1, beta2, eps, weight_decay } => {
                let (b1, one_b1, b2, one_b2) = (c(beta1), c(1.0 - beta1), c(beta2), c(1.0 - beta2));
                let t = t as i32;
                let (bc1, bc2) = (c(1.0 - beta1.powi(t)), c(1.0 - beta2.powi(t)));
                let (eps, wd, lr) = (c(eps), c(weight_decay), c(lr));
                for k in 0..w.len() {
                    let g = g(k);
                    s0[k] = s0[k] * b1 + g * one_b1;
                    s1[k] = s1[k] * b2 + g * g * one_b2;
                    let step = (s0[k] / bc1) / (T::from_f64((s1[k] / bc2).to_f64().sqrt()) + eps);
                    w[k] -= (step + w[k] * wd) * lr;
                }
            }
        }
    }
}

/// The learning rate of every update from `base + 1` on.
#[derive(Clone, Debug, Default)]
pub(crate) struct LrLog {
    base: u64,
    lrs: Vec<f64>,
}

impl LrLog {
    /// Forgets every rate: the next one recorded is that of update `done + 1`.
    pub(crate) fn reset(&mut self, done: u64) {
        self.base = done;
        self.lrs.clear();
    }

    /// The same log with every rate times `scale` (a parameter group's learning rates: the
    /// product is the dense step's `lr * scale`, bit for bit).
    pub(crate) fn scaled(&self, scale: f64) -> LrLog {
        LrLog { base: self.base, lrs: self.lrs.iter().map(|lr| lr * scale).collect() }
    }

    /// Records the rate of the next update.
    pub(crate) fn push(&mut self, lr: f64) {
        self.lrs.push(lr);
    }

    /// The rate of update `t` (recorded, else an error naming it).
    fn get(&self, t: u64) -> Result<f64> {
        t.checked_sub(self.base + 1).and_then(|i| self.lrs.get(i as usize)).copied().ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "lazy update: the learning rate of update {t} was not recorded (updates {}..={} are)",
                self.base + 1,
                self.base + self.lrs.len() as u64
            ))
        })
    }
}

/// Whether the lazy path takes a parameter `w` with state `slots` and gradient rows `g` of
/// `n` rows: a contiguous CPU tensor, f32 or f64 with slots and gradient of its dtype, or bf16
/// with bf16 slots and an f32 gradient (arithmetic in f32, see [`Stored`]); `g` with `n` rows
/// of `w`'s row shape.
pub(crate) fn applies(w: &Tensor, slots: &[Tensor], g: &Tensor, n: usize) -> bool {
    let grad_dtype = match w.dtype() {
        DType::F32 | DType::F64 => w.dtype(),
        DType::BF16 => DType::F32,
        _ => return false,
    };
    let on_cpu = |x: &Tensor| x.device().is_cpu() && x.is_contiguous();
    let row_shape = |x: &Tensor| x.dims().get(1..).map(<[usize]>::to_vec);
    w.rank() >= 1
        && on_cpu(w)
        && slots.iter().all(|s| on_cpu(s) && s.dtype() == w.dtype() && s.dims() == w.dims())
        && on_cpu(g)
        && g.dtype() == grad_dtype
        && g.dims().first() == Some(&n)
        && row_shape(g) == row_shape(w)
}

/// How a parameter's values are stored and computed with: f32 and f64 in their own
/// arithmetic; bf16 in f32, rounded back to bf16 after every update (as a dense step that
/// loads, updates and stores bf16 does).
pub(crate) trait Stored: WithDType {
    /// The arithmetic's type.
    type C: WithDType;
    fn load(self) -> Self::C;
    fn store(c: Self::C) -> Self;
    /// The storage's elements, when it holds this type.
    fn elements(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

impl Stored for f32 {
    type C = f32;
    fn load(self) -> f32 {
        self
    }
    fn store(c: f32) -> f32 {
        c
    }
    fn elements(s: &mut CpuStorage) -> Option<&mut Vec<f32>> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Stored for f64 {
    type C = f64;
    fn load(self) -> f64 {
        self
    }
    fn store(c: f64) -> f64 {
        c
    }
    fn elements(s: &mut CpuStorage) -> Option<&mut Vec<f64>> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl Stored for bf16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(c: f32) -> bf16 {
        bf16::from_f32(c)
    }
    fn elements(s: &mut CpuStorage) -> Option<&mut Vec<bf16>> {
        match s {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

/// The contiguous elements of `s` seen through `l`, as `S`.
fn elements_mut<'a, S: Stored>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [S]> {
    let (lo, hi) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("lazy update: a non-contiguous tensor".into()))?;
    let dtype = s.dtype();
    match S::elements(s) {
        Some(v) => Ok(&mut v[lo..hi]),
        None => candle_core::bail!("lazy update: a {dtype:?} tensor where {:?} was expected", S::DTYPE),
    }
}

/// Rows of a parameter and the number of updates each has had.
pub(crate) struct Behind<'a> {
    /// Local rows (dim 0), sorted and distinct.
    pub(crate) rows: &'a [u32],
    /// Updates row `rows[i]` has had.
    pub(crate) from: &'a [u64],
}

/// Brings `behind`'s rows of `w` and its state `slots` (one per slot of `rule`) up to `to`
/// updates: the missed updates with a zero gradient, and with `grad` (`[rows, ...]`, those
/// rows' gradient) the last one with it. `w` and `slots` are changed in place; the caller
/// checked them with [`applies`].
pub(crate) fn bring_up(
    rule: Rule,
    w: &Tensor,
    slots: &[Tensor],
    behind: Behind,
    to: u64,
    grad: Option<&Tensor>,
    lrs: &LrLog,
) -> Result<()> {
    let (rows, from) = (behind.rows, behind.from);
    if slots.len() != rule.slots() || from.len() != rows.len() {
        candle_core::bail!(
            "lazy update: {} state slots for a rule with {}, {} counts for {} rows",
            slots.len(),
            rule.slots(),
            from.len(),
            rows.len()
        );
    }
    let per_row = w.elem_count() / w.dim(0)?.max(1);
    let block = (BLOCK_BYTES / (per_row.max(1) * w.dtype().size_in_bytes() * rule.slots().max(1))).max(1);
    for (b, part) in rows.chunks(block).enumerate() {
        let first = b * block;
        let new_slots = {
            // Read guards on the slots and the gradient, held while `w` is written.
            let slot_guards: Vec<_> = slots.iter().map(Tensor::storage_and_layout).collect();
            let grad_guard = grad.map(Tensor::storage_and_layout);
            let slots_cpu = slot_guards.iter().map(on_cpu).collect::<Result<Vec<_>>>()?;
            let grad_cpu = grad_guard.as_ref().map(on_cpu).transpose()?;
            let op = BringUp {
                rule,
                rows: part,
                from: &from[first..first + part.len()],
                to,
                grad: grad_cpu.map(|(s, off)| (s, off + first * per_row)),
                slots: slots_cpu,
                per_row,
                lrs,
                out: Mutex::new(None),
            };
            w.inplace_op1(&op)?;
            op.out.into_inner().map_err(|_| candle_core::Error::Msg("lazy update: a worker panicked".into()))?
        };
        if let Some(out) = new_slots {
            for (j, s) in slots.iter().enumerate() {
                s.inplace_op1(&Scatter { rows: part, src: &out, per_row, stride: per_row * slots.len(), offset: j * per_row })?;
            }
        }
    }
    Ok(())
}

/// The CPU storage behind a read guard, and the element offset of its layout.
fn on_cpu<'g>(g: &'g (candle_core::StorageRef<'_>, &Layout)) -> Result<(&'g CpuStorage, usize)> {
    match &*g.0 {
        candle_core::Storage::Cpu(c) => Ok((c, g.1.start_offset())),
        _ => candle_core::bail!("lazy update: a state slot or gradient is not on the CPU"),
    }
}

/// One block of [`bring_up`]: on `w` in place; the slots' new rows go to `out`, row by row,
/// the slots of a row side by side.
struct BringUp<'a> {
    rule: Rule,
    rows: &'a [u32],
    from: &'a [u64],
    to: u64,
    /// The gradient's storage and the element offset of this block's first row.
    grad: Option<(&'a CpuStorage, usize)>,
    /// Each slot's storage and the element offset of its row 0.
    slots: Vec<(&'a CpuStorage, usize)>,
    per_row: usize,
    lrs: &'a LrLog,
    out: Mutex<Option<CpuStorage>>,
}

/// One row's work: its value, its slots' copies, its gradient, its update count.
struct Item<'x, S: Stored> {
    w: &'x mut [S],
    s: &'x mut [S],
    g: Option<&'x [S::C]>,
    from: u64,
}

impl BringUp<'_> {
    fn run<S: Stored>(&self, w: &mut [S]) -> Result<Vec<S>> {
        let (d, n, k) = (self.per_row, self.rows.len(), self.slots.len());
        let total = w.len();
        // The slots' rows, copied side by side.
        let mut out: Vec<S> = Vec::with_capacity(n * k * d);
        let slot_views =
            self.slots.iter().map(|(s, off)| Ok(&s.as_slice::<S>()?[*off..*off + total])).collect::<Result<Vec<_>>>()?;
        for &r in self.rows {
            let r = r as usize;
            for v in &slot_views {
                out.extend_from_slice(&v[r * d..(r + 1) * d]);
            }
        }
        let grad = match self.grad {
            Some((s, off)) => Some(&s.as_slice::<S::C>()?[off..off + n * d]),
            None => None,
        };
        // Every update `to` needs, looked up once.
        let last = self.from.iter().copied().min().unwrap_or(self.to);
        let lrs: Vec<f64> = (last + 1..=self.to).map(|t| self.lrs.get(t)).collect::<Result<_>>()?;
        let lr = |t: u64| lrs[(t - last - 1) as usize];
        // The rows' disjoint slices of `w` and `out`.
        let mut items = Vec::with_capacity(n);
        let (mut rest_w, mut rest_s, mut at) = (w, out.as_mut_slice(), 0usize);
        for (i, &r) in self.rows.iter().enumerate() {
            let r = r as usize;
            if r * d < at || (r + 1) * d > total {
                candle_core::bail!("lazy update: row {r} is out of order or past the {} rows", total / d.max(1));
            }
            let (_, tail) = std::mem::take(&mut rest_w).split_at_mut(r * d - at);
            let (row, tail) = tail.split_at_mut(d);
            rest_w = tail;
            at = (r + 1) * d;
            let (s, tail) = std::mem::take(&mut rest_s).split_at_mut(k * d);
            rest_s = tail;
            items.push(Item { w: row, s, g: grad.map(|g| &g[i * d..(i + 1) * d]), from: self.from[i] });
        }
        let (rule, to) = (self.rule, self.to);
        // Each row in the arithmetic's type, stored back (rounded for bf16) after every update.
        items.into_par_iter().for_each_init(
            || (Vec::<S::C>::new(), Vec::<S::C>::new()),
            |(wc, sc), it| {
                wc.clear();
                wc.extend(it.w.iter().map(|v| v.load()));
                sc.clear();
                sc.extend(it.s.iter().map(|v| v.load()));
                let round = |x: &mut [S::C]| x.iter_mut().for_each(|v| *v = S::store(*v).load());
                let replay_to = if it.g.is_some() { to - 1 } else { to };
                for t in it.from + 1..=replay_to {
                    let (s0, s1) = sc.split_at_mut(if k > 0 { d } else { 0 });
                    rule.apply(wc, s0, s1, None, lr(t), t);
                    round(wc);
                    round(sc);
                }
                if let Some(g) = it.g {
                    let (s0, s1) = sc.split_at_mut(if k > 0 { d } else { 0 });
                    rule.apply(wc, s0, s1, Some(g), lr(to), to);
                }
                it.w.iter_mut().zip(wc.iter()).for_each(|(w, c)| *w = S::store(*c));
                it.s.iter_mut().zip(sc.iter()).for_each(|(s, c)| *s = S::store(*c));
            },
        );
        Ok(out)
    }
}

impl InplaceOp1 for BringUp<'_> {
    fn name(&self) -> &'static str {
        "allgrad-lazy-rows"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let out = match s.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.run(elements_mut::<f32>(s, l)?)?),
            DType::F64 => f64::to_cpu_storage_owned(self.run(elements_mut::<f64>(s, l)?)?),
            DType::BF16 => bf16::to_cpu_storage_owned(self.run(elements_mut::<bf16>(s, l)?)?),
            other => candle_core::bail!("lazy update: unsupported dtype {other:?}"),
        };
        let mut slot = self.out.lock().map_err(|_| candle_core::Error::Msg("lazy update: a worker panicked".into()))?;
        *slot = Some(out);
        Ok(())
    }
}

/// Writes rows `rows` of a tensor from `src` (row i at element `i * stride + offset`).
struct Scatter<'a> {
    rows: &'a [u32],
    src: &'a CpuStorage,
    per_row: usize,
    stride: usize,
    offset: usize,
}

impl Scatter<'_> {
    fn run<S: Stored>(&self, dst: &mut [S]) -> Result<()> {
        let src = self.src.as_slice::<S>()?;
        let d = self.per_row;
        for (i, &r) in self.rows.iter().enumerate() {
            let (r, at) = (r as usize, i * self.stride + self.offset);
            dst[r * d..(r + 1) * d].copy_from_slice(&src[at..at + d]);
        }
        Ok(())
    }
}

impl InplaceOp1 for Scatter<'_> {
    fn name(&self) -> &'static str {
        "allgrad-lazy-scatter"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s.dtype() {
            DType::F32 => self.run(elements_mut::<f32>(s, l)?),
            DType::F64 => self.run(elements_mut::<f64>(s, l)?),
            DType::BF16 => self.run(elements_mut::<bf16>(s, l)?),
            other => candle_core::bail!("lazy update: unsupported dtype {other:?}"),
        }
    }
}
