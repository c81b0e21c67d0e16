//! The training stream over shards: `streams` independent streams, each a sequence of shards
//! read front to back through a shuffle buffer, every choice keyed (see the module docs of
//! [`crate::webdataset`]).
//!
//! Stream `l` of epoch `e`:
//! - its shards: draw `j` is shard `below(key(seed, e, l, j), S)` with `resampled`, else the
//!   `l`-th, `l + streams`-th, ... of a permutation of the S shards keyed by (seed, e),
//!   cycled;
//! - its samples: the shards' samples in order, through a buffer of `shuffle_buffer`: the
//!   buffer is filled, then the k-th sample out is the buffer's entry
//!   `below(key(seed, e, l, k), len)`, replaced by the next sample read; without `resampled`,
//!   where a pass over the stream's shards ends the buffer is emptied before the next pass is
//!   read, so each pass gives each of its samples exactly once;
//! - a corrupt sample is left out (`on_corrupt: skip`) or an error; a stream all of whose
//!   shards have been read through giving only corrupt samples is an error naming the last;
//! - its m-th good sample is position `(m / q) · B + l · q + m % q` of the epoch, with
//!   `q = B / streams`: global batch `m / q` takes q consecutive samples of each stream.
//!
//! Nothing here depends on the rank, the world size or the worker: those only choose which
//! streams a thread reads.
//!
//! A stream's whole state is small: its counters (good samples given, samples taken out of
//! the buffer, shards drawn, samples left out: every random draw is keyed by one of them, so
//! they are its random state), where it is in the shard it reads (a byte offset), and its
//! shuffle buffer as (shard, byte offset) of each sample ([`LaneState`]). A checkpoint keeps
//! that for every stream ([`StreamState`]); a resume opens the shard at the offset and reads
//! the buffer's samples again, one seek each: it costs the buffer, not the position.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use allgrad_rng::{below, shuffle, stream};
use serde::{Deserialize, Serialize};

use super::index::{decode_sample, decode_sample_shrunk, member_names};
use super::shard::{CaptionField, Sample, ShardReader};
use super::{OnCorrupt, WebDatasetOptions};
use crate::decode::ColorMode;
use crate::error::{DataError, DataResult};
use crate::image::{Decoded, Image};

/// Key words of the streams' random draws.
const TAG_SHARDS: u64 = 0x5AAD;
const TAG_SHUFFLE: u64 = 0x5B1F;

/// Where a position of an epoch comes from: `streams` streams, global batches of
/// `global_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLayout {
    /// Samples per global batch.
    pub global_batch: usize,
    /// Streams (dividing `global_batch`).
    pub streams: usize,
}

impl StreamLayout {
    /// Samples each stream gives each global batch.
    pub fn per_stream(&self) -> usize {
        self.global_batch / self.streams
    }

    /// The stream of position `p` and the number of good samples that stream gives before it.
    pub fn locate(&self, p: usize) -> (usize, u64) {
        let q = self.per_stream();
        let (batch, within) = (p / self.global_batch, p % self.global_batch);
        (within / q, (batch * q + within % q) as u64)
    }

    /// The position of stream `l`'s `m`-th good sample.
    pub fn position(&self, l: usize, m: u64) -> usize {
        let q = self.per_stream() as u64;
        ((m / q) * self.global_batch as u64 + (l as u64) * q + m % q) as usize
    }
}

/// The training shards and how to stream them; shared by the loader's threads.
#[derive(Debug)]
pub struct ShardStream {
    shards: Vec<PathBuf>,
    opts: WebDatasetOptions,
    layout: StreamLayout,
    color: ColorMode,
    skipped: AtomicU64,
    /// Image-caption pairs: where each sample's caption is (a sample without it is corrupt).
    caption: Option<CaptionField>,
    /// Samples read from shards (the buffer's, read again on resume, included).
    samples_read: AtomicU64,
    /// Each stream's state after the last batch a loader handed out.
    consumed: Mutex<BTreeMap<usize, LaneState>>,
    /// Where to resume ([`ShardStream::resume_from`]), and whether the epoch restarts instead.
    resume: Mutex<Option<(StreamState, bool)>>,
}

