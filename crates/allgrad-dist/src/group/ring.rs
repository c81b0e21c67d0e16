//! Ring passes: a loss that visits every rank's block in turn (the memory-flat ring losses of
//! `allgrad_models::clip`) opens a [`RingPass`], which checks once, across the group, that
//! every rank runs the same pass with the same settings and learns every rank's block size;
//! then each step exchanges blocks with the peers the [`RingSchedule`] names, point to point,
//! with no further count exchange or mesh-wide check. Each exchange runs on a communication
//! thread while the calling thread computes ([`RingPass::exchange`]): the next message is in
//! flight while the current one is scored.
//!
//! Blocks travel in chunks: chunk `k` of rank `o`'s block is its rows
//! `k·chunk_rows .. (k + 1)·chunk_rows` (fewer in its last chunk, none past its rows), so a
//! rank need never hold more of another's block than the chunks in flight. Sizes are known
//! from the check: every message is one chunk of one rank's block (its `origin` and `chunk`),
//! and both ends check its length before anything moves. A rank whose block changes size
//! mid-pass fails with an error naming it and the size the pass announced, and tells every
//! peer (no peer waits for a message that will not come); a peer that receives a frame of
//! another length fails naming both ranks.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};

use super::ProcessGroup;
use crate::cpu::call::Call;
use crate::cpu::mesh::{OpCode, RecvOp, SendOp};
use crate::error::{DistError, DistResult};
use crate::reduce::Elem;

/// Most settings a pass checks.
const MAX_SETTINGS: usize = 8;

/// One setting every rank of a ring pass must share (the loss, its direction, the width of
/// a row...): its name, for the error, and its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSetting {
    /// What the setting is, as an error names it.
    pub name: &'static str,
    /// Its value on this rank.
    pub value: u64,
}

/// Which ranks' blocks a ring visits at each step. Blocks travel `up` (rank r's block to rank
/// r + 1) and, when bidirectional, `down` too (to rank r − 1): at step s (1-based) rank r
/// receives the block of rank `r − s` going up and of rank `r + s` going down. Unidirectional:
/// W − 1 steps up. Bidirectional: ⌈(W − 1)/2⌉ steps up and ⌊(W − 1)/2⌋ down, about W/2 steps
/// in all, every other rank's block visited once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSchedule {
    /// Ranks in the ring.
    pub world: usize,
    /// Whether blocks travel both ways.
    pub bidirectional: bool,
}

impl RingSchedule {
    /// Steps up (and steps in all: the down steps are the first of them).
    pub fn steps(&self) -> usize {
        let others = self.world.saturating_sub(1);
        if self.bidirectional {
            others.div_ceil(2)
        } else {
            others
        }
    }

    /// Steps down (0 unless bidirectional).
    pub fn steps_down(&self) -> usize {
        if self.bidirectional {
            self.world.saturating_sub(1) / 2
        } else {
            0
        }
    }

    /// The rank whose block `rank` receives at step `s` going up (`down`: going down).
    pub fn origin(&self, rank: usize, s: usize, down: bool) -> usize {
        let w = self.world;
        if down {
            (rank + s) % w
        } else {
            (rank + w - s % w) % w
        }
    }

    /// The neighbour a block going up (`down`: going down) is sent to from `rank`.
    pub fn next(&self, rank: usize, down: bool) -> usize {
        let w = self.world;
        if down {
            (rank + w - 1) % w
        } else {
            (rank + 1) % w
        }
    }

    /// The neighbour a block going up (`down`: going down) arrives from at `rank`.
    pub fn prev(&self, rank: usize, down: bool) -> usize {
        self.next(rank, !down)
    }

    /// The rank that receives `rank`'s own block at step `s` going up (`down`: going down):
    /// the one whose [`RingSchedule::origin`] it is, for a block sent straight from its owner.
    pub fn visitor(&self, rank: usize, s: usize, down: bool) -> usize {
        self.origin(rank, s, !down)
    }

