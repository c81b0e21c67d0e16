//! Optimizers with their state: SGD (momentum, nesterov, weight decay), LARS, AdamW.
//!
//! All run on the synchronised gradients, so every rank applies the same update to its
//! replicated parameters. SGD and AdamW on CPU f32/f64 parameters take a fused in-place
//! kernel (`fused.rs`) with the same formulas; the rest is composed from Candle ops.
//! Their state is a set of named tensors (`<param>/<slot>`) plus a step count, saved in
//! checkpoints.
//!
//! A gradient may be row-sparse ([`RowUpdate::Sparse`]: the rows a step used, as ids and
//! rows, for a class-sharded head with Partial FC). SGD and AdamW then update those rows
//! only and apply the other rows' zero-gradient steps lazily, when the rows are next used or
//! at [`Optimizer::flush`] (`lazy.rs`): the result equals the dense update bit for bit.
//! A bf16 parameter on the CPU (bf16 face centres) takes the same lazy update in f32
//! arithmetic. LARS, and parameters off these paths (other devices and dtypes), take the dense update
//! of the gradient scattered into zeros: LARS's trust ratio needs the norms of every row's
//! current value at every step (over all ranks for a sharded parameter), which a deferred
//! row does not have.
//!
//! Each parameter follows its rule ([`ParamRule`]: learning-rate scale, weight decay, LARS's
//! adaptation), resolved from the `param_groups` section by [`groups`]; every path (fused,
//! lazy, composed, on the CPU or CUDA) takes the parameter's weight decay and its scaled
//! learning rate. [`Optimizer::new`] without rules updates every parameter as the config
//! says ([`groups::legacy`]).
//!
//! The `optim` section, [`OptimConfig`], is the config's (`config/optim.rs`).

mod fused;
pub mod groups;
mod lazy;

use std::collections::BTreeMap;

use allgrad_dist::{ProcessGroup, ReduceOp};
use candle_core::{DType, Result, Tensor, Var};

pub use crate::config::OptimConfig;
pub use groups::ParamRule;
use lazy::{Behind, LrLog, Rule};

/// Which rows (dim 0) of a parameter an update changes, and the form of its gradient.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RowUpdate {
    /// A dense gradient; every row is updated.
    #[default]
    All,
    /// A dense gradient; only the rows marked true are updated, the others keep their value
    /// and their state slots bit for bit.
    Only(Vec<bool>),
    /// A row-sparse gradient: the gradient tensor holds rows `rows` (sorted, distinct) of the
    /// parameter, `[rows.len(), ...]`; every other row's gradient is zero. With `keep_others`
    /// false the result is the dense update's: the other rows' updates are applied lazily
    /// (see the module docs). With `keep_others` true the other rows keep value and state, as
    /// with [`RowUpdate::Only`].
    Sparse {
        /// The rows in the gradient.
        rows: Vec<u32>,
        /// Whether the rows not in the gradient keep value and state.
        keep_others: bool,
    },
}

/// An optimizer and its state.
pub struct Optimizer {
    cfg: OptimConfig,
    /// Slot tensors by `<param>/<slot>`.
    state: BTreeMap<String, Tensor>,
    /// Updates applied so far.
    pub steps: u64,
    /// Parameters with rows behind `steps` (deferred updates), and each row's update count.
    lazy: BTreeMap<String, Vec<u64>>,
    /// The learning rate of every update a deferred row may still need.
    lrs: LrLog,
    /// Each parameter's rule (absent: [`groups::legacy`]).
    rules: BTreeMap<String, ParamRule>,
}

fn sq_norm(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

/// `Σ t²` in f64 as a scalar tensor on `t`'s device (no read).
pub(crate) fn sq_norm_tensor(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F64)?.sqr()?.sum_all()
}

impl Optimizer {
    /// A fresh optimizer; every parameter is updated as `cfg` says ([`groups::legacy`]).
    pub fn new(cfg: OptimConfig) -> Self {
        Self::with_rules(cfg, BTreeMap::new())
    }

    /// A fresh optimizer whose parameters follow `rules` (by name; one not there: as `cfg`
    /// says). A frozen parameter must not be given to it.
    pub fn with_rules(cfg: OptimConfig, rules: BTreeMap<String, ParamRule>) -> Self {
        Optimizer { cfg, state: BTreeMap::new(), steps: 0, lazy: BTreeMap::new(), lrs: LrLog::default(), rules }
    }

    /// The optimizer's config.
    pub fn config(&self) -> &OptimConfig {
        &self.cfg
    }

    /// The rules given to [`Optimizer::with_rules`] (for checkpoints).
    pub fn rules(&self) -> &BTreeMap<String, ParamRule> {
        &self.rules
    }

    /// Parameter `name`'s config (its weight decay) and learning-rate scale; an error for a
    /// frozen one.
    fn param_cfg(&self, name: &str, w: &Tensor) -> Result<(OptimConfig, ParamRule)> {
        let rule = self.rules.get(name).cloned().unwrap_or_else(|| groups::legacy(&self.cfg, w.dims()));
        if rule.frozen {
            candle_core::bail!("optimizer: parameter {name} is frozen (param_groups) but was given an update");
        }
        Ok((self.cfg.with_weight_decay(rule.weight_decay), rule))
    }

