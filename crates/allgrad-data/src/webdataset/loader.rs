//! [`StreamLoader`]: the batches of a plan of stream positions, built on worker threads that
//! each read some of the streams.
//!
//! The plan lists this rank's coming (micro-)batches as positions of the epoch, ascending
//! (the trainer's unshuffled sampler gives exactly that). A batch's positions fall into
//! streams ([`StreamLayout::locate`]); worker `w` reads streams `l` with `l % workers == w`,
//! and for each batch in order builds the part of each of its streams: it reads the part's
//! samples, then decodes them and makes their views (keyed by the position) on as many threads
//! as make the workers asked for in all (a rank has `streams / W` streams, fewer than its
//! workers perhaps), each thread a run of consecutive samples, the views placed in order. The consumer takes the parts in the same (batch, stream)
//! order, so nothing waits in a cycle, and joins them in position order. A stream that the
//! plan enters in the middle (a resume) starts from its saved state when the stream has one
//! ([`ShardStream::resume_from`]), and is read forward from there (or from the epoch's start)
//! to that point. Each part carries its stream's state after it; when a batch is handed out,
//! those become the stream's position ([`ShardStream::state`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::Device;

use super::shard::Sample;
use super::stream::{Lane, LaneState, ShardStream};
use crate::augment::{Pipeline, ViewKey};
use crate::error::{DataError, DataResult};
use crate::host::{to_batch, Batch, HostBatch, HostView, Staging};
use crate::image::{Chw, Decoded};
use crate::loader::{place, views_of, LoaderConfig};

/// The part of one batch that one stream gives.
struct Part {
    batch: usize,
    lane: usize,
    positions: Vec<usize>,
    views: Vec<HostView>,
    labels: Vec<u32>,
    tokens: Vec<Vec<u32>>,
    /// The stream's state after this part.
    state: LaneState,
}

/// Every batch's positions grouped by stream: `(stream, positions)`, streams ascending.
type Groups = Vec<Vec<(usize, Vec<usize>)>>;

/// What the threads share.
#[derive(Clone)]
struct Work {
    source: Arc<ShardStream>,
    pipeline: Arc<dyn Pipeline>,
    seed: u64,
    epoch: u64,
    groups: Arc<Groups>,
    staging: Staging,
    /// Threads that decode and augment one part's samples ([`StreamLoader::new`]).
    decode_threads: usize,
    /// Decode JPEGs at the size the views need ([`LoaderConfig::scaled_decode`]).
    scaled_decode: bool,
}

/// The streams one thread reads, positioned.
struct Readers {
    work: Work,
    lanes: BTreeMap<usize, Lane>,
}

impl Readers {
    fn part(&mut self, batch: usize, lane: usize, positions: &[usize]) -> DataResult<Part> {
        let w = &self.work;
        let layout = w.source.layout();
        let first = layout.locate(positions[0]).1;
        let reader = match self.lanes.entry(lane) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(w.source.open_lane(w.seed, w.epoch, lane, first)?),
        };
        if reader.good() > first {
            return Err(DataError::Stream(format!(
                "position {} of stream {lane} was asked for after later ones (plans must ascend)",
                positions[0]
            )));
        }
        reader.fast_forward(first)?;
        let mut labels = Vec::with_capacity(positions.len());
        let mut tokens = Vec::new();
        let pipeline = w.pipeline.as_ref();
        if pipeline.takes_text() && w.source.caption().is_none() {
            return Err(DataError::Stream(
                "the pipeline takes captions but the stream reads none (ShardStream::with_caption)".into(),
            ));
        }
        // Read the part's samples in order (reading is sequential: a stream is one tar read
        // and one shuffle buffer), then decode and augment them on `decode_threads` threads,
        // each taking a run of consecutive samples, their views placed in position order.
        // Under `on_corrupt: skip` a sample's decode decides which sample comes next, so the
        // read decodes (at full size) and the threads only augment.
        let apart = w.source.decodes_apart();
        let mut read = Vec::with_capacity(positions.len());
        for &p in positions {
            let (_, m) = layout.locate(p);
            if m != reader.good() {
                return Err(DataError::Stream(format!("batch {batch}: positions of stream {lane} are not consecutive at {p}")));
            }
            let ((img, label, caption), shard, sample) = reader.next_good_read(!apart)?;
            labels.push(label as u32);
            if let (true, Some(text)) = (pipeline.takes_text(), caption) {
                tokens.push(pipeline.encode_text(&text)?);
            }
            read.push(match img {
                Some(img) => (p, Read::Decoded(Decoded::whole(img))),
                None => (p, Read::Later(shard, sample)),
            });
        }
        let key = |p: usize, view| ViewKey { seed: w.seed, epoch: w.epoch, index: p as u64, view };
        let one = |(p, r): &(usize, Read)| -> DataResult<(usize, Vec<Chw>)> {
            let decoded;
            let img = match r {
                Read::Decoded(img) => img,
                Read::Later(shard, sample) => {
                    let shrink = |wd: usize, ht: usize| pipeline.shrink(wd, ht, key(*p, 0));
                    decoded = w.source.decode_read(
                        *shard,
                        sample,
                        w.scaled_decode.then_some(&shrink as &dyn Fn(usize, usize) -> usize),
                    )?;
                    &decoded
                }
            };
            Ok((*p, views_of(img, *p, pipeline, &key)?))
        };
        let threads = w.decode_threads.clamp(1, read.len().max(1));
        let done: Vec<DataResult<(usize, Vec<Chw>)>> = if threads == 1 {
            read.iter().map(one).collect()
        } else {
            let run = read.len().div_ceil(threads);
            std::thread::scope(|scope| {
                let handles: Vec<_> = read
                    .chunks(run)
                    .enumerate()
                    .map(|(t, chunk)| {
                        std::thread::Builder::new()
                            .name(format!("allgrad-decode-{lane}-{t}"))
                            .spawn_scoped(scope, move || chunk.iter().map(one).collect::<Vec<_>>())
                            .map_err(|source| DataError::Spawn { worker: t, source })
                    })
                    .collect();
                let mut out = Vec::with_capacity(read.len());
                for h in handles {
                    match h {
                        Ok(h) => out.extend(h.join().unwrap_or_else(|_| {
                            vec![Err(DataError::Stream(format!("batch {batch}: a decode thread of stream {lane} panicked")))]
                        })),
                        Err(e) => out.push(Err(e)),
                    }
                }
                out
            })
        };
        let views = place(done.into_iter(), positions.len(), &w.staging)?;
        let state = reader.state();
        Ok(Part { batch, lane, positions: positions.to_vec(), views, labels, tokens, state })
    }
}

