//! The ring losses: CLIP's symmetric InfoNCE and SigLIP's sigmoid loss over the global batch,
//! with memory that does not grow with the number of ranks.
//!
//! Each rank keeps only its own `b x d` blocks (normalised image and text embeddings) and, for
//! CLIP, each of its rows' log-sum-exp in both directions: never a received block or its
//! logits as a node of Candle's graph. The loss is one custom op whose forward runs a ring
//! ([`allgrad_dist::RingPass`]): every other rank's block arrives in turn and is scored against
//! this rank's rows (in `tile x tile` blocks with `loss.tile`), then dropped. Its backward runs
//! the ring again: each block is received and scored again, this rank's rows take their
//! gradient from it, and the block's own gradient (what this rank's loss contributes to it) is
//! sent back to the rank that owns it, one step later, while the next block is scored. So the
//! loss's memory per rank is `O(b·d + tile²)` (a few blocks in flight, their gradients, one
//! tile of logits per worker thread), whatever W is.
//!
//! - **Exact**: the same sums as the gather forms ([`super::clip_loss`], [`super::siglip_loss`]),
//!   in another order: equal to rounding (f64: relative 1e-10 in the tests), W-invariant by
//!   the sum rule (each rank's op returns the gradient of the sum of every rank's loss with
//!   respect to its own blocks).
//! - **Exchanges**: the blocks travel both ways by default (about W/2 steps; one way: W − 1);
//!   each step's exchange runs on a communication thread while the calling thread scores the
//!   block that arrived at the previous step. One check across the group per pass (forward
//!   and backward each): the ranks' settings and block sizes; then only point-to-point
//!   messages whose sizes are known.
//! - **Devices**: the ring runs on the host (f32 or f64). Embeddings on another device are
//!   staged through host memory (the copies are differentiable) and counted
//!   (`tiled_paths().ring_staged`).

use allgrad_dist::{Elem as DistElem, ProcessGroup, RingMessage, RingPass, RingSchedule, RingSetting};
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use super::loss::clip_scale;
use crate::losses::l2_normalize;
use crate::tiled::{dot_grads, dot_lse, KernelElem};

/// How a ring loss runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingOptions {
    /// Blocks travel both ways (about W/2 steps) rather than one way (W − 1 steps). Every
    /// rank must agree.
    pub bidirectional: bool,
    /// Score each received block in `tile x tile` blocks (`None`: the whole `b x b_k` block at
    /// once, still independent of W).
    pub tile: Option<usize>,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions { bidirectional: true, tile: None }
    }
}

/// The loss a ring runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Clip,
    Siglip,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Clip => "clip_ring",
            Kind::Siglip => "siglip_ring",
        }
    }
    /// Payload width in units of `d`: CLIP's blocks are images then texts, SigLIP's texts.
    fn width(self) -> usize {
        match self {
            Kind::Clip => 2,
            Kind::Siglip => 1,
        }
    }
}

fn check(loss: &str, images: &Tensor, texts: &Tensor, opts: &RingOptions) -> Result<()> {
    if images.rank() != 2 || images.dims() != texts.dims() {
        candle_core::bail!(
            "{loss}: image embeddings {:?} and text embeddings {:?} must be [b, d] of one shape",
            images.dims(),
            texts.dims()
        );
    }
    if opts.tile == Some(0) {
        candle_core::bail!("{loss}: the tile must be at least 1");
    }
    Ok(())
}

/// CLIP's symmetric InfoNCE ([`super::clip_loss`]: the same value and gradients) in the ring
/// form: `(W / 2B) Σ_{i local} (ℓ^{image→text}_i + ℓ^{text→image}_i)`, with logits
/// `exp(min(s, ln 100)) · cos`; see the module docs for what it keeps.
pub fn clip_loss_ring(
    images: &Tensor,
    texts: &Tensor,
    logit_scale: &Tensor,
    opts: RingOptions,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("clip_loss_ring", images, texts, &opts)?;
    on_host(&[images, texts, logit_scale], |t| {
        let (img, txt) = (l2_normalize(t[0])?, l2_normalize(t[1])?);
        let scale = clip_scale(t[2])?.to_dtype(img.dtype())?.reshape(1)?;
        apply(Kind::Clip, &img, &txt, &scale, opts, pg)
    })
}

