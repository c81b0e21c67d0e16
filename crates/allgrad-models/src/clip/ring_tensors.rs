//! The ring losses scored with Candle ops on the embeddings' own device: the form
//! [`super::clip_loss_ring`] and [`super::siglip_loss_ring`] take for CUDA embeddings whose
//! group exchanges through NCCL ([`allgrad_dist::ProcessGroup::ring_on_nccl`]), so that
//! nothing is staged through host memory and the host reads nothing inside a pass.
//!
//! The ring is the host form's (`ring.rs`): the same [`RingSchedule`], the same chunks and
//! the same order of exchanges, so the same blocks meet and the sums are the same to rounding;
//! what differs is where the arithmetic runs. Each exchange is
//! [`allgrad_dist::RingPass::exchange_tensors`]: through NCCL, grouped sends and receives on
//! the ring's stream while the compute stream scores the chunks of the exchange before, the
//! compute stream waiting (on the device) only for the chunks it scores next. The loss's
//! parameters, its value, the upstream gradient and every statistic stay on the device (the
//! host knows only sizes, from the pass's check); each pass ends with its one host wait
//! ([`allgrad_dist::RingPass::settle`]), bounded by the group's watchdog.
//!
//! Memory per rank is the host form's: this rank's blocks, a few chunks in flight, one
//! `tile x tile` block of logits at a time (the whole `b x chunk` block without `loss.tile`),
//! and, in the backward, the gradients of this rank's rows and of the chunks going home.
//!
//! On other devices (the CPU in the tests, where [`clip_loss_ring_tensors`] and
//! [`siglip_loss_ring_tensors`] run it) the exchanges go through the host path; the
//! arithmetic is the same Candle ops, which is what lets the CPU tests hold this form to the
//! host ring and the gather at f64 1e-10.

use std::sync::Arc;

use allgrad_dist::{ProcessGroup, RingMessage, RingPass, RingSchedule};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

/// The loss a tensor ring runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TensorLoss {
    /// CLIP's symmetric InfoNCE: params `[scale]`, chunks images then texts.
    Clip,
    /// SigLIP's sigmoid loss: params `[t, bias]` (`t` the scale itself), chunks texts.
    Siglip,
}

impl TensorLoss {
    fn name(self) -> &'static str {
        match self {
            TensorLoss::Clip => "clip_ring",
            TensorLoss::Siglip => "siglip_ring",
        }
    }
    fn width(self) -> usize {
        match self {
            TensorLoss::Clip => 2,
            TensorLoss::Siglip => 1,
        }
    }
}

/// Opens the pass of the forward (`false`) or the backward (`true`): the caller's settings,
/// checked across the group.
pub(crate) type OpenPass = Arc<dyn Fn(bool) -> Result<RingPass> + Send + Sync>;

/// The loss of normalised `img`, `txt` (`[b, d]`, f32 or f64, one device) and its `params`
/// (see [`TensorLoss`]), run as a ring on tensors; `bidirectional` as the pass's schedule,
/// `tile` bounds the logits scored at once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    kind: TensorLoss,
    img: &Tensor,
    txt: &Tensor,
    params: &Tensor,
    bidirectional: bool,
    tile: Option<usize>,
    open: OpenPass,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    let op = TensorRingLoss::forward(kind, img, txt, params, bidirectional, tile, open, pg)?;
    img.apply_op3(txt, params, op)
}

/// A chunk on its way: whose block, which chunk, its elements (1-D).
type Chunk = (usize, usize, Tensor);

/// One rank's side of a pass on tensors.
struct Ring<'a> {
    pass: RingPass,
    sched: RingSchedule,
    me: usize,
    /// This rank's blocks as its messages carry them (CLIP: images then texts; SigLIP: texts).
    parts: Vec<&'a Tensor>,
}