/// What identifies a shard's contents: its path, size and modification time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ShardStamp {
    path: PathBuf,
    bytes: u64,
    /// Seconds and nanoseconds since the Unix epoch, where the file system keeps it.
    modified: Option<(u64, u32)>,
}

impl ShardStamp {
    fn of(path: &Path) -> std::io::Result<ShardStamp> {
        let meta = std::fs::metadata(path)?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| (d.as_secs(), d.subsec_nanos()));
        Ok(ShardStamp { path: path.into(), bytes: meta.len(), modified })
    }
}

/// Where one stream stands after some batch: its counters (every random draw is keyed by
/// them), the shard it reads and the byte offset of its next sample there, its shuffle buffer
/// as (shard read, shard, byte offset) of each sample, and its bookkeeping of shard reads.
/// Saved in checkpoints (inside [`StreamState`]); its fields are the stream's own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaneState {
    lane: usize,
    epoch: u64,
    good: u64,
    emitted: u64,
    drawn: u64,
    skipped: u64,
    /// (shard read, shard, offset of its next sample, read to its end).
    reader: Option<(u64, usize, u64, bool)>,
    buffer: Vec<(u64, usize, u64)>,
    draining: bool,
    empty_in_a_row: usize,
    reads: Vec<(u64, ShardRead)>,
    dead: Vec<usize>,
    last_skip: Option<(u64, String)>,
}

impl LaneState {
    /// The stream.
    pub fn lane(&self) -> usize {
        self.lane
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Good samples it has given in the epoch.
    pub fn good(&self) -> u64 {
        self.good
    }

    /// Samples (and shard faults) it has left out in the epoch (`on_corrupt: skip`).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

/// The position of a training stream: every stream's [`LaneState`] after the same batch, with
/// the layout they were read in and the size and modification time of every shard they name.
/// Each rank knows its own streams; [`StreamState::merge`] joins the ranks' parts, and any
/// number of ranks resumes from the whole ([`ShardStream::resume_from`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamState {
    streams: usize,
    global_batch: usize,
    shard_count: usize,
    lanes: BTreeMap<usize, LaneState>,
    stamps: BTreeMap<usize, ShardStamp>,
}

impl StreamState {
    /// Whether it holds no stream.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// The streams it holds.
    pub fn lanes(&self) -> impl Iterator<Item = &LaneState> {
        self.lanes.values()
    }

    /// Samples its streams left out in their epoch (`on_corrupt: skip`).
    pub fn skipped(&self) -> u64 {
        self.lanes.values().map(|l| l.skipped).sum()
    }

    /// Adds `other`'s streams (another rank's part of the same position). Parts read with other
    /// layouts or shard lists are an error.
    pub fn merge(&mut self, other: StreamState) -> DataResult<()> {
        if other.is_empty() {
            return Ok(());
        }
        if self.is_empty() {
            let lanes = std::mem::take(&mut self.lanes);
            *self = other;
            self.lanes.extend(lanes);
            return Ok(());
        }
        let key = |s: &StreamState| (s.streams, s.global_batch, s.shard_count);
        if key(self) != key(&other) {
            return Err(DataError::Stream(format!(
                "stream positions of different layouts: (streams, global batch, shards) {:?} and {:?}",
                key(self),
                key(&other)
            )));
        }
        self.lanes.extend(other.lanes);
        self.stamps.extend(other.stamps);
        Ok(())
    }
}

impl ShardStream {
    /// The stream over `shards` (at least one) with `opts`, for global batches of
    /// `global_batch`. Checks that the shard list can feed the streams; the shards are first
    /// opened when read.
    pub fn new(shards: Vec<PathBuf>, opts: WebDatasetOptions, global_batch: usize, color: ColorMode) -> DataResult<Self> {
        if shards.is_empty() {
            return Err(DataError::Config { field: "webdataset.train", reason: "lists no shards".into() });
        }
        opts.validate(global_batch, 1)?;
        if !opts.resampled && shards.len() < opts.streams {
            return Err(DataError::Config {
                field: "webdataset.streams",
                reason: format!(
                    "webdataset.streams = {} but there are only {} shards: without resampling every stream needs a shard of \
                     its own (use fewer streams or resampled: true)",
                    opts.streams,
                    shards.len()
                ),
            });
        }
        let layout = StreamLayout { global_batch, streams: opts.streams };
        Ok(ShardStream {
            shards,
            opts,
            layout,
            color,
            skipped: AtomicU64::new(0),
            samples_read: AtomicU64::new(0),
            consumed: Mutex::new(BTreeMap::new()),
            resume: Mutex::new(None),
            caption: None,
        })
    }