/// SigLIP's sigmoid loss ([`super::siglip_loss`]: the same value and gradients) in the ring
/// form: `−(W / B) Σ_{i local} Σ_{j global} log σ(y_ij z_ij)`, `z = exp(t') · cos + b`; see the
/// module docs for what it keeps.
pub fn siglip_loss_ring(
    images: &Tensor,
    texts: &Tensor,
    logit_scale: &Tensor,
    logit_bias: &Tensor,
    opts: RingOptions,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("siglip_loss_ring", images, texts, &opts)?;
    on_host(&[images, texts, logit_scale, logit_bias], |t| {
        let (img, txt) = (l2_normalize(t[0])?, l2_normalize(t[1])?);
        let scale = t[2].flatten_all()?.exp()?.to_dtype(img.dtype())?;
        let bias = t[3].flatten_all()?.to_dtype(img.dtype())?;
        let params = Tensor::cat(&[&scale, &bias], 0)?;
        apply(Kind::Siglip, &img, &txt, &params, opts, pg)
    })
}

/// Runs `f` on host copies of tensors that live elsewhere (differentiable copies), its result
/// copied back to their device.
fn on_host(ts: &[&Tensor], f: impl FnOnce(&[&Tensor]) -> Result<Tensor>) -> Result<Tensor> {
    let dev = ts[0].device().clone();
    if dev.is_cpu() {
        return f(ts);
    }
    crate::trace::count(|c| c.ring_staged += 1);
    let host: Vec<Tensor> = ts.iter().map(|t| t.to_device(&Device::Cpu)).collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = host.iter().collect();
    f(&refs)?.to_device(&dev)
}

/// The op's forward, run now (a ring pass), and the op holding its value.
fn apply(kind: Kind, img: &Tensor, txt: &Tensor, params: &Tensor, opts: RingOptions, pg: &ProcessGroup) -> Result<Tensor> {
    let op = match img.dtype() {
        DType::F32 => RingLoss::forward::<f32>(kind, img, txt, params, opts, pg)?,
        DType::F64 => RingLoss::forward::<f64>(kind, img, txt, params, opts, pg)?,
        other => candle_core::bail!("{}: the ring takes f32 or f64 embeddings, got {other:?}", kind.name()),
    };
    img.apply_op3(txt, params, op)
}

/// The settings every rank of a pass must share.
fn settings(kind: Kind, opts: &RingOptions, d: usize, dtype: DType, backward: bool) -> [RingSetting; 5] {
    [
        RingSetting { name: "the loss (clip_ring or siglip_ring)", value: kind as u64 },
        RingSetting { name: "bidirectional", value: opts.bidirectional as u64 },
        RingSetting { name: "the embedding width d", value: d as u64 },
        RingSetting { name: "the dtype (f32 or f64)", value: (dtype == DType::F64) as u64 },
        RingSetting { name: "the pass (forward or backward: a rank in another step?)", value: backward as u64 },
    ]
}

fn host<T: KernelElem>(t: &Tensor) -> Result<Vec<T>> {
    t.detach().flatten_all()?.to_vec1::<T>()
}

/// `a ← log(e^a + e^b)` elementwise (`−∞` on either side is the other).
fn log_add_exp<T: KernelElem>(a: &mut [T], b: &[T]) {
    for (x, y) in a.iter_mut().zip(b) {
        let (u, v) = (x.to_f64(), y.to_f64());
        let r = if u == f64::NEG_INFINITY {
            v
        } else if v == f64::NEG_INFINITY {
            u
        } else {
            let m = u.max(v);
            m + ((u - m).exp() + (v - m).exp()).ln()
        };
        *x = T::from_f64(r);
    }
}