    /// The directions blocks travel at step `s` (1-based): up (`false`), and down (`true`) too
    /// while the schedule has down steps.
    pub fn directions(&self, s: usize) -> &'static [bool] {
        if s <= self.steps_down() {
            &[false, true]
        } else {
            &[false]
        }
    }

    /// The exchanges of a pass whose blocks travel in `chunks` chunks: one per step and chunk.
    pub fn exchanges(&self, chunks: usize) -> usize {
        self.steps() * chunks
    }

    /// Exchange `e`'s step (1-based) and chunk, with `chunks` chunks per block.
    pub fn slot(&self, e: usize, chunks: usize) -> (usize, usize) {
        (e / chunks + 1, e % chunks)
    }
}

/// What the ring passes of a group did so far ([`ProcessGroup::ring_counts`]; for tests, which
/// assert on counts, never on time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingCounts {
    /// Passes opened.
    pub passes: u64,
    /// Checks across the group (one per pass).
    pub checks: u64,
    /// Point-to-point exchanges that moved at least one message.
    pub exchanges: u64,
    /// Those of them that ran on the communication thread while the caller computed.
    pub overlapped: u64,
    /// Messages sent (blocks, and blocks' gradients going home).
    pub messages_sent: u64,
    /// Frames sent (one per peer per exchange: messages to one peer travel together; through
    /// NCCL, one per message).
    pub frames_sent: u64,
    /// Exchanges of CUDA tensors through NCCL ([`RingPass::exchange_tensors`]): launched on
    /// the ring's stream, waited for by the compute stream, never by the host.
    pub device_exchanges: u64,
    /// Host waits for a pass's NCCL exchanges: one per pass, at its end
    /// ([`RingPass::settle`]), none inside it.
    pub host_waits: u64,
}

impl RingCounts {
    /// The counts taken since `before` (an earlier reading of the same group).
    pub fn since(self, before: RingCounts) -> RingCounts {
        RingCounts {
            passes: self.passes - before.passes,
            checks: self.checks - before.checks,
            exchanges: self.exchanges - before.exchanges,
            overlapped: self.overlapped - before.overlapped,
            messages_sent: self.messages_sent - before.messages_sent,
            frames_sent: self.frames_sent - before.frames_sent,
            device_exchanges: self.device_exchanges - before.device_exchanges,
            host_waits: self.host_waits - before.host_waits,
        }
    }
}

/// A ring pass, opened by [`ProcessGroup::ring_pass`]: every rank's block size, and the
/// exchanges of its steps.
pub struct RingPass {
    pg: ProcessGroup,
    what: String,
    seq: u64,
    rows: Vec<usize>,
    unit: usize,
    chunk_rows: usize,
    step: AtomicU64,
}

/// One message of an exchange: chunk `chunk` of rank `origin`'s block (or its gradient), sent
/// to or received from `peer`.
pub struct RingMessage<B> {
    /// The peer (group rank).
    pub peer: usize,
    /// The rank whose block this is.
    pub origin: usize,
    /// Which chunk of it: the message holds [`RingPass::chunk_len`]`(origin, chunk)` elements.
    pub chunk: usize,
    /// The elements.
    pub data: B,
}