impl Ring<'_> {
    /// This rank's chunk `k` as one 1-D tensor (`None` past its rows).
    fn own_chunk(&self, k: usize) -> Result<Option<Tensor>> {
        let rows = self.pass.chunk_range(self.me, k);
        if rows.is_empty() {
            return Ok(None);
        }
        let pieces: Vec<Tensor> =
            self.parts.iter().map(|p| p.narrow(0, rows.start, rows.len())?.flatten_all()).collect::<Result<_>>()?;
        Ok(Some(Tensor::cat(&pieces, 0)?.contiguous()?))
    }

    /// Exchange `e`'s moves of blocks: this rank's chunk to the step's visitors, and the
    /// chunks of the step's origins to receive.
    fn moves<'b>(&self, e: usize, mine: Option<&'b Tensor>) -> (Vec<RingMessage<&'b Tensor>>, Vec<RingMessage<()>>) {
        let (s, k) = self.sched.slot(e, self.pass.chunks());
        let dirs = self.sched.directions(s);
        let sends = match mine {
            None => Vec::new(),
            Some(m) => dirs
                .iter()
                .map(|&down| RingMessage { peer: self.sched.visitor(self.me, s, down), origin: self.me, chunk: k, data: m })
                .collect(),
        };
        let recvs = dirs
            .iter()
            .map(|&down| self.sched.origin(self.me, s, down))
            .filter(|&o| self.pass.chunk_len(o, k) > 0)
            .map(|o| RingMessage { peer: o, origin: o, chunk: k, data: () })
            .collect();
        (sends, recvs)
    }

    fn exchange<R>(
        &self,
        sends: &[RingMessage<&Tensor>],
        recvs: &[RingMessage<()>],
        during: impl FnOnce() -> R,
    ) -> Result<(R, Vec<Tensor>)> {
        let t = self.parts[0];
        Ok(self.pass.exchange_tensors(sends, recvs, t.dtype(), t.device(), during)?)
    }

    /// The host form's `Ring::forward`, on tensors.
    fn forward(&self, mut visit: impl FnMut(usize, usize, &Tensor) -> Result<()>) -> Result<()> {
        let me = self.me;
        if self.sched.exchanges(self.pass.chunks()) == 0 {
            for k in 0..self.pass.chunks() {
                if let Some(mine) = self.own_chunk(k)? {
                    visit(me, k, &mine)?;
                }
            }
            return Ok(());
        }
        let mut prev: Vec<Chunk> = Vec::new();
        for e in 0..self.sched.exchanges(self.pass.chunks()) {
            let (s, k) = self.sched.slot(e, self.pass.chunks());
            let mine = self.own_chunk(k)?;
            let (sends, recvs) = self.moves(e, mine.as_ref());
            let (done, got) = self.exchange(&sends, &recvs, || -> Result<()> {
                if s == 1 {
                    if let Some(m) = &mine {
                        visit(me, k, m)?;
                    }
                }
                for (o, k, chunk) in &prev {
                    visit(*o, *k, chunk)?;
                }
                Ok(())
            })?;
            done?;
            prev = recvs.iter().zip(got).map(|(m, t)| (m.origin, m.chunk, t)).collect();
        }
        for (o, k, chunk) in &prev {
            visit(*o, *k, chunk)?;
        }
        self.pass.settle(self.parts[0].device())?;
        Ok(())
    }

    /// The host form's `Ring::backward`, on tensors: `visit` returns a foreign chunk's
    /// gradient, which goes home in the exchange after the next; `home` gets the gradients of
    /// this rank's chunks from their visitors.
    fn backward(
        &self,
        mut visit: impl FnMut(usize, usize, &Tensor) -> Result<Option<Tensor>>,
        mut home: impl FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let me = self.me;
        let n = self.sched.exchanges(self.pass.chunks());
        if n == 0 {
            for k in 0..self.pass.chunks() {
                if let Some(mine) = self.own_chunk(k)? {
                    visit(me, k, &mine)?;
                }
            }
            return Ok(());
        }
        let mut prev: Vec<Chunk> = Vec::new();
        let mut pending: Vec<Chunk> = Vec::new();
        for e in 0..n + 2 {
            let moving = e < n;
            let (s, k) = if moving { self.sched.slot(e, self.pass.chunks()) } else { (0, 0) };
            let mine = if moving { self.own_chunk(k)? } else { None };
            let (mut sends, mut recvs) = if moving { self.moves(e, mine.as_ref()) } else { (Vec::new(), Vec::new()) };
            for (o, k, g) in &pending {
                sends.push(RingMessage { peer: *o, origin: *o, chunk: *k, data: g });
            }
            let fresh_from = recvs.len();
            if e >= 2 {
                let (s2, k2) = self.sched.slot(e - 2, self.pass.chunks());
                if self.pass.chunk_len(me, k2) > 0 {
                    for &down in self.sched.directions(s2) {
                        recvs.push(RingMessage { peer: self.sched.visitor(me, s2, down), origin: me, chunk: k2, data: () });
                    }
                }
            }
            let (fresh, got) = self.exchange(&sends, &recvs, || -> Result<Vec<Chunk>> {
                if moving && s == 1 {
                    if let Some(m) = &mine {
                        visit(me, k, m)?;
                    }
                }
                let mut out = Vec::new();
                for (o, k, chunk) in &prev {
                    if let Some(g) = visit(*o, *k, chunk)? {
                        out.push((*o, *k, g.flatten_all()?.contiguous()?));
                    }
                }
                Ok(out)
            })?;
            let fresh = fresh?;
            drop(sends);
            let mut got = got.into_iter();
            let next: Vec<Chunk> = recvs[..fresh_from].iter().zip(got.by_ref()).map(|(m, t)| (m.origin, m.chunk, t)).collect();
            for (m, g) in recvs[fresh_from..].iter().zip(got) {
                home(m.chunk, &g)?;
            }
            pending = fresh;
            prev = next;
        }
        self.pass.settle(self.parts[0].device())?;
        Ok(())
    }
}