fn add_into<T: KernelElem>(acc: &mut [T], x: &[T]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a = T::from_f64(a.to_f64() + b.to_f64());
    }
}

/// The op: its value, and what the backward needs besides its inputs.
struct RingLoss {
    kind: Kind,
    opts: RingOptions,
    pg: ProcessGroup,
    value: Tensor,
    /// CLIP: each local row's log-sum-exp, images against every text then texts against
    /// every image (`[2b]`, the run's dtype).
    lse: Option<Tensor>,
    /// `W / 2B` (CLIP) or `W / B` (SigLIP).
    factor: f64,
}

/// One rank's side of a pass: its rows, the schedule, the pass.
struct Ring<'a, T> {
    pass: RingPass,
    sched: RingSchedule,
    me: usize,
    own: &'a [T],
}

impl<T: KernelElem + DistElem + Send + Sync> Ring<'_, T> {
    fn len(&self, origin: usize) -> usize {
        self.pass.len_of(origin)
    }

    /// Visits every rank's block once, its own first: the exchange of step s runs while the
    /// block(s) of step s − 1 are visited.
    fn forward(&self, mut visit: impl FnMut(usize, &[T]) -> Result<()>) -> Result<()> {
        let (steps, down_steps, me) = (self.sched.steps(), self.sched.steps_down(), self.me);
        let mut cur_up = self.own.to_vec();
        let mut cur_down = if down_steps > 0 { self.own.to_vec() } else { Vec::new() };
        for s in 1..=steps {
            let down = s <= down_steps;
            let o_up = self.sched.origin(me, s, false);
            let o_down = self.sched.origin(me, s, true);
            let mut next_up = vec![T::from_f64(0.0); self.len(o_up)];
            let mut next_down = if down { vec![T::from_f64(0.0); self.len(o_down)] } else { Vec::new() };
            let mut sends = vec![RingMessage {
                peer: self.sched.next(me, false),
                origin: self.sched.origin(me, s - 1, false),
                data: &cur_up[..],
            }];
            if down {
                sends.push(RingMessage {
                    peer: self.sched.next(me, true),
                    origin: self.sched.origin(me, s - 1, true),
                    data: &cur_down[..],
                });
            }
            let mut recvs = vec![RingMessage { peer: self.sched.prev(me, false), origin: o_up, data: &mut next_up[..] }];
            if down {
                recvs.push(RingMessage { peer: self.sched.prev(me, true), origin: o_down, data: &mut next_down[..] });
            }
            let prev_down = s >= 2 && s - 1 <= down_steps;
            self.pass.exchange(&sends, &mut recvs, || -> Result<()> {
                visit(self.sched.origin(me, s - 1, false), &cur_up)?;
                if prev_down {
                    visit(self.sched.origin(me, s - 1, true), &cur_down)?;
                }
                Ok(())
            })??;
            drop(sends);
            drop(recvs);
            cur_up = next_up;
            if down {
                cur_down = next_down;
            }
        }
        if steps >= 1 {
            visit(self.sched.origin(me, steps, false), &cur_up)?;
            if steps <= down_steps {
                visit(self.sched.origin(me, steps, true), &cur_down)?;
            }
        } else {
            visit(me, self.own)?;
        }
        Ok(())
    }

    /// Visits every rank's block again; `visit` returns the gradient this rank's loss gives a
    /// foreign block (`None` for its own, which it keeps itself). Each such gradient goes back
    /// to the block's owner in the exchange after the next one, while later blocks are
    /// scored; the gradients other ranks send for this rank's block are added to `own_grad`
    /// in a fixed order (by step, up then down).
    fn backward(&self, own_grad: &mut [T], mut visit: impl FnMut(usize, &[T]) -> Result<Option<Vec<T>>>) -> Result<()> {
        let (steps, down_steps, me, w) = (self.sched.steps(), self.sched.steps_down(), self.me, self.sched.world);
        let mut cur_up = self.own.to_vec();
        let mut cur_down = if down_steps > 0 { self.own.to_vec() } else { Vec::new() };
        // Gradients of the blocks visited at the step before last, waiting to go home.
        let mut pending: Vec<(usize, Vec<T>)> = Vec::new();
        for s in 1..=steps + 2 {
            let blocks = s <= steps;
            let down = s <= down_steps;
            let (o_up, o_down) = (self.sched.origin(me, s, false), self.sched.origin(me, s, true));
            let mut next_up = if blocks { vec![T::from_f64(0.0); self.len(o_up)] } else { Vec::new() };
            let mut next_down = if down { vec![T::from_f64(0.0); self.len(o_down)] } else { Vec::new() };
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            if blocks {
                sends.push(RingMessage {
                    peer: self.sched.next(me, false),
                    origin: self.sched.origin(me, s - 1, false),
                    data: &cur_up[..],
                });
            }
            if down {
                sends.push(RingMessage {
                    peer: self.sched.next(me, true),
                    origin: self.sched.origin(me, s - 1, true),
                    data: &cur_down[..],
                });
            }
            for (origin, g) in &pending {
                sends.push(RingMessage { peer: *origin, origin: *origin, data: &g[..] });
            }
            if blocks {
                recvs.push(RingMessage { peer: self.sched.prev(me, false), origin: o_up, data: &mut next_up[..] });
            }
            if down {
                recvs.push(RingMessage { peer: self.sched.prev(me, true), origin: o_down, data: &mut next_down[..] });
            }
            // The gradients of this rank's block from the ranks that visited it at step s − 2.
            let t = s.wrapping_sub(2);
            let mut home: Vec<Vec<T>> = Vec::new();
            let mut from: Vec<usize> = Vec::new();
            if s >= 3 && t <= steps {
                from.push((me + t) % w);
                if t <= down_steps {
                    from.push((me + w - t % w) % w);
                }
            }
            for _ in &from {
                home.push(vec![T::from_f64(0.0); self.len(me)]);
            }
            for (peer, buf) in from.iter().zip(home.iter_mut()) {
                recvs.push(RingMessage { peer: *peer, origin: me, data: &mut buf[..] });
            }
            let visiting = s - 1 <= steps;
            let prev_down = s >= 2 && s - 1 <= down_steps;
            let fresh = self.pass.exchange(&sends, &mut recvs, || -> Result<Vec<(usize, Vec<T>)>> {
                let mut out = Vec::new();
                if !visiting {
                    return Ok(out);
                }
                if s == 1 {
                    visit(me, self.own)?;
                    return Ok(out);
                }
                let o = self.sched.origin(me, s - 1, false);
                if let Some(g) = visit(o, &cur_up)? {
                    out.push((o, g));
                }
                if prev_down {
                    let o = self.sched.origin(me, s - 1, true);
                    if let Some(g) = visit(o, &cur_down)? {
                        out.push((o, g));
                    }
                }
                Ok(out)
            })??;
            drop(sends);
            drop(recvs);
            for g in &home {
                add_into(own_grad, g);
            }
            pending = fresh;
            if blocks {
                cur_up = next_up;
            }
            if down {
                cur_down = next_down;
            }
        }
        if steps == 0 && w == 1 {
            debug_assert!(pending.is_empty());
        }
        Ok(())
    }
}