impl ProcessGroup {
    /// Opens a ring pass named `what` (for errors): one all_gather across the group of this
    /// rank's block size (`rows` rows of `unit` elements), the rows per chunk its messages
    /// carry (`chunk_rows`, at least 1) and its `settings`, after which every rank knows every
    /// block's size. Ranks whose settings differ, or whose rows are not whole, fail on every
    /// rank with an error naming the ranks and the values; the group is left broken (a pass
    /// that ran with different settings would be wrong).
    pub fn ring_pass(
        &self,
        what: &str,
        rows: usize,
        unit: usize,
        chunk_rows: usize,
        settings: &[RingSetting],
    ) -> DistResult<RingPass> {
        if settings.len() > MAX_SETTINGS {
            return Err(DistError::Invalid(format!("ring pass {what}: at most {MAX_SETTINGS} settings, got {}", settings.len())));
        }
        if chunk_rows == 0 {
            return Err(DistError::Invalid(format!("ring pass {what}: a chunk must hold at least one row")));
        }
        let w = self.world_size();
        // Words per rank: rows, unit, the number of settings, the settings, the chunk's rows.
        let width = 4 + MAX_SETTINGS;
        let mut own = vec![0i64; width];
        own[0] = rows as i64;
        own[1] = unit as i64;
        own[2] = settings.len() as i64;
        for (j, s) in settings.iter().enumerate() {
            own[3 + j] = s.value as i64;
        }
        own[width - 1] = chunk_rows as i64;
        let all = if w == 1 { own.clone() } else { self.all_gather_slice(&own)? };
        let of = |k: usize| &all[k * width..(k + 1) * width];
        // The first word that differs between ranks, with the ranks holding each value.
        let mut differs = None;
        // The settings first (they name what differs: another loss is reported as such, not
        // as the row width that follows from it), then the row width.
        for j in (2..width).chain([1]) {
            let mut values: Vec<(i64, Vec<usize>)> = Vec::new();
            for k in 0..w {
                let v = of(k)[j];
                match values.iter_mut().find(|(x, _)| *x == v) {
                    Some((_, ranks)) => ranks.push(k),
                    None => values.push((v, vec![k])),
                }
            }
            if values.len() > 1 {
                differs = Some((j, values));
                break;
            }
        }
        let mut st = self.lock();
        st.ring.passes += 1;
        st.ring.checks += 1;
        if let Some((j, values)) = differs {
            let name = match j {
                1 => "the row width".to_string(),
                2 => "the number of settings (a different loss?)".to_string(),
                j if j == width - 1 => "the rows per chunk".to_string(),
                j => settings.get(j - 3).map_or_else(|| format!("setting #{}", j - 3), |s| s.name.to_string()),
            };
            let held: Vec<String> = values.iter().map(|(v, ranks)| format!("rank(s) {ranks:?}: {v}")).collect();
            let err = DistError::Invalid(format!(
                "ring pass {what} on {}: the ranks run it with different settings: {name} differs ({}); every rank must \
                 run the same ring loss with the same settings",
                self.name(),
                held.join("; ")
            ));
            return Err(st.mesh.fail(err));
        }
        st.seq += 1;
        let seq = st.seq;
        drop(st);
        let rows = (0..w).map(|k| of(k)[0] as usize).collect();
        Ok(RingPass { pg: self.clone(), what: what.to_string(), seq, rows, unit, chunk_rows, step: AtomicU64::new(0) })
    }

    /// Whether ring passes over tensors on `device` exchange them through NCCL
    /// ([`RingPass::exchange_tensors`]): a CUDA device whose group takes the `nccl` path
    /// ([`ProcessGroup::cuda_path`]) in a build with the `nccl` feature. When it does, the
    /// group's NCCL communicator is made now if no collective has made it yet. For a CUDA
    /// device this is a collective the first time (every rank calls it at the same point, as
    /// the ring losses do before each pass); for another device it answers `false` at once.
    pub fn ring_on_nccl(&self, device: &candle_core::Device) -> DistResult<bool> {
        #[cfg(feature = "nccl")]
        if let candle_core::Device::Cuda(d) = device {
            if self.cuda_path_of(d)? == crate::gpu::CudaPath::Nccl {
                super::cuda::ring_comm(self, d)?;
                return Ok(true);
            }
        }
        let _ = device;
        Ok(false)
    }

    /// What this group's ring passes did so far (for tests).
    #[doc(hidden)]
    pub fn ring_counts(&self) -> RingCounts {
        self.lock().ring
    }
}

impl RingPass {
    /// Every rank's block rows, in rank order, as checked when the pass opened.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// Elements per row.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The elements of rank `origin`'s block.
    pub fn len_of(&self, origin: usize) -> usize {
        self.rows[origin] * self.unit
    }

    /// Rows per chunk.
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    /// Chunks per block: as many as the largest block has (at least 1), the same on every
    /// rank. A smaller block's last chunks are empty.
    pub fn chunks(&self) -> usize {
        self.rows.iter().max().map_or(0, |m| m.div_ceil(self.chunk_rows)).max(1)
    }

    /// The rows of chunk `k` of rank `origin`'s block (empty past its rows).
    pub fn chunk_range(&self, origin: usize, k: usize) -> std::ops::Range<usize> {
        let n = self.rows[origin];
        let lo = (k * self.chunk_rows).min(n);
        lo..(lo + self.chunk_rows).min(n)
    }

    /// The elements of chunk `k` of rank `origin`'s block.
    pub fn chunk_len(&self, origin: usize, k: usize) -> usize {
        self.chunk_range(origin, k).len() * self.unit
    }