/// `log(e^a + e^b)` elementwise.
fn log_add_exp(a: Option<Tensor>, b: Tensor) -> Result<Tensor> {
    match a {
        None => Ok(b),
        Some(a) => {
            let m = a.maximum(&b)?;
            let s = ((a - &m)?.exp()? + (b - &m)?.exp()?)?;
            m + s.log()?
        }
    }
}

/// Each row's log-sum-exp of `s` (`[m, n]`), as `[m, 1]`.
fn lse_rows(s: &Tensor) -> Result<Tensor> {
    let m = s.max_keepdim(1)?;
    m.clone() + s.broadcast_sub(&m)?.exp()?.sum_keepdim(1)?.log()?
}

/// `Σ softplus(z)`, `softplus(z) = max(z, 0) + log(1 + e^−|z|)`.
fn softplus_sum(z: &Tensor) -> Result<Tensor> {
    (z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?.sum_all()
}

/// `1 / (1 + e^−z)`.
fn sigmoid(z: &Tensor) -> Result<Tensor> {
    (z.neg()?.exp()? + 1.0)?.recip()
}

/// The row ranges of `tile` rows covering `0..n`.
fn tiles(n: usize, tile: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(tile.max(1)).map(move |r0| (r0, tile.min(n - r0)))
}

fn add_opt(acc: &mut Option<Tensor>, x: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        None => x,
        Some(a) => (a + x)?,
    });
    Ok(())
}

/// Concatenates per-tile pieces along rows (every piece present).
fn cat_rows(pieces: Vec<Option<Tensor>>) -> Result<Tensor> {
    let ts: Vec<Tensor> = pieces.into_iter().map(|p| p.expect("every tile is visited")).collect();
    Tensor::cat(&ts, 0)
}