impl RingLoss {
    /// Runs the forward ring and returns the op holding the loss.
    fn forward<T: KernelElem + DistElem + Send + Sync>(
        kind: Kind,
        img: &Tensor,
        txt: &Tensor,
        params: &Tensor,
        opts: RingOptions,
        pg: &ProcessGroup,
    ) -> Result<RingLoss> {
        crate::trace::count(|c| c.ring_forward += 1);
        let (b, d) = img.dims2()?;
        let (img_h, txt_h, p) = (host::<T>(img)?, host::<T>(txt)?, host::<f64>(&params.to_dtype(DType::F64)?)?);
        let own: Vec<T> = match kind {
            Kind::Clip => [&img_h[..], &txt_h[..]].concat(),
            Kind::Siglip => txt_h.clone(),
        };
        let pass = pg.ring_pass(
            &format!("{} forward", kind.name()),
            b,
            kind.width() * d,
            &settings(kind, &opts, d, img.dtype(), false),
        )?;
        let total: usize = pass.rows().iter().sum();
        let w = pg.world_size();
        let sched = RingSchedule { world: w, bidirectional: opts.bidirectional };
        let ring = Ring { pass, sched, me: pg.rank(), own: &own };
        let tile_for = |n: usize| opts.tile.unwrap_or(b.max(n)).max(1);
        let (value, lse, factor) = match kind {
            Kind::Clip => {
                let scale = p[0];
                let mut i2t = vec![T::from_f64(f64::NEG_INFINITY); b];
                let mut t2i = i2t.clone();
                ring.forward(|origin, block| {
                    let n = ring.pass.rows()[origin];
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    let (oi, ot) = block.split_at(n * d);
                    log_add_exp(&mut i2t, &dot_lse(&img_h, ot, (b, n, d), scale, tile_for(n))?);
                    log_add_exp(&mut t2i, &dot_lse(&txt_h, oi, (b, n, d), scale, tile_for(n))?);
                    Ok(())
                })?;
                let mut sum = 0f64;
                for i in 0..b {
                    let pos: f64 = (0..d).map(|j| img_h[i * d + j].to_f64() * txt_h[i * d + j].to_f64()).sum::<f64>() * scale;
                    sum += i2t[i].to_f64() + t2i[i].to_f64() - 2.0 * pos;
                }
                let factor = w as f64 / (2.0 * total as f64);
                let lse = Tensor::from_vec([i2t, t2i].concat(), 2 * b, &Device::Cpu)?;
                (sum * factor, Some(lse), factor)
            }
            Kind::Siglip => {
                let (t, bias) = (p[0], p[1]);
                let q = Tensor::from_slice(&img_h, (b, d), &Device::Cpu)?;
                let mut sum = 0f64;
                ring.forward(|origin, block| {
                    let n = ring.pass.rows()[origin];
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    let k = Tensor::from_slice(block, (n, d), &Device::Cpu)?;
                    sum += sigmoid_block(&q, &k, t, bias, tile_for(n), None)?.0;
                    if origin == ring.me {
                        // The positives: log σ(z) − log σ(−z) = z on the diagonal.
                        sum -= (0..b).map(|i| t * dot(&img_h, &txt_h, i, d) + bias).sum::<f64>();
                    }
                    Ok(())
                })?;
                let factor = w as f64 / total as f64;
                (sum * factor, None, factor)
            }
        };
        let value = Tensor::new(value, &Device::Cpu)?.to_dtype(img.dtype())?;
        Ok(RingLoss { kind, opts, pg: pg.clone(), value, lse, factor })
    }