    /// Sends `sends` and receives `recvs` on a communication thread while `during` runs on
    /// this one, and returns what `during` returned once both are done. Messages to one peer
    /// travel in one frame, in the order listed; the receiver must list its messages from this
    /// rank in the same order. Every message's length is checked against its chunk's size before
    /// anything moves: a wrong one fails here, naming this rank, and tells every
    /// peer. With no messages `during` simply runs.
    pub fn exchange<T: Elem + Send + Sync, R>(
        &self,
        sends: &[RingMessage<&[T]>],
        recvs: &mut [RingMessage<&mut [T]>],
        during: impl FnOnce() -> R,
    ) -> DistResult<R> {
        let step = self.step.fetch_add(1, Ordering::Relaxed) + 1;
        let me = self.pg.rank();
        let w = self.pg.world_size();
        for (dir, peer, origin, chunk, len) in sends
            .iter()
            .map(|m| ("send", m.peer, m.origin, m.chunk, m.data.len()))
            .chain(recvs.iter().map(|m| ("receive", m.peer, m.origin, m.chunk, m.data.len())))
        {
            if peer >= w || origin >= w || peer == me {
                return Err(DistError::Invalid(format!(
                    "ring pass {} on {}: rank {me} cannot {dir} rank {origin}'s block with rank {peer}",
                    self.what,
                    self.pg.name()
                )));
            }
            if len != self.chunk_len(origin, chunk) {
                let err = DistError::Invalid(format!(
                    "ring pass {} on {}, step {step}: rank {me} would {dir} a block of rank {origin} (chunk {chunk}) of {len} \
                     elements ({} rows of {}), but the pass announced {} rows ({} in that chunk): a block changed size \
                     mid-pass",
                    self.what,
                    self.pg.name(),
                    len as f64 / self.unit.max(1) as f64,
                    self.unit,
                    self.rows[origin],
                    self.chunk_range(origin, chunk).len()
                ));
                return Err(self.pg.lock().mesh.fail(err));
            }
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(during());
        }
        // Messages grouped per peer, in the order listed: one frame each way per peer.
        let mut send_peers: Vec<usize> = Vec::new();
        for m in sends {
            if !send_peers.contains(&m.peer) {
                send_peers.push(m.peer);
            }
        }
        let joined: Vec<(usize, std::borrow::Cow<'_, [T]>)> = send_peers
            .iter()
            .map(|&p| {
                let parts: Vec<&[T]> = sends.iter().filter(|m| m.peer == p).map(|m| m.data).collect();
                let data = if parts.len() == 1 { std::borrow::Cow::Borrowed(parts[0]) } else { parts.concat().into() };
                (p, data)
            })
            .collect();
        // Per peer: its messages' total length, and how many there are. A peer's one message
        // is received in place; several from one peer arrive as one frame, into an inbox,
        // then split.
        let mut recv_peers: Vec<(usize, usize, usize)> = Vec::new();
        for m in recvs.iter() {
            match recv_peers.iter_mut().find(|(p, _, _)| *p == m.peer) {
                Some((_, n, c)) => {
                    *n += m.data.len();
                    *c += 1;
                }
                None => recv_peers.push((m.peer, m.data.len(), 1)),
            }
        }
        let mut inbox: Vec<Vec<T>> =
            recv_peers.iter().map(|(_, n, c)| if *c > 1 { vec![T::zeroed(); *n] } else { Vec::new() }).collect();
        let what = format!("{} step {step}", self.what);
        let (out, sent) = {
            // Where each peer's frame lands: its message's own buffer, or its inbox.
            let mut targets: Vec<&mut [T]> = Vec::with_capacity(recv_peers.len());
            let mut singles: Vec<Option<&mut [T]>> = recv_peers.iter().map(|_| None).collect();
            for m in recvs.iter_mut() {
                let k = recv_peers.iter().position(|(p, _, _)| *p == m.peer).expect("listed above");
                if recv_peers[k].2 == 1 {
                    singles[k] = Some(&mut *m.data);
                }
            }
            for (single, buf) in singles.into_iter().zip(inbox.iter_mut()) {
                targets.push(match single {
                    Some(s) => s,
                    None => &mut buf[..],
                });
            }
            std::thread::scope(|sc| {
                let comm = sc.spawn(|| -> DistResult<()> {
                    let mut st = self.pg.lock();
                    st.mesh.check_usable()?;
                    let call = Call { op: OpCode::Ring, redop: None, seq: self.seq, meta: 0, what: &what };
                    let esz = T::DTYPE.size_in_bytes();
                    let mut s_ops: Vec<SendOp> = joined
                        .iter()
                        .map(|(p, d)| SendOp {
                            peer: *p,
                            header: call.header::<T>(step as u32, d.len() * esz),
                            data: bytemuck::cast_slice(d),
                        })
                        .collect();
                    let mut r_ops: Vec<RecvOp> = recv_peers
                        .iter()
                        .zip(targets)
                        .map(|((p, n, _), buf)| RecvOp {
                            peer: *p,
                            expect: call.header::<T>(step as u32, n * esz),
                            data: bytemuck::cast_slice_mut(buf),
                            acc: None,
                        })
                        .collect();
                    st.mesh.exchange(&mut s_ops, &mut r_ops, &what)?;
                    st.ring.exchanges += 1;
                    st.ring.overlapped += 1;
                    st.ring.frames_sent += s_ops.len() as u64;
                    st.ring.messages_sent += sends.len() as u64;
                    Ok(())
                });
                let out = during();
                let sent =
                    comm.join().unwrap_or_else(|_| Err(DistError::Invalid(format!("{what}: the communication thread panicked"))));
                (out, sent)
            })
        };
        sent?;
        // The frames of peers that sent several messages, split in the order listed.
        let mut taken = vec![0usize; recv_peers.len()];
        for m in recvs.iter_mut() {
            let k = recv_peers.iter().position(|(p, _, _)| *p == m.peer).expect("listed above");
            if recv_peers[k].2 > 1 {
                let n = m.data.len();
                m.data.copy_from_slice(&inbox[k][taken[k]..taken[k] + n]);
                taken[k] += n;
            }
        }
        Ok(out)
    }
}

impl RingPass {
    /// [`RingPass::exchange`] for tensors: sends each message's tensor (contiguous, of
    /// `dtype`, on `device`, with its chunk's [`RingPass::chunk_len`] elements) and receives
    /// each of `recvs` (whose `data` is unused) as a new 1-D tensor of its chunk's length on
    /// `device`, in the order listed, while `during` runs on this thread.
    ///
    /// - Through NCCL ([`ProcessGroup::ring_on_nccl`]): the sends and receives are one group
    ///   of `ncclSend`/`ncclRecv` (`ncclGroupStart`/`ncclGroupEnd`), not an all_to_all,
    ///   launched on the ring's own stream after the work already queued on the compute stream
    ///   (the chunks' producers); `during` then queues its work on the compute stream, which
    ///   runs beside the exchange, and the compute stream is made to wait for the exchange
    ///   before anything queued after this returns (the chunks received, about to be scored).
    ///   The host waits for nothing here: the pass's one host wait is [`RingPass::settle`].
    /// - Otherwise (CPU tensors, or CUDA tensors on the `host` path): through
    ///   [`RingPass::exchange`] on host copies, the received chunks put on `device`.
    pub fn exchange_tensors<R>(
        &self,
        sends: &[RingMessage<&Tensor>],
        recvs: &[RingMessage<()>],
        dtype: DType,
        device: &Device,
        during: impl FnOnce() -> R,
    ) -> DistResult<(R, Vec<Tensor>)> {
        for m in sends {
            let t = m.data;
            if t.dtype() != dtype || !t.device().same_device(device) || t.elem_count() != self.chunk_len(m.origin, m.chunk) {
                let err = DistError::Invalid(format!(
                    "ring pass {} on {}: rank {} would send chunk {} of rank {}'s block as a {:?} tensor of {} elements on \
                     {:?}, but the pass moves {dtype:?} chunks of {} elements on {device:?}: a block changed size mid-pass",
                    self.what,
                    self.pg.name(),
                    self.pg.rank(),
                    m.chunk,
                    m.origin,
                    t.dtype(),
                    t.elem_count(),
                    t.device(),
                    self.chunk_len(m.origin, m.chunk)
                ));
                return Err(self.pg.lock().mesh.fail(err));
            }
        }
        #[cfg(feature = "nccl")]
        if let Device::Cuda(d) = device {
            if self.pg.cuda_path_of(d)? == crate::gpu::CudaPath::Nccl {
                let (what, _) = self.next_step();
                let out: Vec<(usize, &Tensor)> = sends.iter().map(|m| (m.peer, m.data)).collect();
                let into: Vec<(usize, usize)> = recvs.iter().map(|m| (m.peer, self.chunk_len(m.origin, m.chunk))).collect();
                return crate::with_elem_type!(dtype, T => super::cuda::ring_exchange::<T, R>(&self.pg, what, d, &out, &into, during),
                    other => Err(crate::dispatch::unsupported_dtype(other)));
            }
        }
        crate::with_elem_type!(dtype, T => self.exchange_host::<T, R>(sends, recvs, device, during),
            other => Err(crate::dispatch::unsupported_dtype(other)))
    }