/// The op: its value (on the embeddings' device) and what the backward needs.
struct TensorRingLoss {
    kind: TensorLoss,
    bidirectional: bool,
    tile: Option<usize>,
    open: OpenPass,
    pg: ProcessGroup,
    value: Tensor,
    /// CLIP: each row's log-sum-exp, images against every text then texts against every
    /// image (two `[b, 1]`).
    lse: Option<(Tensor, Tensor)>,
    factor: f64,
}

impl TensorRingLoss {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        kind: TensorLoss,
        img: &Tensor,
        txt: &Tensor,
        params: &Tensor,
        bidirectional: bool,
        tile: Option<usize>,
        open: OpenPass,
        pg: &ProcessGroup,
    ) -> Result<TensorRingLoss> {
        crate::trace::count(|c| c.ring_forward += 1);
        let (img, txt, params) = (img.detach(), txt.detach(), params.detach());
        let (b, d) = img.dims2()?;
        let pass = open(false)?;
        let total: usize = pass.rows().iter().sum();
        let w = pg.world_size();
        let parts = match kind {
            TensorLoss::Clip => vec![&img, &txt],
            TensorLoss::Siglip => vec![&txt],
        };
        let ring = Ring { pass, sched: RingSchedule { world: w, bidirectional }, me: pg.rank(), parts };
        let tile_of = |n: usize| tile.unwrap_or(b.max(n)).max(1);
        let row_tiles: Vec<(usize, usize)> = tiles(b, tile_of(b)).collect();
        let diag = (&img * &txt)?.sum_all()?;
        let (value, lse, factor) = match kind {
            TensorLoss::Clip => {
                let scale = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                let mut i2t: Vec<Option<Tensor>> = vec![None; row_tiles.len()];
                let mut t2i: Vec<Option<Tensor>> = vec![None; row_tiles.len()];
                ring.forward(|_, _, chunk| {
                    let n = chunk.elem_count() / (2 * d.max(1));
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    let c = chunk.reshape((2 * n, d))?;
                    let (oi, ot) = (c.narrow(0, 0, n)?, c.narrow(0, n, n)?);
                    for (j, &(r0, m)) in row_tiles.iter().enumerate() {
                        let (qi, qt) = (img.narrow(0, r0, m)?, txt.narrow(0, r0, m)?);
                        for (c0, nc) in tiles(n, tile_of(n)) {
                            let (ki, kt) = (oi.narrow(0, c0, nc)?, ot.narrow(0, c0, nc)?);
                            let s1 = qi.matmul(&kt.t()?)?.broadcast_mul(&scale)?;
                            i2t[j] = Some(log_add_exp(i2t[j].take(), lse_rows(&s1)?)?);
                            let s2 = qt.matmul(&ki.t()?)?.broadcast_mul(&scale)?;
                            t2i[j] = Some(log_add_exp(t2i[j].take(), lse_rows(&s2)?)?);
                        }
                    }
                    Ok(())
                })?;
                let factor = w as f64 / (2.0 * total as f64);
                if b == 0 {
                    let zero = Tensor::zeros((), img.dtype(), img.device())?;
                    (zero, None, factor)
                } else {
                    let (i2t, t2i) = (cat_rows(i2t)?, cat_rows(t2i)?);
                    let pos = diag.broadcast_mul(&scale.flatten_all()?)?.affine(2.0, 0.0)?.squeeze(0)?;
                    let sum = ((i2t.sum_all()? + t2i.sum_all()?)? - pos)?;
                    (sum.affine(factor, 0.0)?, Some((i2t, t2i)), factor)
                }
            }
            TensorLoss::Siglip => {
                let t = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                let bias = params.narrow(0, 1, 1)?.reshape((1, 1))?;
                let mut sum: Option<Tensor> = None;
                ring.forward(|_, _, chunk| {
                    let n = chunk.elem_count() / d.max(1);
                    if n == 0 || b == 0 {
                        return Ok(());
                    }
                    let keys = chunk.reshape((n, d))?;
                    for &(r0, m) in &row_tiles {
                        let q = img.narrow(0, r0, m)?;
                        for (c0, nc) in tiles(n, tile_of(n)) {
                            let z = q.matmul(&keys.narrow(0, c0, nc)?.t()?)?.broadcast_mul(&t)?.broadcast_add(&bias)?;
                            add_opt(&mut sum, softplus_sum(&z)?)?;
                        }
                    }
                    Ok(())
                })?;
                let factor = w as f64 / total as f64;
                let value = match sum {
                    None => Tensor::zeros((), img.dtype(), img.device())?,
                    Some(sum) => {
                        // The positives: log σ(z) − log σ(−z) = z on the diagonal.
                        let pos =
                            (diag.broadcast_mul(&t.flatten_all()?)? + bias.flatten_all()?.affine(b as f64, 0.0)?)?.squeeze(0)?;
                        (sum - pos)?.affine(factor, 0.0)?
                    }
                };
                (value, None, factor)
            }
        };
        Ok(TensorRingLoss { kind, bidirectional, tile, open, pg: pg.clone(), value, lse, factor })
    }

    fn backward(&self, img: &Tensor, txt: &Tensor, params: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        crate::trace::count(|c| c.ring_backward += 1);
        let kind = self.kind;
        let (img, txt, params) = (img.detach(), txt.detach(), params.detach());
        let (b, d) = img.dims2()?;
        let pass = (self.open)(true)?;
        let chunks = pass.chunks();
        let parts = match kind {
            TensorLoss::Clip => vec![&img, &txt],
            TensorLoss::Siglip => vec![&txt],
        };
        let me = self.pg.rank();
        let ring =
            Ring { pass, sched: RingSchedule { world: self.pg.world_size(), bidirectional: self.bidirectional }, me, parts };
        let tile_of = |n: usize| self.tile.unwrap_or(b.max(n)).max(1);
        let row_tiles: Vec<(usize, usize)> = tiles(b, tile_of(b)).collect();
        // g · factor, on the device, `[1, 1]`.
        let g = grad.detach().to_dtype(img.dtype())?.reshape((1, 1))?.affine(self.factor, 0.0)?;
        let zeros_like = |t: &Tensor| t.zeros_like();
        // The queries' gradients per row tile, this rank's chunks' gradients as keys (its own
        // visits and what comes home), the parameters'.
        let mut dq: Vec<[Option<Tensor>; 2]> = vec![[None, None]; row_tiles.len()];
        let mut dk_own: Vec<Option<Tensor>> = vec![None; chunks];
        let mut dparams: [Option<Tensor>; 2] = [None, None];
        {
            let dq = std::cell::RefCell::new(&mut dq);
            let dk_own = std::cell::RefCell::new(&mut dk_own);
            let dparams = std::cell::RefCell::new(&mut dparams);
            let home = |k: usize, grad: &Tensor| -> Result<()> {
                let mut dk = dk_own.borrow_mut();
                add_opt(&mut dk[k], grad.clone())
            };
            match kind {
                TensorLoss::Clip => {
                    let scale = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                    let (l_i2t, l_t2i) = self.lse.as_ref().expect("the CLIP ring keeps its log-sum-exps");
                    ring.backward(
                        |origin, k, chunk| {
                            let n = chunk.elem_count() / (2 * d.max(1));
                            let mine = origin == me;
                            if n == 0 || b == 0 {
                                return Ok(if mine { None } else { Some(zeros_like(chunk)?) });
                            }
                            let c = chunk.reshape((2 * n, d))?;
                            let (oi, ot) = (c.narrow(0, 0, n)?, c.narrow(0, n, n)?);
                            let mut dk_img: Vec<Option<Tensor>> = vec![None; n.div_ceil(tile_of(n))];
                            let mut dk_txt = dk_img.clone();
                            let mut dq = dq.borrow_mut();
                            let mut dp = dparams.borrow_mut();
                            for (j, &(r0, m)) in row_tiles.iter().enumerate() {
                                let (qi, qt) = (img.narrow(0, r0, m)?, txt.narrow(0, r0, m)?);
                                let (li, lt) = (l_i2t.narrow(0, r0, m)?, l_t2i.narrow(0, r0, m)?);
                                for (ci, (c0, nc)) in tiles(n, tile_of(n)).enumerate() {
                                    let (ki, kt) = (oi.narrow(0, c0, nc)?, ot.narrow(0, c0, nc)?);
                                    // Images against texts: dS = g p, s = scale · raw.
                                    let raw = qi.matmul(&kt.t()?)?;
                                    let ds = raw.broadcast_mul(&scale)?.broadcast_sub(&li)?.exp()?.broadcast_mul(&g)?;
                                    add_opt(&mut dp[0], (&ds * &raw)?.sum_all()?)?;
                                    let ds = ds.broadcast_mul(&scale)?;
                                    add_opt(&mut dq[j][0], ds.matmul(&kt)?)?;
                                    add_opt(&mut dk_txt[ci], ds.t()?.matmul(&qi)?)?;
                                    // Texts against images.
                                    let raw = qt.matmul(&ki.t()?)?;
                                    let ds = raw.broadcast_mul(&scale)?.broadcast_sub(&lt)?.exp()?.broadcast_mul(&g)?;
                                    add_opt(&mut dp[0], (&ds * &raw)?.sum_all()?)?;
                                    let ds = ds.broadcast_mul(&scale)?;
                                    add_opt(&mut dq[j][1], ds.matmul(&ki)?)?;
                                    add_opt(&mut dk_img[ci], ds.t()?.matmul(&qt)?)?;
                                }
                            }
                            let dk = Tensor::cat(&[cat_rows(dk_img)?, cat_rows(dk_txt)?], 0)?.flatten_all()?;
                            if mine {
                                add_opt(&mut dk_own.borrow_mut()[k], dk)?;
                                Ok(None)
                            } else {
                                Ok(Some(dk))
                            }
                        },
                        home,
                    )?;
                }
                TensorLoss::Siglip => {
                    let t = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                    let bias = params.narrow(0, 1, 1)?.reshape((1, 1))?;
                    ring.backward(
                        |origin, k, chunk| {
                            let n = chunk.elem_count() / d.max(1);
                            let mine = origin == me;
                            if n == 0 || b == 0 {
                                return Ok(if mine { None } else { Some(zeros_like(chunk)?) });
                            }
                            let keys = chunk.reshape((n, d))?;
                            let mut dk_txt: Vec<Option<Tensor>> = vec![None; n.div_ceil(tile_of(n))];
                            let mut dq = dq.borrow_mut();
                            let mut dp = dparams.borrow_mut();
                            for (j, &(r0, m)) in row_tiles.iter().enumerate() {
                                let q = img.narrow(0, r0, m)?;
                                for (ci, (c0, nc)) in tiles(n, tile_of(n)).enumerate() {
                                    let kt = keys.narrow(0, c0, nc)?;
                                    let raw = q.matmul(&kt.t()?)?;
                                    let dz = sigmoid(&raw.broadcast_mul(&t)?.broadcast_add(&bias)?)?.broadcast_mul(&g)?;
                                    add_opt(&mut dp[0], (&dz * &raw)?.sum_all()?)?;
                                    add_opt(&mut dp[1], dz.sum_all()?)?;
                                    let dz = dz.broadcast_mul(&t)?;
                                    add_opt(&mut dq[j][0], dz.matmul(&kt)?)?;
                                    add_opt(&mut dk_txt[ci], dz.t()?.matmul(&q)?)?;
                                }
                            }
                            let dk = cat_rows(dk_txt)?.flatten_all()?;
                            if mine {
                                add_opt(&mut dk_own.borrow_mut()[k], dk)?;
                                Ok(None)
                            } else {
                                Ok(Some(dk))
                            }
                        },
                        home,
                    )?;
                }
            }
        }
        let zero_rows = || Tensor::zeros((b, d), img.dtype(), img.device());
        let zero = || Tensor::zeros((), img.dtype(), img.device());
        // The queries' gradients, then this rank's rows' gradients as keys, chunk by chunk.
        let mut d_img =
            if b == 0 { zero_rows()? } else { Tensor::cat(&dq.iter().map(|q| q[0].clone().unwrap()).collect::<Vec<_>>(), 0)? };
        let mut d_txt = match kind {
            TensorLoss::Clip if b > 0 => Tensor::cat(&dq.iter().map(|q| q[1].clone().unwrap()).collect::<Vec<_>>(), 0)?,
            _ => zero_rows()?,
        };
        let own: Vec<Tensor> = dk_own.into_iter().flatten().collect();
        if !own.is_empty() {
            let w = kind.width();
            let pieces: Vec<Tensor> =
                own.iter().map(|g| g.reshape((w, g.elem_count() / (w * d.max(1)), d))).collect::<Result<_>>()?;
            let keys = Tensor::cat(&pieces, 1)?;
            match kind {
                TensorLoss::Clip => {
                    d_img = (d_img + keys.get(0)?)?;
                    d_txt = (d_txt + keys.get(1)?)?;
                }
                TensorLoss::Siglip => d_txt = (d_txt + keys.get(0)?)?,
            }
        }
        let g1 = g.flatten_all()?.squeeze(0)?;
        let [dp0, dp1] = dparams;
        let mut dp0 = dp0.map_or_else(zero, Ok)?;
        let mut dp1 = dp1.map_or_else(zero, Ok)?;
        // The positives, once for the whole block.
        let diag = (&img * &txt)?.sum_all()?;
        match kind {
            TensorLoss::Clip => {
                // − 2 s_ii, s_ii = scale · img_i·txt_i.
                let scale = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                let c = g.broadcast_mul(&scale)?.affine(2.0, 0.0)?;
                d_img = (d_img - txt.broadcast_mul(&c)?)?;
                d_txt = (d_txt - img.broadcast_mul(&c)?)?;
                dp0 = (dp0 - (&diag * &g1)?.affine(2.0, 0.0)?)?;
            }
            TensorLoss::Siglip => {
                // − z_ii, z_ii = t · img_i·txt_i + bias.
                let t = params.narrow(0, 0, 1)?.reshape((1, 1))?;
                let c = g.broadcast_mul(&t)?;
                d_img = (d_img - txt.broadcast_mul(&c)?)?;
                d_txt = (d_txt - img.broadcast_mul(&c)?)?;
                dp0 = (dp0 - (&diag * &g1)?)?;
                dp1 = (dp1 - g1.affine(b as f64, 0.0)?)?;
            }
        }
        let dp = match kind {
            TensorLoss::Clip => dp0.reshape(1)?,
            TensorLoss::Siglip => Tensor::stack(&[dp0, dp1], 0)?,
        };
        Ok((d_img, d_txt, dp.to_dtype(params.dtype())?.reshape(params.shape())?))
    }
}

impl CustomOp3 for TensorRingLoss {
    fn name(&self) -> &'static str {
        "allgrad.ring_loss_tensors"
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
            Storage::Cpu(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("{}: the loss was computed on another device than its inputs", self.kind.name()),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, layout) = self.value.storage_and_layout();
        match storage.try_clone(layout)? {
            Storage::Cuda(s) => Ok((s, Shape::from(()))),
            _ => candle_core::bail!("{}: the loss was computed on another device than its inputs", self.kind.name()),
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
        if !matches!(img.dtype(), DType::F32 | DType::F64) {
            candle_core::bail!("{}: the ring takes f32 or f64 embeddings, got {:?}", self.kind.name(), img.dtype());
        }
        let (di, dt, dp) = self.backward(img, txt, params, grad)?;
        Ok((Some(di), Some(dt), Some(dp)))
    }
}