    fn backward<T: KernelElem + DistElem + Send + Sync>(
        &self,
        img: &Tensor,
        txt: &Tensor,
        params: &Tensor,
        g: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        crate::trace::count(|c| c.ring_backward += 1);
        let kind = self.kind;
        let (b, d) = img.dims2()?;
        let (img_h, txt_h, p) = (host::<T>(img)?, host::<T>(txt)?, host::<f64>(&params.to_dtype(DType::F64)?)?);
        let own: Vec<T> = match kind {
            Kind::Clip => [&img_h[..], &txt_h[..]].concat(),
            Kind::Siglip => txt_h.clone(),
        };
        let pg = &self.pg;
        let pass = pg.ring_pass(
            &format!("{} backward", kind.name()),
            b,
            kind.width() * d,
            &settings(kind, &self.opts, d, img.dtype(), true),
        )?;
        let sched = RingSchedule { world: pg.world_size(), bidirectional: self.opts.bidirectional };
        let ring = Ring { pass, sched, me: pg.rank(), own: &own };
        let tile_for = |n: usize| self.opts.tile.unwrap_or(b.max(n)).max(1);
        let g = g * self.factor;
        let zero = T::from_f64(0.0);
        // Gradients of this rank's rows as queries, and of its block as keys (own_grad).
        let mut d_img = vec![zero; b * d];
        let mut d_txt = vec![zero; b * d];
        let mut own_grad = vec![zero; own.len()];
        let mut d_params = vec![0f64; p.len()];
        match kind {
            Kind::Clip => {
                let scale = p[0];
                let lse = host::<T>(self.lse.as_ref().expect("the CLIP ring keeps its log-sum-exps"))?;
                let (l_i2t, l_t2i) = lse.split_at(b);
                let mut own_keys = vec![zero; own.len()];
                ring.backward(&mut own_grad, |origin, block| {
                    let n = ring.pass.rows()[origin];
                    let mine = origin == ring.me;
                    if n == 0 || b == 0 {
                        return Ok(if mine { None } else { Some(vec![zero; 2 * n * d]) });
                    }
                    let (oi, ot) = block.split_at(n * d);
                    let (dq, dk_txt, s1) = dot_grads(&img_h, ot, (b, n, d), scale, tile_for(n), mine, l_i2t, g)?;
                    let (dq2, dk_img, s2) = dot_grads(&txt_h, oi, (b, n, d), scale, tile_for(n), mine, l_t2i, g)?;
                    add_into(&mut d_img, &dq);
                    add_into(&mut d_txt, &dq2);
                    // s = raw · scale: ∂s/∂scale = s / scale.
                    d_params[0] += (s1 + s2) / scale;
                    let contribution = [dk_img, dk_txt].concat();
                    if mine {
                        add_into(&mut own_keys, &contribution);
                        Ok(None)
                    } else {
                        Ok(Some(contribution))
                    }
                })?;
                add_into(&mut own_grad, &own_keys);
                add_into(&mut d_img, &own_grad[..b * d]);
                add_into(&mut d_txt, &own_grad[b * d..]);
            }
            Kind::Siglip => {
                let (t, bias) = (p[0], p[1]);
                let q = Tensor::from_slice(&img_h, (b, d), &Device::Cpu)?;
                let mut own_keys = vec![zero; own.len()];
                ring.backward(&mut own_grad, |origin, block| {
                    let n = ring.pass.rows()[origin];
                    let mine = origin == ring.me;
                    if n == 0 || b == 0 {
                        return Ok(if mine { None } else { Some(vec![zero; n * d]) });
                    }
                    let k = Tensor::from_slice(block, (n, d), &Device::Cpu)?;
                    let (_, grads) = sigmoid_block(&q, &k, t, bias, tile_for(n), Some(g))?;
                    let (dq, dk, dt, db) = grads.expect("asked for gradients");
                    add_into(&mut d_img, &host::<T>(&dq)?);
                    d_params[0] += dt;
                    d_params[1] += db;
                    let mut dk = host::<T>(&dk)?;
                    if mine {
                        // The positives' − z_ii: ∂/∂img_i = −t txt_i, ∂/∂txt_i = −t img_i.
                        for i in 0..b {
                            for x in i * d..(i + 1) * d {
                                d_img[x] = T::from_f64(d_img[x].to_f64() - g * t * txt_h[x].to_f64());
                                dk[x] = T::from_f64(dk[x].to_f64() - g * t * img_h[x].to_f64());
                            }
                            d_params[0] -= g * dot(&img_h, &txt_h, i, d);
                        }
                        d_params[1] -= g * b as f64;
                        add_into(&mut own_keys, &dk);
                        Ok(None)
                    } else {
                        Ok(Some(dk))
                    }
                })?;
                add_into(&mut own_grad, &own_keys);
                add_into(&mut d_txt, &own_grad);
            }
        }
        let dev = Device::Cpu;
        let d_params = Tensor::from_vec(d_params, p.len(), &dev)?.to_dtype(params.dtype())?.reshape(params.shape())?;
        Ok((Tensor::from_vec(d_img, (b, d), &dev)?, Tensor::from_vec(d_txt, (b, d), &dev)?, d_params))
    }
}