    /// The stream of image-caption pairs: every sample's caption is read from `field` and
    /// handed out with it (the loader's [`crate::Batch::tokens`], through a pipeline that
    /// takes text); a sample without it is corrupt (an error naming the shard and the key, or
    /// left out under `on_corrupt: skip`).
    pub fn with_caption(mut self, field: CaptionField) -> Self {
        self.caption = Some(field);
        self
    }

    /// Whether a sample read without decoding ([`Lane::next_good_read`]) may be decoded later,
    /// apart from the read: under `on_corrupt: error`, where a sample's decode decides nothing
    /// about the samples after it (a failure stops the run). Under `skip`, a sample that does
    /// not decode is left out and the next one read in its place, so the read decodes.
    pub(super) fn decodes_apart(&self) -> bool {
        self.opts.on_corrupt == OnCorrupt::Error
    }

    /// Decodes the image of `sample`, read from shard `shard` ([`Lane::next_good_read`]), at
    /// 1/`s` of its size with `s` from `shrink` when given ([`crate::decode_image_shrunk`]);
    /// errors name the shard, the key and the offset.
    pub(super) fn decode_read(
        &self,
        shard: usize,
        sample: &Sample,
        shrink: Option<&dyn Fn(usize, usize) -> usize>,
    ) -> DataResult<Decoded> {
        let path = self.shards[shard].as_path();
        match shrink {
            Some(shrink) => decode_sample_shrunk(path, sample, self.color, shrink),
            None => decode_sample(path, sample, self.color).map(Decoded::whole),
        }
    }

    /// Where the captions are read from, for image-caption pairs.
    pub fn caption(&self) -> Option<&CaptionField> {
        self.caption.as_ref()
    }

    /// Samples read from the shards so far by this process: every sample a stream read, and
    /// on resume each shuffle buffer's samples read again. What a resume costs, counted.
    pub fn samples_read(&self) -> u64 {
        self.samples_read.load(Ordering::Relaxed)
    }

    /// Where the streams this process read stand after the last batch a loader handed out
    /// (each stream's latest state), with the size and modification time of the shards they
    /// name. Empty before any batch.
    pub fn state(&self) -> DataResult<StreamState> {
        let lanes = self.consumed.lock().expect("stream state lock").clone();
        let mut stamps = BTreeMap::new();
        for l in lanes.values() {
            let named = l.reader.iter().map(|r| r.1).chain(l.buffer.iter().map(|b| b.1)).chain(l.reads.iter().map(|r| r.1.shard));
            for s in named {
                if let std::collections::btree_map::Entry::Vacant(e) = stamps.entry(s) {
                    let path = &self.shards[s];
                    e.insert(ShardStamp::of(path).map_err(|e| DataError::io(path, e))?);
                }
            }
        }
        Ok(StreamState {
            streams: self.layout.streams,
            global_batch: self.layout.global_batch,
            shard_count: self.shards.len(),
            lanes,
            stamps,
        })
    }