    /// The learning rates of deferred updates, scaled by `scale` (borrowed when 1).
    fn scaled_lrs(&self, scale: f64) -> std::borrow::Cow<'_, LrLog> {
        if scale == 1.0 {
            std::borrow::Cow::Borrowed(&self.lrs)
        } else {
            std::borrow::Cow::Owned(self.lrs.scaled(scale))
        }
    }

    /// The state tensors, for checkpoints. Rows of a row-sparse update may be behind (see
    /// [`Optimizer::pending`]): [`Optimizer::flush`] first.
    pub fn state(&self) -> &BTreeMap<String, Tensor> {
        &self.state
    }

    /// Restores state saved by [`Optimizer::state`] (after a flush: every row current).
    pub fn load_state(&mut self, state: BTreeMap<String, Tensor>, steps: u64) {
        self.state = state;
        self.steps = steps;
        self.lazy.clear();
        self.lrs.reset(steps);
    }

    /// Whether some rows of some parameter have updates pending (row-sparse updates since
    /// the last [`Optimizer::flush`]): their values and state slots are not yet those of the
    /// dense update.
    pub fn pending(&self) -> bool {
        !self.lazy.is_empty()
    }

    /// Applies every pending update (see the module docs), so that every parameter and state
    /// slot holds what the dense updates would have given: before reading parameters or
    /// state (a checkpoint, an evaluation). `params` must include every parameter given to
    /// the row-sparse steps.
    pub fn flush(&mut self, params: &[(String, Var)]) -> Result<()> {
        for (name, p) in params {
            self.flush_param(name, p, self.steps)?;
        }
        if let Some(name) = self.lazy.keys().next() {
            candle_core::bail!("optimizer flush: parameter {name} has pending updates but was not passed");
        }
        self.lrs.reset(self.steps);
        Ok(())
    }

    /// Brings rows `rows` (sorted, distinct) of parameter `name` up to date: the updates a
    /// row-sparse step left pending on them are applied (nothing when none are). Call it
    /// before reading those rows (the forward pass of the step that uses them).
    pub fn catch_up(&mut self, name: &str, p: &Var, rows: &[u32]) -> Result<()> {
        let to = self.steps;
        let Some(done) = self.lazy.get_mut(name) else { return Ok(()) };
        if let Some(r) = rows.iter().find(|r| **r as usize >= done.len()) {
            candle_core::bail!("catch_up of {name}: row {r} of a parameter of {} rows", done.len());
        }
        let (behind, from): (Vec<u32>, Vec<u64>) =
            rows.iter().filter(|r| done[**r as usize] < to).map(|r| (*r, done[*r as usize])).unzip();
        if behind.is_empty() {
            return Ok(());
        }
        behind.iter().for_each(|r| done[*r as usize] = to);
        crate::trace::count(|c| c.replayed_rows += behind.len() as u64);
        let w = p.as_tensor();
        let (cfg, prule) = self.param_cfg(name, w)?;
        let rule = Rule::of(&cfg).ok_or_else(|| candle_core::Error::Msg("lazy update under LARS".into()))?;
        let slots: Vec<Tensor> = slot_names(&cfg).iter().map(|s| self.slot(name, s, w)).collect::<Result<_>>()?;
        lazy::bring_up(rule, w, &slots, Behind { rows: &behind, from: &from }, to, None, &self.scaled_lrs(prule.lr_scale))
    }

    /// Brings every row of `name` up to `to` updates.
    fn flush_param(&mut self, name: &str, p: &Var, to: u64) -> Result<()> {
        let Some(done) = self.lazy.remove(name) else { return Ok(()) };
        let w = p.as_tensor();
        let (cfg, prule) = self.param_cfg(name, w)?;
        let rule = Rule::of(&cfg).ok_or_else(|| candle_core::Error::Msg("lazy update under LARS".into()))?;
        let (rows, from): (Vec<u32>, Vec<u64>) =
            done.iter().enumerate().filter(|(_, d)| **d < to).map(|(r, d)| (r as u32, *d)).unzip();
        if rows.is_empty() {
            return Ok(());
        }
        crate::trace::count(|c| c.replayed_rows += rows.len() as u64);
        let slots: Vec<Tensor> = slot_names(&cfg).iter().map(|s| self.slot(name, s, w)).collect::<Result<_>>()?;
        lazy::bring_up(rule, w, &slots, Behind { rows: &rows, from: &from }, to, None, &self.scaled_lrs(prule.lr_scale))
    }

    /// The lazy step of parameter `name` (see the module docs), or `false` when it does not
    /// apply (LARS, a tensor off the fused path). `t` is this update's number.
    fn step_lazy(&mut self, name: &str, p: &Var, g: &Tensor, rows: &[u32], keep_others: bool, t: u64) -> Result<bool> {
        let w = p.as_tensor();
        let (cfg, prule) = self.param_cfg(name, w)?;
        let Some(rule) = Rule::of(&cfg) else { return Ok(false) };
        let names = slot_names(&cfg);
        let slots: Vec<Tensor> = names.iter().map(|s| self.slot(name, s, w)).collect::<Result<_>>()?;
        if !lazy::applies(w, &slots, g, rows.len()) {
            return Ok(false);
        }
        let n = w.dim(0)?;
        if keep_others || rule.zero_step_is_identity() {
            // Nothing is deferred: the rows not in the gradient do not change.
            self.flush_param(name, p, t - 1)?;
            let from = vec![t - 1; rows.len()];
            lazy::bring_up(rule, w, &slots, Behind { rows, from: &from }, t, Some(g), &self.scaled_lrs(prule.lr_scale))?;
        } else {
            let done = self.lazy.entry(name.to_string()).or_insert_with(|| vec![t - 1; n]);
            let from: Vec<u64> = rows.iter().map(|r| done[*r as usize]).collect();
            for r in rows {
                done[*r as usize] = t;
            }
            let (caught_up, left) = (from.iter().filter(|f| **f < t - 1).count(), n - rows.len());
            crate::trace::count(|c| {
                c.replayed_rows += caught_up as u64;
                c.deferred_rows += left as u64;
            });
            lazy::bring_up(rule, w, &slots, Behind { rows, from: &from }, t, Some(g), &self.scaled_lrs(prule.lr_scale))?;
        }
        for (slot, value) in names.iter().zip(slots) {
            self.set_slot(name, slot, value);
        }
        crate::trace::count(|c| c.lazy_updates += 1);
        Ok(true)
    }

    fn slot(&mut self, name: &str, slot: &str, like: &Tensor) -> Result<Tensor> {
        let key = format!("{name}/{slot}");
        match self.state.get(&key) {
            Some(t) => Ok(t.clone()),
            None => like.zeros_like(),
        }
    }

    fn set_slot(&mut self, name: &str, slot: &str, t: Tensor) {
        self.state.insert(format!("{name}/{slot}"), t);
    }

    /// Applies one update with learning rate `lr`. `params` and `grads` are aligned and in
    /// name order; `sharded[i]` marks parameters split across ranks, whose norms (for LARS)
    /// are summed over `pg` so every shard sees the full tensor's trust ratio.
    pub fn step(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        sharded: &[bool],
        lr: f64,
        pg: &ProcessGroup,
    ) -> Result<()> {
        self.step_rows(params, grads, sharded, &[], lr, pg)
    }

    /// As [`Optimizer::step`], changing only some rows (dim 0) of some parameters: where
    /// `rows[i]` is `Some(mask)`, the rows of parameter i marked false keep their value and
    /// their state slots (momentum, Adam moments) bit for bit: the fused kernel skips them; the
    /// composed path computes the update and the new slots for the whole tensor, then selects
    /// the old rows back (`where_cond`), so neither weight decay nor momentum moves them. Missing entries (a
    /// shorter `rows`) and `None` change every row. LARS's trust ratio still uses the whole
    /// tensor's norms. The update is computed on detached views of the parameters and
    /// gradients (same storage, no graph), so the stored state carries no computation graph (which would keep every
    /// earlier step's graph, activations included, alive).
    pub fn step_rows(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        sharded: &[bool],
        rows: &[Option<Vec<bool>>],
        lr: f64,
        pg: &ProcessGroup,
    ) -> Result<()> {
        let rows: Vec<RowUpdate> = rows.iter().map(|r| r.clone().map_or(RowUpdate::All, RowUpdate::Only)).collect();
        self.step_grads(params, grads, sharded, &rows, lr, pg)
    }

    /// As [`Optimizer::step_rows`], with each parameter's gradient dense or row-sparse:
    /// `rows[i]` ([`RowUpdate`]; missing entries are [`RowUpdate::All`]) says which rows of
    /// parameter i change and what `grads[i]` holds. A row-sparse gradient of SGD or AdamW on
    /// the fused path updates its rows only and leaves the other rows' updates pending until
    /// they are next in a gradient or [`Optimizer::flush`] (the dense update's result, bit for
    /// bit); otherwise it is scattered into zeros and takes the dense update.
    pub fn step_grads(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        sharded: &[bool],
        rows: &[RowUpdate],
        lr: f64,
        pg: &ProcessGroup,
    ) -> Result<()> {
        self.step_impl(params, grads, sharded, rows, lr, pg, None)
    }

    /// As [`Optimizer::step_grads`] with every gradient dense ([`RowUpdate::All`]), guarded by
    /// `ok`, a u8 flag on the parameters' device (the trainer's "loss and gradient norm are
    /// finite"): where it is 0 no parameter or state slot changes (the fused kernels skip, the
    /// composed path selects the old values back), so a non-finite step is skipped without the
    /// host reading the flag first; [`Optimizer::undo_step`] then takes the step count back.
    /// Returns false, changing nothing, where the guard does not apply (a row-sparse or
    /// row-masked update, or rows with updates pending): the caller reads the flag first.
    /// LARS's trust ratios are computed on the device here too (no read).
    #[allow(clippy::too_many_arguments)]
    pub fn step_guarded(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        sharded: &[bool],
        rows: &[RowUpdate],
        lr: f64,
        pg: &ProcessGroup,
        ok: &Tensor,
    ) -> Result<bool> {
        if !self.lazy.is_empty() || rows.iter().any(|r| !matches!(r, RowUpdate::All)) {
            return Ok(false);
        }
        self.step_impl(params, grads, sharded, rows, lr, pg, Some(ok))?;
        Ok(true)
    }

    /// Takes back the step count of a [`Optimizer::step_guarded`] whose guard was 0 (the
    /// update was skipped on the device), so the next update is numbered as if it had not run.
    pub fn undo_step(&mut self) {
        self.steps = self.steps.saturating_sub(1);
        self.lrs.reset(self.steps);
    }

    #[allow(clippy::too_many_arguments)]
    fn step_impl(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        sharded: &[bool],
        rows: &[RowUpdate],
        lr: f64,
        pg: &ProcessGroup,
        guard: Option<&Tensor>,
    ) -> Result<()> {
        self.steps += 1;
        let step = self.steps;
        if self.lazy.is_empty() {
            self.lrs.reset(step - 1);
        }
        self.lrs.push(lr);
        let t = step as i32;
        let base_lr = lr;
        for (i, ((name, p), g)) in params.iter().zip(grads).enumerate() {
            // Detached: ops on the variable (or on a gradient with its graph) would be tracked.
            let (w, g) = (&p.as_tensor().detach(), &g.detach());
            // This parameter's weight decay and learning rate (its group's).
            let (cfg, rule) = self.param_cfg(name, w)?;
            let lr = base_lr * rule.lr_scale;
            let (g, row_mask): (Tensor, Option<Vec<bool>>) = match rows.get(i) {
                Some(RowUpdate::Sparse { rows: ids, keep_others }) => {
                    check_sparse(name, w, g, ids)?;
                    if self.step_lazy(name, p, g, ids, *keep_others, step)? {
                        continue;
                    }
                    // The dense update of the gradient scattered into zeros.
                    crate::trace::count(|c| c.sparse_as_dense += 1);
                    self.flush_param(name, p, step - 1)?;
                    let dense = match ids.is_empty() {
                        true => w.zeros_like()?,
                        false => {
                            w.zeros_like()?.index_add(&Tensor::new(ids.as_slice(), w.device())?, &g.to_dtype(w.dtype())?, 0)?
                        }
                    };
                    let keep = keep_others.then(|| {
                        let mut m = vec![false; w.dim(0).unwrap_or(0)];
                        ids.iter().for_each(|r| m[*r as usize] = true);
                        m
                    });
                    (dense, keep)
                }
                Some(RowUpdate::Only(m)) => {
                    self.flush_param(name, p, step - 1)?;
                    (g.clone(), Some(m.clone()))
                }
                _ => {
                    self.flush_param(name, p, step - 1)?;
                    (g.clone(), None)
                }
            };
            let g = &g;
            if fused::applies(&cfg, w, g) {
                let names = slot_names(&cfg);
                let slots: Vec<Tensor> = names.iter().map(|s| self.slot(name, s, w)).collect::<Result<_>>()?;
                let row_flags = row_mask.as_deref();
                // In place on the parameter's own storage (a detached view would share it too).
                if fused::update(&cfg, p.as_tensor(), g, &slots, row_flags, lr, t, guard)? {
                    for (slot, value) in names.iter().zip(slots) {
                        self.set_slot(name, slot, value);
                    }
                    let cuda = w.device().is_cuda();
                    crate::trace::count(|c| if cuda { c.fused_cuda += 1 } else { c.fused_cpu += 1 });
                    continue;
                }
            }
            crate::trace::count(|c| c.composed += 1);
            let mask = match (&row_mask, guard) {
                (Some(m), _) => Some(row_mask_tensor(m, w)?),
                // The guard over the whole tensor: every element keeps its old value when 0.
                (None, Some(ok)) => Some(ok.reshape(vec![1; w.rank()])?.broadcast_as(w.shape())?),
                (None, None) => None,
            };
            let prefix = format!("{name}/");
            let before: Vec<(String, Option<Tensor>)> = match mask {
                Some(_) => slot_names(&cfg)
                    .iter()
                    .map(|slot| format!("{prefix}{slot}"))
                    .map(|k| (k.clone(), self.state.get(&k).cloned()))
                    .collect(),
                None => Vec::new(),
            };
            let update = match cfg {
                OptimConfig::Sgd { momentum, nesterov, weight_decay, .. } => {
                    let mut d = if weight_decay > 0.0 { (g + (w * weight_decay)?)? } else { g.clone() };
                    if momentum > 0.0 {
                        let buf = ((self.slot(name, "momentum", w)? * momentum)? + &d)?;
                        d = if nesterov { (&d + (&buf * momentum)?)? } else { buf.clone() };
                        self.set_slot(name, "momentum", buf);
                    }
                    (d * lr)?
                }
                OptimConfig::Lars { momentum, weight_decay, trust_coefficient, .. } => {
                    // The rule's weight decay (none on excluded 1-D parameters by default),
                    // then the trust ratio where the rule adapts.
                    let d = if weight_decay > 0.0 { (g + (w * weight_decay)?)? } else { g.clone() };
                    let d = if !rule.lars_adaptation {
                        d
                    } else if guard.is_some() {
                        // On the device: the same arithmetic as below, as tensor ops.
                        lars_trust_on_device(w, &d, sharded[i], trust_coefficient, pg)?
                    } else {
                        let mut norms = [sq_norm(w)?, sq_norm(&d)?];
                        if sharded[i] {
                            pg.all_reduce_slice(&mut norms, ReduceOp::Sum)?;
                        }
                        let (wn, dn) = (norms[0].sqrt(), norms[1].sqrt());
                        let trust = if wn > 0.0 && dn > 0.0 { trust_coefficient * wn / dn } else { 1.0 };
                        (d * trust)?
                    };
                    let buf = ((self.slot(name, "momentum", w)? * momentum)? + &d)?;
                    self.set_slot(name, "momentum", buf.clone());
                    (buf * lr)?
                }
                OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
                    let m = ((self.slot(name, "exp_avg", w)? * beta1)? + (g * (1.0 - beta1))?)?;
                    let v = ((self.slot(name, "exp_avg_sq", w)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let m_hat = (&m / (1.0 - beta1.powi(t)))?;
                    let v_hat = (&v / (1.0 - beta2.powi(t)))?;
                    self.set_slot(name, "exp_avg", m);
                    self.set_slot(name, "exp_avg_sq", v);
                    let step = (m_hat / (v_hat.sqrt()? + eps)?)?;
                    ((step + (w * weight_decay)?)? * lr)?
                }
            };
            let updated = (w - update)?;
            match &mask {
                None => p.set(&updated)?,
                Some(m) => {
                    p.set(&m.where_cond(&updated, w)?)?;
                    for (key, old) in before {
                        if let Some(new) = self.state.get(&key) {
                            let old = match old {
                                Some(o) => o,
                                None => new.zeros_like()?,
                            };
                            let kept = m.where_cond(new, &old)?;
                            self.state.insert(key, kept);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// `d · trust` with LARS's trust ratio `tc·‖w‖/‖d‖` (1 where a norm is 0) computed on the
/// device: the norms' squares summed over ranks for a sharded parameter (one collective of a
/// device tensor), no value read to the host.
fn lars_trust_on_device(w: &Tensor, d: &Tensor, sharded: bool, trust_coefficient: f64, pg: &ProcessGroup) -> Result<Tensor> {
    let mut norms = Tensor::stack(&[sq_norm_tensor(w)?, sq_norm_tensor(d)?], 0)?;
    if sharded {
        norms = pg.all_reduce(&norms, ReduceOp::Sum)?;
    }
    let norms = norms.sqrt()?;
    let (wn, dn) = (norms.get(0)?, norms.get(1)?);
    let (zero, one) = (wn.zeros_like()?, wn.ones_like()?);
    let ratio = ((&wn * trust_coefficient)? / &dn)?;
    let trust = wn.gt(&zero)?.where_cond(&dn.gt(&zero)?.where_cond(&ratio, &one)?, &one)?;
    d.broadcast_mul(&trust.to_dtype(d.dtype())?)
}

/// The state slots an optimizer keeps per parameter (SGD without momentum keeps none).
pub(crate) fn slot_names(cfg: &OptimConfig) -> &'static [&'static str] {
    match cfg {
        OptimConfig::Sgd { momentum, .. } if *momentum > 0.0 => &["momentum"],
        OptimConfig::Sgd { .. } => &[],
        OptimConfig::Lars { .. } => &["momentum"],
        OptimConfig::Adamw { .. } => &["exp_avg", "exp_avg_sq"],
    }
}

/// Checks a row-sparse gradient `g` of parameter `name` (`w`): rows sorted, distinct and
/// within `w`, and `g` of `[rows.len(), w's row shape]`.
fn check_sparse(name: &str, w: &Tensor, g: &Tensor, rows: &[u32]) -> Result<()> {
    let n = w.dims().first().copied().unwrap_or(0);
    if let Some(k) = (1..rows.len()).find(|k| rows[k - 1] >= rows[*k]) {
        candle_core::bail!("row-sparse gradient of {name}: rows must be increasing, got {} then {}", rows[k - 1], rows[k]);
    }
    if let Some(r) = rows.last().filter(|r| **r as usize >= n) {
        candle_core::bail!("row-sparse gradient of {name}: row {r} of a parameter of {n} rows");
    }
    if g.dims().first() != Some(&rows.len()) || g.dims().get(1..) != w.dims().get(1..) {
        candle_core::bail!(
            "row-sparse gradient of {name}: {} rows of a parameter of shape {:?}, but a gradient of shape {:?}",
            rows.len(),
            w.dims(),
            g.dims()
        );
    }
    Ok(())
}

/// A u8 mask of `like`'s shape: 1 in the rows (dim 0) marked true.
fn row_mask_tensor(rows: &[bool], like: &Tensor) -> Result<Tensor> {
    let n = like.dims().first().copied().unwrap_or(0);
    if rows.len() != n {
        candle_core::bail!("a row mask of {} rows for a parameter of shape {:?}", rows.len(), like.dims());
    }
    let per_row: usize = like.dims().iter().skip(1).product();
    let mask: Vec<u8> = rows.iter().flat_map(|r| std::iter::repeat_n(u8::from(*r), per_row)).collect();
    Tensor::from_vec(mask, like.shape(), like.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Vec<u64> {
        t.flatten_all().unwrap().to_vec1::<f64>().unwrap().into_iter().map(f64::to_bits).collect()
    }

    /// Three steps on a [4, 3] parameter with rows 1 and 3 masked out at the last two steps
    /// (row 1 was updated at the first, so it has momentum): masked rows keep value and state
    /// bit for bit although their gradient is non-zero and weight decay and momentum apply;
    /// the other rows move exactly as without a mask.
    #[test]
    fn rows_masked_out_keep_value_and_state_bitwise_under_momentum_and_weight_decay() {
        for cfg in [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.05 },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        ] {
            let pg = ProcessGroup::single();
            let make = || Var::from_vec((0..12).map(|k| k as f64 * 0.3 - 1.0).collect::<Vec<_>>(), (4, 3), &Device::Cpu).unwrap();
            let grad =
                Tensor::from_vec((0..12).map(|k| 0.5 - k as f64 * 0.07).collect::<Vec<_>>(), (4, 3), &Device::Cpu).unwrap();
            let (masked, free) = (make(), make());
            let (mut om, mut of) = (Optimizer::new(cfg.clone()), Optimizer::new(cfg.clone()));
            let mask = vec![true, false, true, false];
            let pm = [("w".to_string(), masked.clone())];
            let pf = [("w".to_string(), free.clone())];
            om.step(&pm, std::slice::from_ref(&grad), &[true], 1.0, &pg).unwrap();
            of.step(&pf, std::slice::from_ref(&grad), &[true], 1.0, &pg).unwrap();
            let value_before = bits(masked.as_tensor());
            let state_before: Vec<Vec<u64>> = om.state().values().map(bits).collect();
            for _ in 0..2 {
                om.step_rows(&pm, std::slice::from_ref(&grad), &[true], &[Some(mask.clone())], 1.0, &pg).unwrap();
                of.step(&pf, std::slice::from_ref(&grad), &[true], 1.0, &pg).unwrap();
            }
            let (vm, vf) = (bits(masked.as_tensor()), bits(free.as_tensor()));
            for (r, keep) in mask.iter().enumerate() {
                let row = r * 3..r * 3 + 3;
                if *keep {
                    assert_eq!(vm[row.clone()], vf[row.clone()], "{cfg:?}: updated row {r} differs from an unmasked run");
                    assert_ne!(vm[row.clone()], value_before[row.clone()], "{cfg:?}: row {r} did not move");
                } else {
                    assert_eq!(vm[row.clone()], value_before[row.clone()], "{cfg:?}: masked row {r} changed");
                    for (k, (now, then)) in om.state().values().map(bits).zip(&state_before).enumerate() {
                        assert_eq!(now[row.clone()], then[row.clone()], "{cfg:?}: state slot {k} of masked row {r} changed");
                    }
                }
            }
        }
    }
    /// SGD (plain, momentum, nesterov, weight decay) and AdamW over three steps, with a row
    /// mask at the last, in f32 and f64, against the formulas written out in f64 loops.
    #[test]
    fn updates_match_the_formulas_computed_in_f64() {
        let pg = ProcessGroup::single();
        let n = 40_000; // several parallel chunks
        let cfgs = [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.0, nesterov: false, weight_decay: 0.0 },
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.05 },
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.05 },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        ];
        for cfg in cfgs {
            for dtype in [DType::F32, DType::F64] {
                let init: Vec<f64> = (0..n).map(|k| ((k * 37 % 101) as f64 - 50.0) / 40.0).collect();
                let w =
                    Var::from_tensor(&Tensor::from_vec(init.clone(), (n / 4, 4), &Device::Cpu).unwrap().to_dtype(dtype).unwrap())
                        .unwrap();
                let params = [("w".to_string(), w.clone())];
                let mut opt = Optimizer::new(cfg.clone());
                // The reference starts from the dtype-rounded values.
                let mut rw: Vec<f64> = w.as_tensor().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                let (mut m, mut v) = (vec![0f64; n], vec![0f64; n]);
                let keep_row = |r: usize| r % 3 != 1;
                for step in 1..=3 {
                    let gv: Vec<f64> = (0..n).map(|k| ((k * 13 + step * 7) % 29) as f64 / 29.0 - 0.45).collect();
                    let g = Tensor::from_vec(gv.clone(), (n / 4, 4), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                    let gv: Vec<f64> = g.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                    let masked = step == 3;
                    let rows = [masked.then(|| (0..n / 4).map(keep_row).collect::<Vec<_>>())];
                    opt.step_rows(&params, &[g], &[false], &rows, cfg.lr(), &pg).unwrap();
                    for k in 0..n {
                        if masked && !keep_row(k / 4) {
                            continue;
                        }
                        match cfg {
                            OptimConfig::Sgd { lr, momentum, nesterov, weight_decay } => {
                                let mut d = gv[k] + weight_decay * rw[k];
                                if momentum > 0.0 {
                                    m[k] = momentum * m[k] + d;
                                    d = if nesterov { d + momentum * m[k] } else { m[k] };
                                }
                                rw[k] -= lr * d;
                            }
                            OptimConfig::Adamw { lr, beta1, beta2, eps, weight_decay } => {
                                m[k] = beta1 * m[k] + (1.0 - beta1) * gv[k];
                                v[k] = beta2 * v[k] + (1.0 - beta2) * gv[k] * gv[k];
                                let t = step as i32;
                                let upd = (m[k] / (1.0 - beta1.powi(t))) / ((v[k] / (1.0 - beta2.powi(t))).sqrt() + eps);
                                rw[k] -= lr * (upd + weight_decay * rw[k]);
                            }
                            OptimConfig::Lars { .. } => unreachable!(),
                        }
                    }
                }
                let got: Vec<f64> = w.as_tensor().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                let tol = if dtype == DType::F64 { 1e-13 } else { 2e-6 };
                allgrad_testkit::close::assert_rel(&got, &rw, tol, &format!("{cfg:?} {dtype:?} parameter"));
                if let Some(slot) = opt.state().get("w/momentum").or(opt.state().get("w/exp_avg")) {
                    let s: Vec<f64> = slot.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                    allgrad_testkit::close::assert_rel(&s, &m, tol, &format!("{cfg:?} {dtype:?} first state slot"));
                }
            }
        }
    }

    /// The state slots an update stores are plain values: they carry no computation graph,
    /// although the parameter is a variable and its gradient may carry a graph (a backward's
    /// stored gradients are detached, but a gradient computed from the variable is not). A
    /// tracked slot would hold the previous slot, the gradient and its whole step's graph, and
    /// each step would keep all earlier ones alive.
    /// A guarded step ([`Optimizer::step_guarded`]) with the flag 1 equals the unguarded step
    /// bit for bit (SGD with momentum and AdamW through the fused kernels, LARS composed with
    /// its trust ratio computed on the device, SGD composed through an off-path f32/f64 mix);
    /// with the flag 0 no parameter or state slot changes, and `undo_step` takes the step back.
    #[test]
    fn a_guarded_step_equals_the_plain_step_or_changes_nothing() {
        let pg = ProcessGroup::single();
        let cfgs = [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.05 },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
            OptimConfig::Lars { lr: 0.5, momentum: 0.9, weight_decay: 1e-4, trust_coefficient: 0.001, exclude_1d: true },
        ];
        for cfg in cfgs {
            let make = |shape: &[usize]| {
                let n: usize = shape.iter().product();
                Var::from_vec((0..n).map(|k| k as f64 * 0.3 - 1.0).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap()
            };
            let grads = [
                Tensor::from_vec((0..12).map(|k| 0.5 - k as f64 * 0.07).collect::<Vec<_>>(), (4, 3), &Device::Cpu).unwrap(),
                Tensor::from_vec(vec![0.25f64, -0.5, 0.75], 3, &Device::Cpu).unwrap(),
            ];
            let (a, b) = ([make(&[4, 3]), make(&[3])], [make(&[4, 3]), make(&[3])]);
            let pa: Vec<(String, Var)> = vec![("w".into(), a[0].clone()), ("b".into(), a[1].clone())];
            let pb: Vec<(String, Var)> = vec![("w".into(), b[0].clone()), ("b".into(), b[1].clone())];
            let (mut oa, mut ob) = (Optimizer::new(cfg.clone()), Optimizer::new(cfg.clone()));
            let flag = |v: u8| Tensor::new(&[v], &Device::Cpu).unwrap().reshape(()).unwrap();
            let all = [RowUpdate::All, RowUpdate::All];
            for _ in 0..2 {
                oa.step(&pa, &grads, &[false, false], 1.0, &pg).unwrap();
                assert!(ob.step_guarded(&pb, &grads, &[false, false], &all, 1.0, &pg, &flag(1)).unwrap());
            }
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(bits(x.as_tensor()), bits(y.as_tensor()), "{cfg:?}: a guarded step with the flag 1 differs");
            }
            let before: Vec<Vec<u64>> = b.iter().map(|v| bits(v.as_tensor())).collect();
            let state: Vec<Vec<u64>> = ob.state().values().map(bits).collect();
            assert!(ob.step_guarded(&pb, &grads, &[false, false], &all, 1.0, &pg, &flag(0)).unwrap());
            assert_eq!(b.iter().map(|v| bits(v.as_tensor())).collect::<Vec<_>>(), before, "{cfg:?}: a skipped step moved");
            assert_eq!(ob.state().values().map(bits).collect::<Vec<_>>(), state, "{cfg:?}: a skipped step changed the state");
            assert_eq!(ob.steps, 3);
            ob.undo_step();
            assert_eq!(ob.steps, 2);
            // A row-masked update cannot be guarded: nothing happens, the caller is told.
            let masked = [RowUpdate::Only(vec![true, false, true, true]), RowUpdate::All];
            assert!(!ob.step_guarded(&pb, &grads, &[false, false], &masked, 1.0, &pg, &flag(1)).unwrap());
            assert_eq!(ob.steps, 2);
        }
    }

    #[test]
    fn state_slots_carry_no_graph_from_the_variable_or_the_gradient() {
        let pg = ProcessGroup::single();
        for cfg in [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.05 },
            OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 0.05, trust_coefficient: 0.001, exclude_1d: true },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        ] {
            let w = Var::from_vec(vec![0.5f64, -1.0, 2.0, 0.25, 1.5, -0.75], (3, 2), &Device::Cpu).unwrap();
            let params = [("w".to_string(), w.clone())];
            let mut opt = Optimizer::new(cfg.clone());
            for step in 0..2 {
                // The gradient of Σw², computed from the variable, so that it carries a graph.
                let g = (w.as_tensor() * 2.0).unwrap();
                assert!(g.track_op(), "the gradient should carry a graph (else the test proves nothing)");
                let rows = [(step == 1).then(|| vec![true, false, true])];
                opt.step_rows(&params, &[g], &[false], &rows, 1.0, &pg).unwrap();
                for (key, t) in opt.state() {
                    assert!(!t.track_op(), "{cfg:?} step {step}: state slot {key} carries a computation graph");
                }
            }
        }
    }

    /// The plain f64 update of one element list under `cfg` with `rule`: the formulas written
    /// out (SGD with momentum/nesterov and L2 decay, LARS with its trust ratio over the whole
    /// parameter, AdamW with decoupled decay), the learning rate `lr * rule.lr_scale`.
    fn reference_step(cfg: &OptimConfig, rule: &ParamRule, w: &mut [f64], g: &[f64], s: &mut [Vec<f64>; 2], t: i32, lr: f64) {
        let lr = lr * rule.lr_scale;
        let wd = rule.weight_decay;
        match *cfg {
            OptimConfig::Sgd { momentum, nesterov, .. } => {
                for k in 0..w.len() {
                    let mut d = g[k] + wd * w[k];
                    if momentum > 0.0 {
                        s[0][k] = momentum * s[0][k] + d;
                        d = if nesterov { d + momentum * s[0][k] } else { s[0][k] };
                    }
                    w[k] -= lr * d;
                }
            }
            OptimConfig::Lars { momentum, trust_coefficient, .. } => {
                let d: Vec<f64> = (0..w.len()).map(|k| g[k] + wd * w[k]).collect();
                let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
                let (wn, dn) = (norm(w), norm(&d));
                let trust = if rule.lars_adaptation && wn > 0.0 && dn > 0.0 { trust_coefficient * wn / dn } else { 1.0 };
                for k in 0..w.len() {
                    s[0][k] = momentum * s[0][k] + d[k] * trust;
                    w[k] -= lr * s[0][k];
                }
            }
            OptimConfig::Adamw { beta1, beta2, eps, .. } => {
                for k in 0..w.len() {
                    s[0][k] = beta1 * s[0][k] + (1.0 - beta1) * g[k];
                    s[1][k] = beta2 * s[1][k] + (1.0 - beta2) * g[k] * g[k];
                    let upd = (s[0][k] / (1.0 - beta1.powi(t))) / ((s[1][k] / (1.0 - beta2.powi(t))).sqrt() + eps);
                    w[k] -= lr * (upd + wd * w[k]);
                }
            }
        }
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
    }

    /// Every rule of the parameter groups, through each path an optimizer takes (SGD and
    /// AdamW fused, and composed through a strided gradient; LARS composed, host and device
    /// trust ratio), against the plain f64 formulas: the default rule (decay on a 2-D weight,
    /// none on a bias and a 0-D scale), a group with its own learning-rate scale and weight
    /// decay on a 2-D weight, a group with its own decay on a 1-D parameter, a group with only
    /// a learning-rate scale (on the 0-D scale), and LARS's adaptation switched off by a group.
    #[test]
    fn each_group_rule_matches_the_plain_f64_update_on_every_path() {
        use crate::config::{GroupConfig, ParamGroupsConfig};
        let pg = ProcessGroup::single();
        let shapes: [(&str, Vec<usize>); 5] = [
            ("a.weight", vec![6, 4]),
            ("a.bias", vec![4]),
            ("b.weight", vec![5, 3]),
            ("b.bias", vec![3]),
            ("logit_scale", vec![]),
        ];
        let group = |params: &[&str]| GroupConfig {
            params: params.iter().map(|s| s.to_string()).collect(),
            lr_scale: 1.0,
            weight_decay: None,
            lars_adaptation: None,
            frozen: false,
        };
        let cfgs = [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.05 },
            OptimConfig::Sgd { lr: 0.1, momentum: 0.0, nesterov: false, weight_decay: 0.05 },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.2 },
            OptimConfig::Lars { lr: 0.5, momentum: 0.9, weight_decay: 0.01, trust_coefficient: 0.02, exclude_1d: true },
        ];
        for cfg in cfgs {
            let lars = matches!(cfg, OptimConfig::Lars { .. });
            let mut groups = vec![
                GroupConfig { lr_scale: 0.5, weight_decay: Some(0.3), ..group(&["b.weight"]) },
                GroupConfig { weight_decay: Some(0.07), ..group(&["b.bias"]) },
                GroupConfig { lr_scale: 4.0, ..group(&["logit_*"]) },
            ];
            if lars {
                groups[0].lars_adaptation = Some(false);
            }
            let pgc = ParamGroupsConfig { exclude_1d: true, groups };
            let named: Vec<(String, Vec<usize>)> = shapes.iter().map(|(n, d)| (n.to_string(), d.clone())).collect();
            let rules = groups::resolve(&cfg, &pgc, &named).unwrap();
            // The rules the test means to exercise (else it proves less than its name says).
            assert_eq!(rules["a.weight"].weight_decay, cfg.weight_decay());
            assert_eq!((rules["a.bias"].weight_decay, rules["logit_scale"].weight_decay), (0.0, 0.0));
            assert_eq!((rules["b.weight"].lr_scale, rules["b.weight"].weight_decay), (0.5, 0.3));
            assert_eq!(rules["b.bias"].weight_decay, 0.07);
            assert_eq!(rules["logit_scale"].lr_scale, 4.0);
            assert_eq!(rules["a.weight"].lars_adaptation, lars);
            assert!(!rules["b.weight"].lars_adaptation && !rules["a.bias"].lars_adaptation);
            // Gradients: contiguous (fused where it applies) or strided (the composed path).
            for strided in [false, true] {
                for guarded in [false, true] {
                    let init = |n: usize, k0: usize| -> Vec<f64> {
                        (0..n).map(|k| (((k + k0) * 37 % 23) as f64 - 11.0) / 9.0 + 0.05).collect()
                    };
                    let params: Vec<(String, Var)> = named
                        .iter()
                        .enumerate()
                        .map(|(i, (n, d))| {
                            let count: usize = d.iter().product();
                            (
                                n.clone(),
                                Var::from_tensor(&Tensor::from_vec(init(count, i * 5), d.as_slice(), &Device::Cpu).unwrap())
                                    .unwrap(),
                            )
                        })
                        .collect();
                    let mut reference: Vec<Vec<f64>> = params.iter().map(|(_, v)| values(v.as_tensor())).collect();
                    let mut state: Vec<[Vec<f64>; 2]> =
                        reference.iter().map(|w| [vec![0.0; w.len()], vec![0.0; w.len()]]).collect();
                    let mut opt = Optimizer::with_rules(cfg.clone(), rules.clone());
                    let before = crate::trace::optim_paths();
                    for step in 1..=3usize {
                        let lr = cfg.lr() * (1.0 - 0.2 * step as f64);
                        let gv: Vec<Vec<f64>> = reference
                            .iter()
                            .enumerate()
                            .map(|(i, w)| (0..w.len()).map(|k| ((k * 13 + step * 7 + i) % 17) as f64 / 17.0 - 0.4).collect())
                            .collect();
                        let grads: Vec<Tensor> = named
                            .iter()
                            .zip(&gv)
                            .map(|((_, d), g)| {
                                let t = Tensor::from_vec(g.clone(), d.as_slice(), &Device::Cpu).unwrap();
                                if strided && d.len() == 2 {
                                    // The same values through a transposed copy: not contiguous.
                                    t.t().unwrap().contiguous().unwrap().t().unwrap()
                                } else {
                                    t
                                }
                            })
                            .collect();
                        let sharded = vec![false; params.len()];
                        if guarded {
                            let ok = Tensor::new(&[1u8], &Device::Cpu).unwrap().reshape(()).unwrap();
                            let all = vec![RowUpdate::All; params.len()];
                            assert!(opt.step_guarded(&params, &grads, &sharded, &all, lr, &pg, &ok).unwrap());
                        } else {
                            opt.step(&params, &grads, &sharded, lr, &pg).unwrap();
                        }
                        for (i, (name, _)) in named.iter().enumerate() {
                            reference_step(&cfg, &rules[name], &mut reference[i], &gv[i], &mut state[i], step as i32, lr);
                        }
                    }
                    let paths = crate::trace::optim_paths().since(before);
                    if lars {
                        assert_eq!(paths.composed, 15, "{cfg:?}: LARS composes every update");
                    } else if strided {
                        assert_eq!(paths.composed, 6, "{cfg:?}: the two strided 2-D gradients compose");
                    } else {
                        assert_eq!(paths.fused_cpu, 15, "{cfg:?}: every update fused");
                    }
                    for ((name, v), want) in params.iter().zip(&reference) {
                        let what = format!("{cfg:?} strided {strided} guarded {guarded}: {name}");
                        allgrad_testkit::close::assert_rel(&values(v.as_tensor()), want, 1e-12, &what);
                    }
                }
            }
        }
    }

    /// A row-sparse gradient of a parameter in a group (learning-rate scale 2.5, weight decay
    /// 0.1) takes the lazy path and ends, after a flush, where the plain f64 dense update
    /// with the group's rule (zero gradient in the rows not read) ends; a frozen parameter
    /// given to the optimizer is an error naming it.
    #[test]
    fn the_lazy_update_of_a_row_sparse_gradient_follows_its_group() {
        let pg = ProcessGroup::single();
        let rule = ParamRule { frozen: false, lr_scale: 2.5, weight_decay: 0.1, lars_adaptation: false };
        for cfg in [
            OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.01 },
            OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.01 },
        ] {
            let (n, d) = (8usize, 3usize);
            let init: Vec<f64> = (0..n * d).map(|k| (k as f64 * 0.37).sin()).collect();
            let w = Var::from_tensor(&Tensor::from_vec(init.clone(), (n, d), &Device::Cpu).unwrap()).unwrap();
            let params = [("head".to_string(), w.clone())];
            let mut opt = Optimizer::with_rules(cfg.clone(), [("head".to_string(), rule.clone())].into());
            let mut reference = init;
            let mut state = [vec![0.0; n * d], vec![0.0; n * d]];
            let before = crate::trace::optim_paths();
            for (step, rows) in [vec![1u32, 4], vec![0, 4, 7], vec![2]].into_iter().enumerate() {
                let lr = cfg.lr() / (step + 1) as f64;
                let gr: Vec<f64> = (0..rows.len() * d).map(|k| ((k * 5 + step) % 7) as f64 / 7.0 - 0.3).collect();
                let mut dense = vec![0.0; n * d];
                for (i, r) in rows.iter().enumerate() {
                    dense[*r as usize * d..(*r as usize + 1) * d].copy_from_slice(&gr[i * d..(i + 1) * d]);
                }
                let g = Tensor::from_vec(gr, (rows.len(), d), &Device::Cpu).unwrap();
                let upd = [RowUpdate::Sparse { rows, keep_others: false }];
                opt.step_grads(&params, &[g], &[true], &upd, lr, &pg).unwrap();
                reference_step(&cfg, &rule, &mut reference, &dense, &mut state, step as i32 + 1, lr);
            }
            opt.flush(&params).unwrap();
            let paths = crate::trace::optim_paths().since(before);
            assert_eq!(paths.lazy_updates, 3, "{cfg:?}: the lazy path did not run");
            assert!(paths.deferred_rows > 0 && paths.replayed_rows > 0, "{cfg:?}: {paths:?}");
            allgrad_testkit::close::assert_rel(&values(w.as_tensor()), &reference, 1e-12, &format!("{cfg:?} lazy with a group"));
            // A frozen parameter is never given to the optimizer.
            let frozen = ParamRule { frozen: true, lr_scale: 0.0, weight_decay: 0.0, lars_adaptation: false };
            let mut opt = Optimizer::with_rules(cfg.clone(), [("head".to_string(), frozen)].into());
            let g = Tensor::zeros((n, d), DType::F64, &Device::Cpu).unwrap();
            let e = opt.step(&params, &[g], &[false], 0.1, &pg).unwrap_err().to_string();
            assert!(e.contains("parameter head is frozen"), "{e}");
        }
    }
}
