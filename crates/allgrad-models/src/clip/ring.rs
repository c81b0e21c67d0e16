//! The ring losses: CLIP's symmetric InfoNCE and SigLIP's sigmoid loss over the global batch,
//! with memory that does not grow with the number of ranks.
//!
//! Each rank keeps only its own `b x d` blocks (normalised image and text embeddings) and, for
//! CLIP, each of its rows' log-sum-exp in both directions: never a received block or its
//! logits as a node of Candle's graph. The loss is one custom op whose forward runs a ring
//! ([`allgrad_dist::RingPass`]): every other rank's block arrives in turn, in chunks of at most
//! [`CHUNK_BYTES`], each scored against this rank's rows (in `tile x tile` blocks with
//! `loss.tile`) and dropped. Its backward runs the ring again: each chunk is received and
//! scored again, this rank's rows take their gradient from it, and the chunk's own gradient
//! (what this rank's loss contributes to it) is sent back to the rank that owns it, one
//! exchange later, while the next chunk is scored. Blocks go straight from their owner to each
//! rank that visits them (at step s rank r sends its chunks to r + s, and to r − s going the
//! other way), so no rank keeps another's block to pass it on. The loss's memory per rank is
//! `O(b·d + chunk·d + tile²)`: its own blocks and their gradients, at most ten chunks in flight
//! (both ways, in the backward: the chunks arriving and being scored, the gradients being
//! computed, going home and coming home), one tile of logits per worker thread — whatever W is.
//!
//! - **Exact**: the same sums as the gather forms ([`super::clip_loss`], [`super::siglip_loss`]),
//!   in another order: equal to rounding (f64: relative 1e-10 in the tests), W-invariant by
//!   the sum rule (each rank's op returns the gradient of the sum of every rank's loss with
//!   respect to its own blocks).
//! - **Exchanges**: the blocks travel both ways by default (about W/2 steps; one way: W − 1),
//!   one exchange per step and chunk; each exchange runs on a communication thread while the
//!   calling thread scores the chunks that arrived at the exchange before, received in place. One check across the group per pass (forward
//!   and backward each): the ranks' settings and block sizes; then only point-to-point
//!   messages whose sizes are known.
//! - **Devices**: CUDA embeddings in a group whose collectives go through NCCL take the ring's
//!   tensor form (`ring_tensors.rs`): the same schedule and chunks, scored with Candle ops on
//!   the GPU, each exchange grouped NCCL sends and receives on a stream of its own beside the
//!   compute stream, no host read or wait inside a pass. Elsewhere the ring runs on the host
//!   (f32 or f64): embeddings on another device are staged through host memory (the copies
//!   are differentiable) and counted (`tiled_paths().ring_staged`).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use allgrad_dist::{Elem as DistElem, ProcessGroup, RingMessage, RingPass, RingSchedule, RingSetting};
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use super::loss::clip_scale;
use super::ring_tensors::{self, OpenPass, TensorLoss};
use crate::losses::l2_normalize;
use crate::tiled::{dot_grads, dot_lse, host_gemm, KernelElem};

/// How a ring loss runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingOptions {
    /// Blocks travel both ways (about W/2 steps) rather than one way (W − 1 steps). Every
    /// rank must agree.
    pub bidirectional: bool,
    /// Score each received chunk in `tile x tile` blocks (`None`: the whole `b x chunk` block
    /// at once, still independent of W).
    pub tile: Option<usize>,
    /// Rows of a block per message (`None`: as many as fit in [`CHUNK_BYTES`]). What a rank
    /// holds of other ranks' blocks at once is a few chunks (at most ten, in the backward of
    /// a ring both ways), whatever W and the batch are. Every rank must agree.
    pub chunk: Option<usize>,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions { bidirectional: true, tile: None, chunk: None }
    }
}

/// The most bytes of a block one message carries unless [`RingOptions::chunk`] says otherwise:
/// 256 KiB (64 rows of CLIP's images and texts at d = 512 in f32, 128 of SigLIP's texts).
/// Small beside a rank's own blocks at the batch sizes rings are for (the chunks in flight,
/// at most ten, stay under the loss's heap peak at local batch 1,024: docs/performance.md),
/// large enough that a chunk's scoring (a `b x chunk` GEMM) stays efficient: at 32 rows the
/// CLIP ring took 1.23-1.37x the gather's step at W = 2-4, at 64 rows 0.88-0.94x at W = 2-8.
pub const CHUNK_BYTES: usize = 256 << 10;