    /// Resumes from `state` (every stream's, or at least this process's): a stream that a
    /// loader enters at the saved position of the saved epoch starts from its saved state
    /// (the shard opened at the saved offset, the buffer's samples read again), not from the
    /// epoch's start. Errors: a state of another layout (streams, global batch, number of
    /// shards); a shard it names missing or changed (size or modification time), unless
    /// `reshard_ok`, which logs it and restarts the saved epoch's streams from their first
    /// shards instead.
    pub fn resume_from(&self, state: StreamState) -> DataResult<()> {
        if state.is_empty() {
            return Ok(());
        }
        if (state.streams, state.global_batch) != (self.layout.streams, self.layout.global_batch) {
            return Err(DataError::Stream(format!(
                "the checkpoint's stream position was read as {} streams of global batches of {}, this run has {} and {}: \
                 the data order would differ (set webdataset.streams and train.global_batch as they were)",
                state.streams, state.global_batch, self.layout.streams, self.layout.global_batch
            )));
        }
        let changed = self.changed_shard(&state);
        let restart = match changed {
            None => false,
            Some(why) if self.opts.reshard_ok => {
                let epoch = state.lanes.values().map(|l| l.epoch).max().unwrap_or(0);
                tracing::warn!(
                    target: "allgrad_data::webdataset",
                    "{why}; webdataset.reshard_ok: restarting epoch {epoch}'s streams from their first shards"
                );
                true
            }
            Some(why) => {
                return Err(DataError::Stream(format!(
                    "{why}: the checkpoint's stream position cannot be read (set webdataset.reshard_ok: true to restart \
                     the epoch's streams instead)"
                )))
            }
        };
        *self.resume.lock().expect("stream state lock") = Some((state, restart));
        Ok(())
    }

    /// Why the shards of `state` are not those of this stream, if they are not.
    fn changed_shard(&self, state: &StreamState) -> Option<String> {
        if state.shard_count != self.shards.len() {
            return Some(format!(
                "the shard list had {} shards when the checkpoint was written, it has {} now",
                state.shard_count,
                self.shards.len()
            ));
        }
        for (&i, saved) in &state.stamps {
            let path = &self.shards[i];
            if *path != saved.path {
                return Some(format!(
                    "shard {i} of the list was {} when the checkpoint was written, it is {} now",
                    saved.path.display(),
                    path.display()
                ));
            }
            match ShardStamp::of(path) {
                Err(e) => return Some(format!("shard {} is missing ({e})", path.display())),
                Ok(now) if now != *saved => {
                    return Some(format!(
                        "shard {} changed since the checkpoint was written ({} bytes, modified {:?} then; {} bytes, \
                         modified {:?} now)",
                        path.display(),
                        saved.bytes,
                        saved.modified,
                        now.bytes,
                        now.modified
                    ))
                }
                Ok(_) => {}
            }
        }
        None
    }

    /// Drops the members `webdataset.fields` does not list (when it lists any).
    fn keep_fields(&self, sample: &mut Sample) {
        let fields = &self.opts.fields;
        if !fields.is_empty() {
            sample.members.retain(|(ext, _)| fields.iter().any(|f| f == ext));
        }
    }

    /// Notes the states of the streams of a batch handed out.
    pub(super) fn record(&self, states: Vec<LaneState>) {
        let mut consumed = self.consumed.lock().expect("stream state lock");
        for s in states {
            consumed.insert(s.lane, s);
        }
    }