    fn exchange_host<T: Elem + Send + Sync, R>(
        &self,
        sends: &[RingMessage<&Tensor>],
        recvs: &[RingMessage<()>],
        device: &Device,
        during: impl FnOnce() -> R,
    ) -> DistResult<(R, Vec<Tensor>)> {
        let data: Vec<Vec<T>> = host_copy(device, || {
            sends.iter().map(|m| m.data.flatten_all()?.to_vec1::<T>()).collect::<candle_core::Result<Vec<_>>>()
        })
        .map_err(candle)?;
        let out: Vec<RingMessage<&[T]>> = sends
            .iter()
            .zip(&data)
            .map(|(m, d)| RingMessage { peer: m.peer, origin: m.origin, chunk: m.chunk, data: &d[..] })
            .collect();
        let mut bufs: Vec<Vec<T>> = recvs.iter().map(|m| vec![T::zeroed(); self.chunk_len(m.origin, m.chunk)]).collect();
        let mut into: Vec<RingMessage<&mut [T]>> = recvs
            .iter()
            .zip(bufs.iter_mut())
            .map(|(m, b)| RingMessage { peer: m.peer, origin: m.origin, chunk: m.chunk, data: &mut b[..] })
            .collect();
        let r = self.exchange(&out, &mut into, during)?;
        drop(into);
        let got = host_copy(device, || {
            bufs.into_iter()
                .map(|b| {
                    let n = b.len();
                    Tensor::from_vec(b, n, device)
                })
                .collect::<candle_core::Result<Vec<_>>>()
        })
        .map_err(candle)?;
        Ok((r, got))
    }