fn dot<T: KernelElem>(a: &[T], b: &[T], i: usize, d: usize) -> f64 {
    (0..d).map(|j| a[i * d + j].to_f64() * b[i * d + j].to_f64()).sum()
}

/// Gradients of a SigLIP block: queries, keys, `∂/∂t`, `∂/∂bias`.
type SigmoidGrads = Option<(Tensor, Tensor, f64, f64)>;

/// `Σ softplus(z)` over the block, `z = t · q·kᵀ + bias`, in `tile x tile` blocks (the
/// negatives' `−log σ(−z)`; the caller subtracts the positives' `z`), and with `g` its
/// gradients: `∂z = g σ(z)`.
fn sigmoid_block(q: &Tensor, k: &Tensor, t: f64, bias: f64, tile: usize, g: Option<f64>) -> Result<(f64, SigmoidGrads)> {
    let (m, n) = (q.dim(0)?, k.dim(0)?);
    let mut sum = 0f64;
    let (mut dq_rows, mut dk_parts): (Vec<Tensor>, Vec<Option<Tensor>>) = (Vec::new(), vec![None; n.div_ceil(tile)]);
    let (mut dt, mut db) = (0f64, 0f64);
    for r0 in (0..m).step_by(tile) {
        let qi = q.narrow(0, r0, tile.min(m - r0))?;
        let mut dqi: Option<Tensor> = None;
        for (j, c0) in (0..n).step_by(tile).enumerate() {
            let kj = k.narrow(0, c0, tile.min(n - c0))?;
            let raw = qi.matmul(&kj.t()?)?;
            let z = raw.affine(t, bias)?;
            match g {
                None => {
                    // softplus(z) = max(z, 0) + log(1 + e^−|z|).
                    let sp = (z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
                    sum += sp.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                }
                Some(g) => {
                    // σ(z) = 1 / (1 + e^−z); e^−z = ∞ gives 0.
                    let dz = ((z.neg()?.exp()? + 1.0)?.recip()? * g)?;
                    dt += (&dz * &raw)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                    db += dz.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                    let gq = (dz.matmul(&kj)? * t)?;
                    let gk = (dz.t()?.matmul(&qi)? * t)?;
                    dqi = Some(match dqi {
                        Some(a) => (a + gq)?,
                        None => gq,
                    });
                    dk_parts[j] = Some(match dk_parts[j].take() {
                        Some(a) => (a + gk)?,
                        None => gk,
                    });
                }
            }
        }
        if let Some(d) = dqi {
            dq_rows.push(d);
        }
    }
    if g.is_none() {
        return Ok((sum, None));
    }
    let dq = Tensor::cat(&dq_rows, 0)?;
    let dk_parts: Vec<Tensor> = dk_parts.into_iter().flatten().collect();
    let dk = Tensor::cat(&dk_parts, 0)?;
    Ok((0.0, Some((dq, dk, dt, db))))
}

impl CustomOp3 for RingLoss {
    fn name(&self) -> &'static str {
        "allgrad.ring_loss"
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
        let (storage, layout) = self.value.storage_and_layout();
        match storage.try_clone(layout)? {
            candle_core::Storage::Cpu(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("{}: the loss was computed off the host", self.kind.name()),
        }
    }

    fn bwd(
        &self,
        img: &Tensor,
        txt: &Tensor,
        params: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?[0];
        let (di, dt, dp) = match img.dtype() {
            DType::F32 => self.backward::<f32>(img, txt, params, g)?,
            DType::F64 => self.backward::<f64>(img, txt, params, g)?,
            other => candle_core::bail!("{}: the ring takes f32 or f64 embeddings, got {other:?}", self.kind.name()),
        };
        Ok((Some(di), Some(dt), Some(dp)))
    }
}