    /// Stream `lane` of `epoch` for a plan whose first sample of it is its `first`-th good
    /// one: from the saved state when [`ShardStream::resume_from`] has one of this epoch at
    /// or before `first` (then read forward from there), else from the epoch's start.
    pub(super) fn open_lane(self: &Arc<Self>, seed: u64, epoch: u64, lane: usize, first: u64) -> DataResult<Lane> {
        let saved = {
            let resume = self.resume.lock().expect("stream state lock");
            match &*resume {
                Some((state, restart)) => state.lanes.get(&lane).filter(|s| s.epoch == epoch).map(|s| (s.clone(), *restart)),
                None => None,
            }
        };
        match saved {
            Some((_, true)) => {
                // The epoch restarts: the stream's first samples fill the positions from here.
                let mut l = self.lane(seed, epoch, lane);
                l.good = first;
                Ok(l)
            }
            Some((s, false)) if s.good <= first => self.restore(seed, &s),
            _ => Ok(self.lane(seed, epoch, lane)),
        }
    }

    /// The stream as `s` saved it: the shard being read opened at its offset, the buffer's
    /// samples read again (one seek each).
    fn restore(self: &Arc<Self>, seed: u64, s: &LaneState) -> DataResult<Lane> {
        let bad = |shard: usize| {
            DataError::Stream(format!("the saved position of stream {} names shard {shard}, of {}", s.lane, self.shards.len()))
        };
        let path = |shard: usize| self.shards.get(shard).ok_or_else(|| bad(shard));
        let mut l = self.lane(seed, s.epoch, s.lane);
        if let Some((d, shard, offset, done)) = s.reader {
            l.reader = Some((d, shard, ShardReader::resume(path(shard)?, offset, done)?));
        }
        for &(d, shard, offset) in &s.buffer {
            let p = path(shard)?;
            let mut sample = ShardReader::open_at(p, offset)?.next_sample()?.ok_or_else(|| DataError::Shard {
                shard: p.clone(),
                offset,
                reason: "no sample where the saved shuffle buffer has one".into(),
            })?;
            self.keep_fields(&mut sample);
            self.samples_read.fetch_add(1, Ordering::Relaxed);
            l.buffer.push((d, shard, sample));
        }
        l.good = s.good;
        l.emitted = s.emitted;
        l.drawn = s.drawn;
        l.skipped = s.skipped;
        l.draining = s.draining;
        l.empty_in_a_row = s.empty_in_a_row;
        l.reads = s.reads.iter().cloned().collect();
        l.dead = s.dead.iter().copied().collect();
        l.last_skip = s.last_skip.clone();
        Ok(l)
    }

    /// Samples per epoch.
    pub fn epoch_samples(&self) -> usize {
        self.opts.epoch_samples
    }

    /// The layout of positions over streams.
    pub fn layout(&self) -> StreamLayout {
        self.layout
    }

    /// The shards.
    pub fn shards(&self) -> &[PathBuf] {
        &self.shards
    }

    /// Corrupt samples left out so far by this process (`on_corrupt: skip`), fast-forwards
    /// on resume included.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// Stream `lane` of `epoch` at its start.
    pub(super) fn lane(self: &Arc<Self>, seed: u64, epoch: u64, lane: usize) -> Lane {
        let own = if self.opts.resampled {
            Vec::new()
        } else {
            let mut perm: Vec<usize> = (0..self.shards.len()).collect();
            shuffle(&mut stream(&[seed, TAG_SHARDS, epoch]), &mut perm);
            perm.into_iter().skip(lane).step_by(self.opts.streams).collect()
        };
        Lane {
            src: self.clone(),
            seed,
            epoch,
            lane,
            own,
            drawn: 0,
            reader: None,
            buffer: Vec::with_capacity(self.opts.shuffle_buffer),
            draining: false,
            empty_in_a_row: 0,
            reads: BTreeMap::new(),
            dead: BTreeSet::new(),
            last_skip: None,
            emitted: 0,
            good: 0,
            skipped: 0,
        }
    }
}

/// One read of a shard by a stream (its `drawn`-th), until all its samples are out of the
/// shuffle buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ShardRead {
    shard: usize,
    /// Samples read from it.
    samples: usize,
    /// Of those, still in the shuffle buffer.
    waiting: usize,
    /// Whether one of its samples was good.
    good: bool,
    /// Whether it has been read to its end.
    finished: bool,
}