    /// Ends the pass's exchanges of tensors on `device`: through NCCL, the host waits once,
    /// under the group's watchdog and watching the peers on the TCP mesh, for the pass's last
    /// exchange to finish (a peer that died mid-pass fails this rank here, naming it, instead
    /// of hanging the next read of the device); otherwise nothing (the host exchanges were
    /// waited for each in turn).
    pub fn settle(&self, device: &Device) -> DistResult<()> {
        #[cfg(feature = "nccl")]
        if let Device::Cuda(d) = device {
            if self.pg.cuda_path_of(d)? == crate::gpu::CudaPath::Nccl {
                return super::cuda::ring_settle(&self.pg, format!("{} (its end)", self.what));
            }
        }
        let _ = device;
        Ok(())
    }

    /// The pass's name and the next exchange's step, for messages; counts the exchange.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    fn next_step(&self) -> (String, u64) {
        let step = self.step.fetch_add(1, Ordering::Relaxed) + 1;
        (format!("{} step {step}", self.what), step)
    }
}

/// Runs the host copies of an exchange of tensors: for CPU tensors, outside the count of host
/// traffic (`candle_core::host_traffic`: with the CPU counted as a device they stand for the
/// transfers NCCL makes in device memory, as the CPU collectives' copies do); for tensors on a
/// device (the `host` path), counted, since they are real reads and uploads.
fn host_copy<R>(device: &Device, f: impl FnOnce() -> R) -> R {
    if device.is_cpu() {
        candle_core::host_traffic::uncounted(f)
    } else {
        f()
    }
}

fn candle(e: candle_core::Error) -> DistError {
    DistError::Invalid(format!("ring pass: {e}"))
}