/// A sample of a part as read: decoded already, or to be decoded from its shard.
enum Read {
    Decoded(Decoded),
    Later(usize, Sample),
}

/// A batch and its streams' states after it.
type Built = (Batch, Vec<LaneState>);

/// Batches of stream positions, built ahead on worker threads; an iterator like
/// [`crate::Loader`], with the same [`Batch`] items. Dropping it stops the workers.
pub struct StreamLoader {
    work: Work,
    receivers: Vec<Receiver<DataResult<Part>>>,
    handles: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    inline: Option<Readers>,
    next: usize,
    device: Device,
    failed: bool,
    /// With copies to a device: the next batch, its copy started (see [`crate::host`]).
    ahead: Option<DataResult<Built>>,
}

impl StreamLoader {
    /// Starts building `batches` (positions of `epoch`, each batch ascending and later
    /// batches after earlier ones) from `source` through `pipeline`; `cfg.workers` threads
    /// (0: each batch is built when asked for, on the caller's thread), tensors on `device`.
    pub fn new(
        source: Arc<ShardStream>,
        pipeline: Arc<dyn Pipeline>,
        seed: u64,
        epoch: u64,
        batches: Vec<Vec<usize>>,
        cfg: &LoaderConfig,
        device: &Device,
    ) -> DataResult<Self> {
        let layout = source.layout();
        let epoch_samples = source.epoch_samples();
        let mut groups: Groups = Vec::with_capacity(batches.len());
        for (b, batch) in batches.iter().enumerate() {
            if batch.is_empty() {
                return Err(DataError::EmptyBatch { batch: b });
            }
            if let Some(&index) = batch.iter().find(|&&p| p >= epoch_samples) {
                return Err(DataError::IndexOutOfRange { index, len: epoch_samples });
            }
            if batch.windows(2).any(|w| w[0] >= w[1]) {
                return Err(DataError::Stream(format!("batch {b} of the plan is not in ascending position order")));
            }
            let mut by_lane: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for &p in batch {
                by_lane.entry(layout.locate(p).0).or_default().push(p);
            }
            groups.push(by_lane.into_iter().collect());
        }
        let staging = Staging::for_device(device)?;
        let streams = layout.streams;
        let workers = cfg.workers.min(streams);
        // A worker reads the streams `l % workers == w`; this rank's streams keep `busy` of
        // them reading, and each of those decodes a part on enough threads that all of them
        // together are the workers asked for (streams / W readers would otherwise be all).
        let busy = groups.iter().flatten().map(|(l, _)| l % workers.max(1)).collect::<std::collections::BTreeSet<_>>().len();
        let decode_threads = if workers == 0 { 1 } else { cfg.workers.div_ceil(busy.max(1)) };
        let work = Work {
            source,
            pipeline,
            seed,
            epoch,
            groups: Arc::new(groups),
            staging,
            decode_threads,
            scaled_decode: cfg.scaled_decode,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let mut loader = StreamLoader {
            work: work.clone(),
            receivers: Vec::new(),
            handles: Vec::new(),
            stop: stop.clone(),
            inline: None,
            next: 0,
            device: device.clone(),
            failed: false,
            ahead: None,
        };
        if workers == 0 {
            return Ok(loader);
        }
        // Room for about `prefetch` batches over all workers: a batch has parts from each of a
        // rank's streams.
        let per_batch = work.groups.first().map_or(1, |g| g.len()).div_ceil(workers);
        let capacity = (cfg.prefetch.div_ceil(workers) * per_batch).max(1);
        for w in 0..workers {
            let (tx, rx) = sync_channel(capacity);
            let (work, stop) = (work.clone(), stop.clone());
            let handle = std::thread::Builder::new()
                .name(format!("allgrad-stream-{w}"))
                .spawn(move || {
                    let groups = work.groups.clone();
                    let mut readers = Readers { work, lanes: BTreeMap::new() };
                    for (b, group) in groups.iter().enumerate() {
                        for (lane, positions) in group.iter().filter(|(l, _)| l % workers == w) {
                            if stop.load(Ordering::Relaxed) {
                                return;
                            }
                            let part = readers.part(b, *lane, positions);
                            let failed = part.is_err();
                            if tx.send(part).is_err() || failed {
                                return;
                            }
                        }
                    }
                })
                .map_err(|source| DataError::Spawn { worker: w, source })?;
            loader.receivers.push(rx);
            loader.handles.push(handle);
        }
        Ok(loader)
    }

    /// Number of batches in the plan.
    pub fn num_batches(&self) -> usize {
        self.work.groups.len()
    }

    fn build(&mut self, b: usize) -> DataResult<(HostBatch, Vec<LaneState>)> {
        let groups = self.work.groups.clone();
        let mut parts = Vec::with_capacity(groups[b].len());
        for (lane, positions) in &groups[b] {
            let part = if self.receivers.is_empty() {
                let work = self.work.clone();
                self.inline.get_or_insert_with(|| Readers { work, lanes: BTreeMap::new() }).part(b, *lane, positions)?
            } else {
                let w = lane % self.receivers.len();
                self.receivers[w].recv().map_err(|_| DataError::WorkerLost { worker: w, batch: b })??
            };
            if part.batch != b || part.lane != *lane || part.positions != *positions {
                return Err(DataError::Stream(format!("batch {b}: a worker delivered the part of another batch or stream")));
            }
            parts.push(part);
        }
        let mut host = HostBatch { indices: Vec::new(), views: Vec::new(), labels: Vec::new(), tokens: Vec::new() };
        let mut states = Vec::with_capacity(parts.len());
        for part in parts {
            states.push(part.state);
            let first = part.positions[0];
            host.indices.extend(part.positions);
            host.labels.extend(part.labels);
            host.tokens.extend(part.tokens);
            if host.views.is_empty() {
                host.views = part.views;
                continue;
            }
            for (view, more) in host.views.iter_mut().zip(part.views) {
                if more.sample != view.sample {
                    return Err(DataError::BatchShape { index: first, expected: view.sample, found: more.sample });
                }
                view.parts.extend(more.parts);
            }
        }
        Ok((host, states))
    }
}

impl StreamLoader {
    /// The next batch of the plan as tensors.
    fn take(&mut self) -> Option<DataResult<Built>> {
        let b = self.next;
        if b >= self.num_batches() || self.failed {
            return None;
        }
        self.next += 1;
        let out = self.build(b).and_then(|(h, states)| Ok((to_batch(h, &self.device)?, states)));
        // A stream that failed cannot go on: the batches after it would not be the plan's.
        self.failed = out.is_err();
        Some(out)
    }
}

impl Iterator for StreamLoader {
    type Item = DataResult<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        let current = if !self.work.staging.copies_ahead() {
            self.take()?
        } else {
            // To a device: hand out this batch once the next one's copy has been started.
            let current = self.ahead.take().or_else(|| self.take())?;
            if current.is_ok() {
                self.ahead = self.take();
            }
            current
        };
        // Handed out: its streams' states are the stream's position now.
        Some(current.map(|(batch, states)| {
            self.work.source.record(states);
            batch
        }))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.failed { 0 } else { self.num_batches() - self.next } + self.ahead.is_some() as usize;
        (left, Some(left))
    }
}

impl Drop for StreamLoader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.receivers.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