/// A good sample: its image (when decoded), class and caption (image-caption pairs).
pub(super) type Good = (Option<Image>, usize, Option<String>);

/// A sample read, with the number of the shard read it came from and its shard.
type Read = (u64, usize, Sample);

/// One stream of one epoch, read forward.
pub(super) struct Lane {
    src: Arc<ShardStream>,
    seed: u64,
    epoch: u64,
    lane: usize,
    /// Without resampling: this stream's shards, in order.
    own: Vec<usize>,
    /// Shards started.
    drawn: u64,
    /// The shard being read: the number of the read, the shard, its reader.
    reader: Option<(u64, usize, ShardReader)>,
    buffer: Vec<Read>,
    /// Without resampling: a pass over the stream's shards has ended and the buffer is being
    /// emptied; the next pass is read once it is empty (so that every pass gives each of its
    /// samples once).
    draining: bool,
    /// Shards read to their end in a row without a sample.
    empty_in_a_row: usize,
    /// The shard reads with samples still in the buffer (or not read to their end), by number.
    reads: BTreeMap<u64, ShardRead>,
    /// Shards of which a whole read gave only corrupt samples (under `on_corrupt: skip`) and
    /// no sample since was good: when every shard the stream reads is here, it can give
    /// nothing, and says so instead of skipping forever.
    dead: BTreeSet<usize>,
    /// The last sample left out as corrupt: its offset and why.
    last_skip: Option<(u64, String)>,
    /// Samples taken out of the buffer.
    emitted: u64,
    /// Good samples given.
    good: u64,
    /// Samples (and shard faults) left out.
    skipped: u64,
}

impl Lane {
    /// Good samples given so far (the next one is number `good()`).
    pub(super) fn good(&self) -> u64 {
        self.good
    }

    /// Where the stream stands now (see [`LaneState`]).
    pub(super) fn state(&self) -> LaneState {
        LaneState {
            lane: self.lane,
            epoch: self.epoch,
            good: self.good,
            emitted: self.emitted,
            drawn: self.drawn,
            skipped: self.skipped,
            reader: self.reader.as_ref().map(|(d, s, r)| {
                let (offset, done) = r.resume_point();
                (*d, *s, offset, done)
            }),
            buffer: self.buffer.iter().map(|(d, s, sample)| (*d, *s, sample.offset)).collect(),
            draining: self.draining,
            empty_in_a_row: self.empty_in_a_row,
            reads: self.reads.iter().map(|(d, r)| (*d, r.clone())).collect(),
            dead: self.dead.iter().copied().collect(),
            last_skip: self.last_skip.clone(),
        }
    }

    /// Leaves out what `e` says is corrupt (at byte `offset` of its shard): logged, counted,
    /// and, past `max_skipped` of the stream's share of the epoch, an error naming the count.
    fn leave_out(&mut self, offset: u64, e: &DataError) -> DataResult<()> {
        self.skipped += 1;
        let n = self.src.skipped.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!("skipping ({n} so far in this process): {e}");
        self.last_skip = Some((offset, e.to_string()));
        if let Some(f) = self.src.opts.max_skipped {
            let share = self.src.opts.epoch_samples / self.src.opts.streams;
            if self.skipped as f64 > f * share as f64 {
                return Err(DataError::Stream(format!(
                    "stream {} left out {} samples in epoch {}, more than webdataset.max_skipped = {f} of its {share} \
                     samples of the epoch; the last: {e}",
                    self.lane, self.skipped, self.epoch
                )));
            }
        }
        Ok(())
    }