/// The rows per message of a pass.
fn chunk_rows<T>(kind: Kind, opts: &RingOptions, d: usize) -> usize {
    opts.chunk.unwrap_or_else(|| CHUNK_BYTES / (kind.width() * d.max(1) * std::mem::size_of::<T>())).max(1)
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
    if opts.chunk == Some(0) {
        candle_core::bail!("{loss}: a chunk must hold at least 1 row");
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
    if pg.ring_on_nccl(images.device())? {
        return clip_loss_ring_tensors(images, texts, logit_scale, opts, pg);
    }
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
    if pg.ring_on_nccl(images.device())? {
        return siglip_loss_ring_tensors(images, texts, logit_scale, logit_bias, opts, pg);
    }
    on_host(&[images, texts, logit_scale, logit_bias], |t| {
        let (img, txt) = (l2_normalize(t[0])?, l2_normalize(t[1])?);
        let scale = t[2].flatten_all()?.exp()?.to_dtype(img.dtype())?;
        let bias = t[3].flatten_all()?.to_dtype(img.dtype())?;
        let params = Tensor::cat(&[&scale, &bias], 0)?;
        apply(Kind::Siglip, &img, &txt, &params, opts, pg)
    })
}

/// [`clip_loss_ring`] scored with Candle ops on the embeddings' device (`ring_tensors.rs`):
/// what it runs for CUDA embeddings whose group exchanges through NCCL; on other devices the
/// same arithmetic with the exchanges through the host path (the tests hold it to the host
/// ring there). Every rank must take the same form (a setting of the pass).
#[doc(hidden)]
pub fn clip_loss_ring_tensors(
    images: &Tensor,
    texts: &Tensor,
    logit_scale: &Tensor,
    opts: RingOptions,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("clip_loss_ring", images, texts, &opts)?;
    let (img, txt) = (l2_normalize(images)?, l2_normalize(texts)?);
    let scale = clip_scale(logit_scale)?.to_dtype(img.dtype())?.reshape(1)?;
    let open = opener(Kind::Clip, &img, opts, pg)?;
    ring_tensors::apply(TensorLoss::Clip, &img, &txt, &scale, opts.bidirectional, opts.tile, open, pg)
}

/// [`siglip_loss_ring`] scored with Candle ops on the embeddings' device (see
/// [`clip_loss_ring_tensors`]).
#[doc(hidden)]
pub fn siglip_loss_ring_tensors(
    images: &Tensor,
    texts: &Tensor,
    logit_scale: &Tensor,
    logit_bias: &Tensor,
    opts: RingOptions,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("siglip_loss_ring", images, texts, &opts)?;
    let (img, txt) = (l2_normalize(images)?, l2_normalize(texts)?);
    let scale = logit_scale.flatten_all()?.exp()?.to_dtype(img.dtype())?;
    let bias = logit_bias.flatten_all()?.to_dtype(img.dtype())?;
    let params = Tensor::cat(&[&scale, &bias], 0)?;
    let open = opener(Kind::Siglip, &img, opts, pg)?;
    ring_tensors::apply(TensorLoss::Siglip, &img, &txt, &params, opts.bidirectional, opts.tile, open, pg)
}

/// How the tensor form opens its passes: the same sizes and settings as the host form's, the
/// path (tensors) among them.
fn opener(kind: Kind, img: &Tensor, opts: RingOptions, pg: &ProcessGroup) -> Result<OpenPass> {
    let (b, d) = img.dims2()?;
    let dtype = img.dtype();
    let rows = match dtype {
        DType::F32 => chunk_rows::<f32>(kind, &opts, d),
        DType::F64 => chunk_rows::<f64>(kind, &opts, d),
        other => candle_core::bail!("{}: the ring takes f32 or f64 embeddings, got {other:?}", kind.name()),
    };
    let pg = pg.clone();
    Ok(Arc::new(move |backward: bool| {
        let pass = if backward { "backward" } else { "forward" };
        Ok(pg.ring_pass(
            &format!("{} {pass}", kind.name()),
            b,
            kind.width() * d,
            rows,
            &settings(kind, &opts, d, dtype, backward, true),
        )?)
    }))
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
fn settings(kind: Kind, opts: &RingOptions, d: usize, dtype: DType, backward: bool, tensors: bool) -> [RingSetting; 6] {
    [
        RingSetting { name: "the loss (clip_ring or siglip_ring)", value: kind as u64 },
        RingSetting { name: "bidirectional", value: opts.bidirectional as u64 },
        RingSetting { name: "the embedding width d", value: d as u64 },
        RingSetting { name: "the dtype (f32 or f64)", value: (dtype == DType::F64) as u64 },
        RingSetting { name: "the pass (forward or backward: a rank in another step?)", value: backward as u64 },
        RingSetting {
            name: "the ring's form (on host slices, or on tensors: CUDA embeddings through NCCL)",
            value: tensors as u64,
        },
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

/// This rank's block as its messages carry it: chunk `k` is its rows `k·c .. (k + 1)·c` of
/// each part, one part after the other (CLIP: images then texts; SigLIP: texts).
struct Own<'a, T> {
    parts: Vec<&'a [T]>,
    d: usize,
}

impl<T: Copy> Own<'_, T> {
    fn chunk(&self, rows: Range<usize>) -> Vec<T> {
        let mut out = Vec::with_capacity(rows.len() * self.d * self.parts.len());
        for p in &self.parts {
            out.extend_from_slice(&p[rows.start * self.d..rows.end * self.d]);
        }
        out
    }
}

/// A chunk on its way: whose block, which chunk, its elements (the chunk, or its gradient).
type Chunk<T> = (usize, usize, Vec<T>);

/// One rank's side of a pass: its block, the schedule, the pass.
struct Ring<'a, T> {
    pass: RingPass,
    sched: RingSchedule,
    me: usize,
    own: Own<'a, T>,
}

impl<T: KernelElem + DistElem + Send + Sync> Ring<'_, T> {
    /// This rank's chunk `k` (empty past its rows).
    fn own_chunk(&self, k: usize) -> Vec<T> {
        self.own.chunk(self.pass.chunk_range(self.me, k))
    }

    /// What exchange `e` moves of the blocks: this rank's chunk, which goes straight to the
    /// step's visitors (up, then down), and buffers for the chunks of the step's origins.
    fn moves<'b>(&self, e: usize, mine: &'b [T]) -> (Vec<RingMessage<&'b [T]>>, Vec<Chunk<T>>) {
        let (s, k) = self.sched.slot(e, self.pass.chunks());
        let dirs = self.sched.directions(s);
        let sends = if mine.is_empty() {
            Vec::new()
        } else {
            dirs.iter()
                .map(|&down| RingMessage { peer: self.sched.visitor(self.me, s, down), origin: self.me, chunk: k, data: mine })
                .collect()
        };
        let next = dirs
            .iter()
            .map(|&down| self.sched.origin(self.me, s, down))
            .filter(|&o| self.pass.chunk_len(o, k) > 0)
            .map(|o| (o, k, vec![T::from_f64(0.0); self.pass.chunk_len(o, k)]))
            .collect();
        (sends, next)
    }

    /// Visits every chunk of every rank's block once, its own during the first step: the
    /// exchange that brings a chunk runs while the chunks of the exchange before are visited.
    fn forward(&self, mut visit: impl FnMut(usize, usize, &[T]) -> Result<()>) -> Result<()> {
        let me = self.me;
        if self.sched.exchanges(self.pass.chunks()) == 0 {
            for k in 0..self.pass.chunks() {
                let mine = self.own_chunk(k);
                if !mine.is_empty() {
                    visit(me, k, &mine)?;
                }
            }
            return Ok(());
        }
        let mut prev: Vec<Chunk<T>> = Vec::new();
        for e in 0..self.sched.exchanges(self.pass.chunks()) {
            let (s, k) = self.sched.slot(e, self.pass.chunks());
            let mine = self.own_chunk(k);
            let (sends, mut next) = self.moves(e, &mine);
            let mut recvs: Vec<RingMessage<&mut [T]>> =
                next.iter_mut().map(|(o, k, buf)| RingMessage { peer: *o, origin: *o, chunk: *k, data: &mut buf[..] }).collect();
            self.pass.exchange(&sends, &mut recvs, || -> Result<()> {
                if s == 1 && !mine.is_empty() {
                    visit(me, k, &mine)?;
                }
                for (o, k, chunk) in &prev {
                    visit(*o, *k, chunk)?;
                }
                Ok(())
            })??;
            drop(recvs);
            prev = next;
        }
        for (o, k, chunk) in &prev {
            visit(*o, *k, chunk)?;
        }
        Ok(())
    }

    /// Visits every chunk again; `visit` returns the gradient this rank's loss gives a foreign
    /// chunk (`None` for its own, whose gradient it keeps itself). Each such gradient goes back
    /// to the chunk's owner in the exchange after the next one, while later chunks are scored;
    /// the gradients other ranks send for this rank's chunks are given to `home` in a fixed
    /// order (by exchange, up then down).
    fn backward(
        &self,
        mut visit: impl FnMut(usize, usize, &[T]) -> Result<Option<Vec<T>>>,
        mut home: impl FnMut(usize, &[T]),
    ) -> Result<()> {
        let me = self.me;
        let n = self.sched.exchanges(self.pass.chunks());
        if n == 0 {
            for k in 0..self.pass.chunks() {
                let mine = self.own_chunk(k);
                if !mine.is_empty() {
                    visit(me, k, &mine)?;
                }
            }
            return Ok(());
        }
        // Chunks received at the exchange before, visited during this one.
        let mut prev: Vec<Chunk<T>> = Vec::new();
        // Their gradients, computed during the exchange before, sent home during this one.
        let mut pending: Vec<Chunk<T>> = Vec::new();
        for e in 0..n + 2 {
            let moving = e < n;
            let (s, k) = if moving { self.sched.slot(e, self.pass.chunks()) } else { (0, 0) };
            let mine = if moving { self.own_chunk(k) } else { Vec::new() };
            let (mut sends, mut next) = if moving { self.moves(e, &mine) } else { (Vec::new(), Vec::new()) };
            for (o, k, g) in &pending {
                sends.push(RingMessage { peer: *o, origin: *o, chunk: *k, data: &g[..] });
            }
            // The gradients of this rank's chunk sent two exchanges ago, from its visitors.
            let mut back: Vec<Chunk<T>> = Vec::new();
            if e >= 2 {
                let (s2, k2) = self.sched.slot(e - 2, self.pass.chunks());
                let len = self.pass.chunk_len(me, k2);
                if len > 0 {
                    for &down in self.sched.directions(s2) {
                        back.push((self.sched.visitor(me, s2, down), k2, vec![T::from_f64(0.0); len]));
                    }
                }
            }
            let mut recvs: Vec<RingMessage<&mut [T]>> = next
                .iter_mut()
                .map(|(o, k, buf)| RingMessage { peer: *o, origin: *o, chunk: *k, data: &mut buf[..] })
                .chain(back.iter_mut().map(|(v, k, buf)| RingMessage { peer: *v, origin: me, chunk: *k, data: &mut buf[..] }))
                .collect();
            let fresh = self.pass.exchange(&sends, &mut recvs, || -> Result<Vec<Chunk<T>>> {
                if moving && s == 1 && !mine.is_empty() {
                    visit(me, k, &mine)?;
                }
                let mut out = Vec::new();
                for (o, k, chunk) in &prev {
                    if let Some(g) = visit(*o, *k, chunk)? {
                        out.push((*o, *k, g));
                    }
                }
                Ok(out)
            })??;
            drop(recvs);
            drop(sends);
            for (_, k2, g) in &back {
                home(*k2, g);
            }
            pending = fresh;
            prev = next;
        }
        Ok(())
    }
}