    /// The next sample read from the shards (endless: shards are drawn again and again), or
    /// `None` where a pass over the stream's own shards ends (without resampling).
    fn read(&mut self) -> DataResult<Option<Read>> {
        loop {
            if let Some((d, s, reader)) = &mut self.reader {
                let (d, s) = (*d, *s);
                let got = match reader.next_sample() {
                    Ok(got) => got,
                    // A broken shard (cut short, a bad header, a repeated member): under
                    // `skip`, the rest of this read of it is left out, as one fault.
                    Err(e @ DataError::Shard { .. }) if self.src.opts.on_corrupt == OnCorrupt::Skip => {
                        let offset = if let DataError::Shard { offset, .. } = &e { *offset } else { 0 };
                        self.leave_out(offset, &e)?;
                        None
                    }
                    Err(e) => return Err(e),
                };
                let read = self.reads.get_mut(&d).expect("a shard being read is listed");
                if let Some(mut sample) = got {
                    self.src.keep_fields(&mut sample);
                    self.src.samples_read.fetch_add(1, Ordering::Relaxed);
                    read.samples += 1;
                    read.waiting += 1;
                    self.empty_in_a_row = 0;
                    return Ok(Some((d, s, sample)));
                }
                read.finished = true;
                let empty = read.samples == 0;
                self.reader = None;
                self.settle(d)?;
                if empty {
                    self.empty_in_a_row += 1;
                    if self.empty_in_a_row > 10 * self.src.shards.len() + 10 {
                        return Err(DataError::Stream(format!(
                            "stream {}: {} shards in a row held no sample; are the shards empty?",
                            self.lane, self.empty_in_a_row
                        )));
                    }
                }
                if !self.src.opts.resampled && self.drawn.is_multiple_of(self.own.len() as u64) {
                    return Ok(None);
                }
            }
            let s = if self.src.opts.resampled {
                below(&mut stream(&[self.seed, TAG_SHARDS, self.epoch, self.lane as u64, self.drawn]), self.src.shards.len())
            } else {
                self.own[(self.drawn % self.own.len() as u64) as usize]
            };
            let reader = ShardReader::open(&self.src.shards[s])?;
            self.reads.insert(self.drawn, ShardRead { shard: s, samples: 0, waiting: 0, good: false, finished: false });
            self.reader = Some((self.drawn, s, reader));
            self.drawn += 1;
        }
    }

    /// Shard read `d` once a sample of it is out of the buffer or it has been read to its
    /// end: when both are done, whether it gave only corrupt samples, and then whether every
    /// shard the stream reads did (an error).
    fn settle(&mut self, d: u64) -> DataResult<()> {
        let Some(read) = self.reads.get(&d) else { return Ok(()) };
        if !read.finished || read.waiting > 0 {
            return Ok(());
        }
        let read = self.reads.remove(&d).expect("looked up above");
        if read.samples == 0 || read.good {
            return Ok(());
        }
        self.dead.insert(read.shard);
        let readable = if self.src.opts.resampled { self.src.shards.len() } else { self.own.len() };
        if self.dead.len() < readable {
            return Ok(());
        }
        let (offset, why) = self.last_skip.clone().unwrap_or_default();
        Err(DataError::Shard {
            shard: self.src.shards[read.shard].clone(),
            offset,
            reason: format!(
                "every sample of this shard was left out as corrupt (on_corrupt: skip), and so was every sample of the \
                 other shards stream {} reads ({readable} in all): it has no sample to give; the last left out: {why}",
                self.lane
            ),
        })
    }

    /// The next sample out of the shuffle buffer.
    fn next_candidate(&mut self) -> DataResult<Read> {
        let cap = self.src.opts.shuffle_buffer;
        loop {
            if cap == 0 {
                match self.read()? {
                    Some(r) => return Ok(r),
                    None => continue,
                }
            }
            while !self.draining && self.buffer.len() < cap {
                match self.read()? {
                    Some(r) => self.buffer.push(r),
                    None => self.draining = true,
                }
            }
            if self.buffer.is_empty() {
                // The end of a pass, the buffer emptied: the next pass.
                self.draining = false;
                continue;
            }
            let mut rng = stream(&[self.seed, TAG_SHUFFLE, self.epoch, self.lane as u64, self.emitted]);
            let j = below(&mut rng, self.buffer.len());
            self.emitted += 1;
            return Ok(self.buffer.swap_remove(j));
        }
    }