/// Adds `g` (rows `rows` of a `[b, d]` matrix, row-major) into those rows of `acc`.
fn add_rows<T: KernelElem>(acc: &mut [T], rows: &Range<usize>, d: usize, g: &[T]) {
    add_into(&mut acc[rows.start * d..rows.end * d], g);
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
        let own = match kind {
            Kind::Clip => Own { parts: vec![&img_h[..], &txt_h[..]], d },
            Kind::Siglip => Own { parts: vec![&txt_h[..]], d },
        };
        let pass = pg.ring_pass(
            &format!("{} forward", kind.name()),
            b,
            kind.width() * d,
            chunk_rows::<T>(kind, &opts, d),
            &settings(kind, &opts, d, img.dtype(), false, false),
        )?;
        let total: usize = pass.rows().iter().sum();
        let w = pg.world_size();
        let sched = RingSchedule { world: w, bidirectional: opts.bidirectional };
        let ring = Ring { pass, sched, me: pg.rank(), own };
        let tile_for = |n: usize| opts.tile.unwrap_or(b.max(n)).max(1);
        let (value, lse, factor) = match kind {
            Kind::Clip => {
                let scale = p[0];
                let mut i2t = vec![T::from_f64(f64::NEG_INFINITY); b];
                let mut t2i = i2t.clone();
                ring.forward(|_, _, chunk| {
                    let n = chunk.len() / (2 * d.max(1));
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    let (oi, ot) = chunk.split_at(n * d);
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
                let mut sum = 0f64;
                ring.forward(|origin, k, chunk| {
                    let n = chunk.len() / d.max(1);
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    sum += sigmoid_chunk(&img_h, chunk, (b, n, d), t, bias, tile_for(n), None).sum;
                    if origin == ring.me {
                        // The positives: log σ(z) − log σ(−z) = z on the diagonal.
                        sum -= ring.pass.chunk_range(origin, k).map(|i| t * dot(&img_h, &txt_h, i, d) + bias).sum::<f64>();
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
        let own = match kind {
            Kind::Clip => Own { parts: vec![&img_h[..], &txt_h[..]], d },
            Kind::Siglip => Own { parts: vec![&txt_h[..]], d },
        };
        let pg = &self.pg;
        let pass = pg.ring_pass(
            &format!("{} backward", kind.name()),
            b,
            kind.width() * d,
            chunk_rows::<T>(kind, &self.opts, d),
            &settings(kind, &self.opts, d, img.dtype(), true, false),
        )?;
        let sched = RingSchedule { world: pg.world_size(), bidirectional: self.opts.bidirectional };
        let ring = Ring { pass, sched, me: pg.rank(), own };
        let tile_for = |n: usize| self.opts.tile.unwrap_or(b.max(n)).max(1);
        let g = g * self.factor;
        let zero = T::from_f64(0.0);
        // The gradients of this rank's rows, as queries and as keys (its own chunks, and the
        // gradients its visitors send home), and of the parameters. The visits and the
        // gradients coming home both add to them, one after the other on this thread.
        struct Acc<T> {
            img: Vec<T>,
            txt: Vec<T>,
            params: Vec<f64>,
        }
        let acc = RefCell::new(Acc { img: vec![zero; b * d], txt: vec![zero; b * d], params: vec![0f64; p.len()] });
        match kind {
            Kind::Clip => {
                let scale = p[0];
                let lse = host::<T>(self.lse.as_ref().expect("the CLIP ring keeps its log-sum-exps"))?;
                let (l_i2t, l_t2i) = lse.split_at(b);
                ring.backward(
                    |origin, k, chunk| {
                        let n = chunk.len() / (2 * d.max(1));
                        let mine = origin == ring.me;
                        if n == 0 || b == 0 {
                            return Ok(if mine { None } else { Some(vec![zero; 2 * n * d]) });
                        }
                        let rows = ring.pass.chunk_range(origin, k);
                        let positives = mine.then_some(rows.start);
                        let (oi, ot) = chunk.split_at(n * d);
                        let mut a = acc.borrow_mut();
                        let a = &mut *a;
                        // The queries' gradients go straight into this rank's rows'.
                        let (dk_txt, s1) = dot_grads(&img_h, ot, (b, n, d), scale, tile_for(n), positives, l_i2t, g, &mut a.img)?;
                        let (dk_img, s2) = dot_grads(&txt_h, oi, (b, n, d), scale, tile_for(n), positives, l_t2i, g, &mut a.txt)?;
                        // s = raw · scale: ∂s/∂scale = s / scale.
                        a.params[0] += (s1 + s2) / scale;
                        if mine {
                            add_rows(&mut a.img, &rows, d, &dk_img);
                            add_rows(&mut a.txt, &rows, d, &dk_txt);
                            Ok(None)
                        } else {
                            Ok(Some([dk_img, dk_txt].concat()))
                        }
                    },
                    |k, grad| {
                        let rows = ring.pass.chunk_range(ring.me, k);
                        let (gi, gt) = grad.split_at(rows.len() * d);
                        let mut a = acc.borrow_mut();
                        add_rows(&mut a.img, &rows, d, gi);
                        add_rows(&mut a.txt, &rows, d, gt);
                    },
                )?;
            }
            Kind::Siglip => {
                let (t, bias) = (p[0], p[1]);
                ring.backward(
                    |origin, k, chunk| {
                        let n = chunk.len() / d.max(1);
                        let mine = origin == ring.me;
                        if n == 0 || b == 0 {
                            return Ok(if mine { None } else { Some(vec![zero; n * d]) });
                        }
                        let mut a = acc.borrow_mut();
                        let a = &mut *a;
                        // The queries' gradients go straight into this rank's rows'.
                        let out = sigmoid_chunk(&img_h, chunk, (b, n, d), t, bias, tile_for(n), Some((g, &mut a.img)));
                        let mut dk = out.dk;
                        a.params[0] += out.dt;
                        a.params[1] += out.db;
                        if !mine {
                            return Ok(Some(dk));
                        }
                        // The positives' − z_ii: ∂/∂img_i = −t txt_i, ∂/∂txt_i = −t img_i.
                        let rows = ring.pass.chunk_range(origin, k);
                        for i in rows.clone() {
                            for x in i * d..(i + 1) * d {
                                a.img[x] = T::from_f64(a.img[x].to_f64() - g * t * txt_h[x].to_f64());
                                let y = x - rows.start * d;
                                dk[y] = T::from_f64(dk[y].to_f64() - g * t * img_h[x].to_f64());
                            }
                            a.params[0] -= g * dot(&img_h, &txt_h, i, d);
                        }
                        a.params[1] -= g * rows.len() as f64;
                        add_rows(&mut a.txt, &rows, d, &dk);
                        Ok(None)
                    },
                    |k, grad| {
                        let rows = ring.pass.chunk_range(ring.me, k);
                        add_rows(&mut acc.borrow_mut().txt, &rows, d, grad);
                    },
                )?;
            }
        }
        let Acc { img: d_img, txt: d_txt, params: d_params } = acc.into_inner();
        let dev = Device::Cpu;
        let d_params = Tensor::from_vec(d_params, p.len(), &dev)?.to_dtype(params.dtype())?.reshape(params.shape())?;
        Ok((Tensor::from_vec(d_img, (b, d), &dev)?, Tensor::from_vec(d_txt, (b, d), &dev)?, d_params))
    }
}

fn dot<T: KernelElem>(a: &[T], b: &[T], i: usize, d: usize) -> f64 {
    (0..d).map(|j| a[i * d + j].to_f64() * b[i * d + j].to_f64()).sum()
}

/// What [`sigmoid_chunk`] returns.
struct SigmoidChunk<T> {
    /// `Σ softplus(z)` (forward only).
    sum: f64,
    /// The keys' gradient (backward only).
    dk: Vec<T>,
    /// `∂/∂t` and `∂/∂bias` (backward only).
    dt: f64,
    db: f64,
}

/// SigLIP's negatives over one chunk of keys, `tile` query rows at a time, with
/// `z = t · q·kᵀ + bias` (`q`: `[b, d]`, `keys`: `[n, d]`): forward, `Σ softplus(z)` (the
/// caller subtracts the positives' `z`); with `grad = Some((g, dq))`, the gradients of
/// `g · Σ softplus(z)`: `∂z = g σ(z)`, `dq += t ∂z·k` added into `dq`, and `dk = t ∂zᵀ·q`,
/// `∂t = Σ ∂z ⊙ q·kᵀ`, `∂bias = Σ ∂z` returned. On host slices, one tile of logits at a time:
/// each chunk's contributions go into `dq` in place, with no `[b, d]` temporary per chunk.
fn sigmoid_chunk<T: KernelElem>(
    q: &[T],
    keys: &[T],
    (b, n, d): (usize, usize, usize),
    t: f64,
    bias: f64,
    tile: usize,
    mut grad: Option<(f64, &mut [T])>,
) -> SigmoidChunk<T> {
    let mut out = SigmoidChunk { sum: 0.0, dk: Vec::new(), dt: 0.0, db: 0.0 };
    if grad.is_some() {
        out.dk = vec![T::from_f64(0.0); n * d];
    }
    let mut raw = vec![T::from_f64(0.0); tile.min(b) * n];
    for r0 in (0..b).step_by(tile) {
        let m = tile.min(b - r0);
        let qi = &q[r0 * d..(r0 + m) * d];
        let raw = &mut raw[..m * n];
        host_gemm(raw, false, qi, false, keys, true, (m, n, d), 1.0);
        match grad.as_mut() {
            None => {
                for x in raw.iter() {
                    // softplus(z) = max(z, 0) + log(1 + e^−|z|).
                    let z = t * x.to_f64() + bias;
                    out.sum += z.max(0.0) + (-z.abs()).exp().ln_1p();
                }
            }
            Some((g, dq)) => {
                for x in raw.iter_mut() {
                    // σ(z) = 1 / (1 + e^−z); e^−z = ∞ gives 0.
                    let r = x.to_f64();
                    let dz = *g / (1.0 + (-(t * r + bias)).exp());
                    out.dt += dz * r;
                    out.db += dz;
                    *x = T::from_f64(dz);
                }
                host_gemm(&mut dq[r0 * d..(r0 + m) * d], true, raw, false, keys, false, (m, d, n), t);
                host_gemm(&mut out.dk, true, raw, true, qi, false, (n, d, m), t);
            }
        }
    }
    out
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