    /// The next good sample: its image (decoded when `decode`), class (0 without `cls`) and,
    /// for image-caption pairs, caption.
    /// Corrupt samples are skipped or an error, as configured; without `decode` only what
    /// can be checked without decoding is (the fast-forward of a resume under
    /// `on_corrupt: error`, where a sample that would not decode would have stopped the run).
    /// Under `skip`, once every shard the stream reads has been read through giving only
    /// corrupt samples, an error naming the last of them and why.
    pub(super) fn next_good(&mut self, decode: bool) -> DataResult<Good> {
        self.next_good_read(decode).map(|(good, _, _)| good)
    }

    /// [`Lane::next_good`], with the sample itself and the number of its shard (to decode it
    /// later, [`ShardStream::decode_read`]).
    pub(super) fn next_good_read(&mut self, decode: bool) -> DataResult<(Good, usize, Sample)> {
        loop {
            let (d, s, sample) = self.next_candidate()?;
            let path = self.src.shards[s].as_path();
            let checked = self.check(path, &sample, decode);
            let read = self.reads.get_mut(&d).expect("a shard read with samples in the buffer is listed");
            read.waiting -= 1;
            match checked {
                Ok(out) => {
                    read.good = true;
                    self.dead.remove(&s);
                    self.settle(d)?;
                    self.good += 1;
                    return Ok((out, s, sample));
                }
                Err(e) if self.src.opts.on_corrupt == OnCorrupt::Skip => {
                    self.leave_out(sample.offset, &e)?;
                    self.settle(d)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn check(&self, path: &Path, sample: &Sample, decode: bool) -> DataResult<Good> {
        let class = match sample.class() {
            None => 0,
            Some(Ok(c)) => c,
            Some(Err(text)) => {
                return Err(DataError::CorruptSample {
                    shard: path.into(),
                    key: sample.key.clone(),
                    offset: sample.offset,
                    reason: format!("cls `{text}` is not a class id"),
                })
            }
        };
        let caption = match &self.src.caption {
            None => None,
            Some(field) => Some(sample.caption(field).map_err(|reason| DataError::CorruptSample {
                shard: path.into(),
                key: sample.key.clone(),
                offset: sample.offset,
                reason,
            })?),
        };
        if !decode {
            if sample.image().is_none() {
                return Err(DataError::CorruptSample {
                    shard: path.into(),
                    key: sample.key.clone(),
                    offset: sample.offset,
                    reason: format!("no jpg, jpeg, png or webp member (members: {})", member_names(sample)),
                });
            }
            return Ok((None, class, caption));
        }
        Ok((Some(decode_sample(path, sample, self.src.color)?), class, caption))
    }

    /// Reads forward until `target` good samples have been given. Under `on_corrupt: skip`
    /// every sample is decoded (which ones were left out depends on it); under `error` none is.
    pub(super) fn fast_forward(&mut self, target: u64) -> DataResult<()> {
        let decode = self.src.opts.on_corrupt == OnCorrupt::Skip;
        while self.good < target {
            self.next_good(decode)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_streams_are_inverse() {
        let layout = StreamLayout { global_batch: 12, streams: 4 };
        for p in 0..100 {
            let (l, m) = layout.locate(p);
            assert!(l < 4);
            assert_eq!(layout.position(l, m), p);
        }
        // Global batch 1 takes samples 3, 4, 5 of every stream, stream 0 first.
        assert_eq!(layout.locate(12), (0, 3));
        assert_eq!(layout.locate(15), (1, 3));
        assert_eq!(layout.locate(23), (3, 5));
        // Rank 1 of 2 holds positions 6..12 of each batch: streams 2 and 3 only.
        assert!((0..10).all(|b| (6..12).all(|i| layout.locate(b * 12 + i).0 >= 2)));
    }
}
