//! webdataset streams resumed from a saved position ([`ShardStream::state`]): on any W
//! (streams fixed), bit for bit the uninterrupted run's batches, reading the shuffle buffers
//! again instead of the epoch; shards changed since the position was saved; broken shards and
//! samples left out under `on_corrupt: skip`, the same on every W.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use allgrad_data::webdataset::{OnCorrupt, ShardReader, ShardStream, ShardWriter, StreamState, WebDatasetOptions};
use allgrad_data::ColorMode;

use super::webdataset::{first_batch_within, image_shards, keyed, options};

/// Global batch 12 from 6 streams (2 samples each a batch): W = 1, 2, 3 and 6 divide them.
const STREAMS: usize = 6;
const STEPS: usize = 20;

fn opts(resampled: bool, on_corrupt: OnCorrupt, buffer: usize) -> WebDatasetOptions {
    WebDatasetOptions { epoch_samples: 12 * STEPS, shuffle_buffer: buffer, ..options(STREAMS, resampled, on_corrupt) }
}

/// Rank r of w's share of global batches `steps` (global batch 12).
fn share(steps: std::ops::Range<usize>, r: usize, w: usize) -> Vec<Vec<usize>> {
    steps.map(|s| (s * 12 + r * 12 / w..s * 12 + (r + 1) * 12 / w).collect()).collect()
}

/// The global batches of `steps` on W ranks (one loader each, sharing `source` as the ranks'
/// processes would share nothing but the shards), as (position, key) lists.
fn global(
    source: &Arc<ShardStream>,
    keys: &HashMap<Vec<u8>, String>,
    steps: std::ops::Range<usize>,
    w: usize,
) -> Vec<Vec<(usize, String)>> {
    let ranks: Vec<_> = (0..w).map(|r| keyed(source, keys, 1, share(steps.clone(), r, w), 1 + r % 2)).collect();
    (0..steps.len()).map(|s| ranks.iter().flat_map(|rank| rank[s].clone()).collect()).collect()
}

/// The position after `steps` on W ranks, as a checkpoint holds it (through JSON), each rank's
/// part taken from its own stream and merged.
fn saved_after(
    shards: &[PathBuf],
    o: &WebDatasetOptions,
    keys: &HashMap<Vec<u8>, String>,
    steps: usize,
    w: usize,
) -> StreamState {
    let mut state = StreamState::default();
    for r in 0..w {
        let rank = Arc::new(ShardStream::new(shards.to_vec(), o.clone(), 12, ColorMode::Rgb).unwrap());
        keyed(&rank, keys, 1, share(0..steps, r, w), 1);
        let part = rank.state().unwrap();
        assert_eq!(part.lanes().count(), STREAMS / w, "rank {r} of {w} knows its own streams");
        state.merge(part).unwrap();
    }
    serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap()
}

#[test]
fn a_saved_position_resumes_on_any_world_size_reading_the_buffers_not_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    // 30 shards of 8 (an epoch of 240 = 20 steps); sample 77 is no image (for `skip`).
    let shards = image_shards(dir.path(), 240, 8, Some(77));
    let keys = good_keys(&shards);
    for (resampled, on_corrupt, buffer) in
        [(true, OnCorrupt::Skip, 7), (false, OnCorrupt::Skip, 7), (true, OnCorrupt::Skip, 0), (false, OnCorrupt::Skip, 30)]
    {
        let o = opts(resampled, on_corrupt, buffer);
        let what = format!("resampled {resampled}, buffer {buffer}");
        let whole =
            global(&Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap()), &keys, 0..STEPS, 2);
        for stop in [1, 9, 18] {
            let state = saved_after(&shards, &o, &keys, stop, 2);
            assert_eq!(state.lanes().count(), STREAMS);
            for w in [1, 2, 3] {
                let fresh = Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
                fresh.resume_from(state.clone()).unwrap();
                // One step: each stream reads its buffer again and the step's samples (two a
                // stream, and those left out on the way), wherever the position is.
                let next = global(&fresh, &keys, stop..stop + 1, w);
                let cost = fresh.samples_read();
                assert!(
                    cost as usize <= STREAMS * (buffer + 2 + 2),
                    "{what}: resuming at step {stop} on W = {w} read {cost} samples"
                );
                assert!(next[..] == whole[stop..stop + 1], "{what}: the step after a resume at {stop} on W = {w}");
                // Then on to the end of the epoch.
                let fresh = Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
                fresh.resume_from(state.clone()).unwrap();
                let rest = global(&fresh, &keys, stop..STEPS, w);
                assert!(rest[..] == whole[stop..], "{what}: resumed at step {stop} on W = {w}");
            }
            // Without the saved position, the streams are read from the epoch's start.
            let again = Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
            assert!(global(&again, &keys, stop..stop + 1, 1)[..] == whole[stop..stop + 1]);
            assert!(again.samples_read() as usize >= 12 * stop, "{what}: the fast-forward read {}", again.samples_read());
        }
        // The whole epoch left out the one corrupt sample wherever it was drawn, on every W.
        let ends: Vec<u64> = [1, 2, 3].iter().map(|&w| saved_after(&shards, &o, &keys, STEPS, w).skipped()).collect();
        assert!(ends.windows(2).all(|p| p[0] == p[1]), "{what}: left out per W {ends:?}");
    }
}

/// Keys by pixels of every sample that decodes (up to a shard's first fault).
fn good_keys(shards: &[PathBuf]) -> HashMap<Vec<u8>, String> {
    let mut out = HashMap::new();
    for s in shards {
        let mut r = ShardReader::open(s).unwrap();
        while let Ok(Some(sample)) = r.next_sample() {
            if let Some(Ok(img)) = sample.image().map(|(_, b)| allgrad_data::decode_image(b, ColorMode::Rgb, s)) {
                out.insert(img.pixels, sample.key.clone());
            }
        }
    }
    out
}

/// Copies of `shards` in `dir`.
fn copies(shards: &[PathBuf], dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    shards
        .iter()
        .map(|s| {
            let to = dir.join(s.file_name().unwrap());
            std::fs::copy(s, &to).unwrap();
            to
        })
        .collect()
}

#[test]
fn a_position_naming_changed_or_missing_shards_is_an_error_naming_the_shard_or_restarts_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let shards = image_shards(&dir.path().join("orig"), 240, 8, None);
    let keys = good_keys(&shards);
    for resampled in [true, false] {
        let o = opts(resampled, OnCorrupt::Error, 7);
        let state = saved_after(&shards, &o, &keys, 9, 2);
        let whole =
            global(&Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap()), &keys, 0..STEPS, 2);
        // Same bytes, a later modification time (a shard written again); bytes appended; gone.
        let later = |p: &PathBuf| {
            let f = std::fs::File::options().write(true).open(p).unwrap();
            f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(3600)).unwrap();
        };
        let longer = |p: &PathBuf| {
            let mut bytes = std::fs::read(p).unwrap();
            bytes.extend([0u8; 512]);
            std::fs::write(p, bytes).unwrap();
        };
        let gone = |p: &PathBuf| std::fs::remove_file(p).unwrap();
        for (what, change, says) in [
            ("touched", &later as &dyn Fn(&PathBuf), "changed since the checkpoint was written"),
            ("grown", &longer, "changed since the checkpoint was written"),
            ("removed", &gone, "is missing"),
        ] {
            let moved = copies(&shards, &dir.path().join(format!("{what}-{resampled}")));
            // The copies as they were: the position holds (the stamps follow the copies).
            let copy_state = saved_after(&moved, &o, &keys, 9, 2);
            moved.iter().for_each(change);
            let source = ShardStream::new(moved.clone(), o.clone(), 12, ColorMode::Rgb).unwrap();
            let err = source.resume_from(copy_state.clone()).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("reshard_ok"), "{what}: {err}");
            assert!(moved.iter().any(|p| err.contains(&p.display().to_string())), "{what}: no shard named: {err}");
            if what == "removed" {
                continue;
            }
            // With reshard_ok: logged, and the epoch's streams start over from where the run is.
            let ok = WebDatasetOptions { reshard_ok: true, ..o.clone() };
            let source = Arc::new(ShardStream::new(moved.clone(), ok, 12, ColorMode::Rgb).unwrap());
            source.resume_from(copy_state).unwrap();
            let again = global(&source, &keys, 9..STEPS, 2);
            let names = |b: &[Vec<(usize, String)>]| {
                b.iter().map(|s| s.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>()).collect::<Vec<_>>()
            };
            assert_eq!(names(&again), names(&whole[..STEPS - 9]), "{what}: the restarted epoch");
        }
        // Another stream layout cannot take the position.
        let other = WebDatasetOptions { streams: 4, ..o.clone() };
        let err =
            ShardStream::new(shards.clone(), other, 12, ColorMode::Rgb).unwrap().resume_from(state).unwrap_err().to_string();
        assert!(err.contains("6 streams") && err.contains("this run has 4"), "{err}");
    }
}

/// A PNG (24x20) or JPEG image of sample `i`, different for every `i`.
fn picture(i: usize, jpeg: bool) -> Vec<u8> {
    let img =
        image::RgbImage::from_fn(24, 20, |x, y| image::Rgb([(x as usize * 9 + i) as u8, (y * 11) as u8, (i * 53 % 256) as u8]));
    let mut out = Vec::new();
    let format = if jpeg { image::ImageOutputFormat::Jpeg(90) } else { image::ImageOutputFormat::Png };
    image::DynamicImage::ImageRgb8(img).write_to(&mut std::io::Cursor::new(&mut out), format).unwrap();
    out
}

/// The fault kinds a shard can hold, each made in a shard of 5 samples (`f<kind><n>`, classes
/// 0..5) where sample 2 is the faulty one; whether samples after it are still read.
const FAULTS: [(&str, bool); 6] =
    [("cut", false), ("header", false), ("repeated", false), ("missing", true), ("truncated_jpeg", true), ("corrupt_jpeg", true)];

fn faulty_shard(dir: &std::path::Path, kind: &str, base: usize) -> PathBuf {
    let mut w = ShardWriter::new(dir, kind, 5).unwrap();
    for i in 0..5 {
        let key = format!("f{kind}{i}");
        let cls = i.to_string();
        let mut img = picture(base + i, kind.ends_with("jpeg"));
        let mut members: Vec<(&str, Vec<u8>)> = Vec::new();
        if i == 2 {
            match kind {
                "repeated" => members.push(("png", img.clone())),
                "truncated_jpeg" => img.truncate(img.len() / 2),
                "corrupt_jpeg" => img[2..40].fill(0x5A),
                _ => {}
            }
        }
        let ext = if kind.ends_with("jpeg") { "jpg" } else { "png" };
        if !(i == 2 && kind == "missing") {
            members.push((ext, img));
        }
        members.push(("cls", cls.into_bytes()));
        let refs: Vec<(&str, &[u8])> = members.iter().map(|(e, b)| (*e, b.as_slice())).collect();
        w.write(&key, &refs).unwrap();
    }
    let path = w.finish().unwrap().remove(0);
    let offsets: Vec<u64> = {
        let mut r = ShardReader::open(&path).unwrap();
        let mut o = Vec::new();
        while let Ok(Some(s)) = r.next_sample() {
            o.push(s.offset);
        }
        o
    };
    let mut bytes = std::fs::read(&path).unwrap();
    match kind {
        "cut" => bytes.truncate(offsets[2] as usize + 700),
        "header" => bytes[offsets[2] as usize..offsets[2] as usize + 512].fill(b'x'),
        _ => {}
    }
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn every_fault_kind_stops_a_stream_naming_shard_and_byte_or_is_skipped_alike_on_every_w() {
    let dir = tempfile::tempdir().unwrap();
    let plan = vec![(0..4).collect()];
    let faulty: Vec<PathBuf> = FAULTS.iter().enumerate().map(|(k, (kind, _))| faulty_shard(dir.path(), kind, 10 * k)).collect();
    for (path, (kind, goes_on)) in faulty.iter().zip(FAULTS) {
        // One stream over the one shard, no shuffling: `error` stops at sample 2, naming the
        // shard and the byte.
        let o = WebDatasetOptions { shuffle_buffer: 0, epoch_samples: 4, ..options(1, false, OnCorrupt::Error) };
        let err = first_batch_within(vec![path.clone()], o.clone(), plan.clone()).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()) && err.contains("byte"), "{kind}: {err}");
        // `skip`: samples 0, 1 (whole, read before the fault), then 3, 4 where the shard goes on
        // after its fault, else the shard's next pass (0, 1 again); the fault counted once.
        let skip = WebDatasetOptions { on_corrupt: OnCorrupt::Skip, ..o.clone() };
        let labels = first_batch_within(vec![path.clone()], skip.clone(), plan.clone()).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let want: [u32; 4] = if goes_on { [0, 1, 3, 4] } else { [0, 1, 0, 1] };
        assert_eq!(labels, want, "{kind}");
        let source = Arc::new(ShardStream::new(vec![path.clone()], skip.clone(), 4, ColorMode::Rgb).unwrap());
        let keys = good_keys(std::slice::from_ref(path));
        keyed(&source, &keys, 0, plan.clone(), 0);
        assert_eq!(source.state().unwrap().skipped(), 1, "{kind}");
        // Past max_skipped of the stream's share of the epoch: an error naming the count.
        let strict = WebDatasetOptions { max_skipped: Some(0.2), ..skip };
        let err = first_batch_within(vec![path.clone()], strict, plan.clone()).unwrap_err().to_string();
        assert!(err.contains("left out 1 samples") && err.contains("max_skipped = 0.2"), "{kind}: {err}");
    }
    // All of them among good shards, 6 streams: the same batches, and the same samples left out,
    // on every W, with and without resampling.
    let good = image_shards(&dir.path().join("good"), 48, 8, None);
    let shards = [faulty.clone(), good].concat();
    let keys = good_keys(&shards);
    for resampled in [true, false] {
        let o = WebDatasetOptions { epoch_samples: 60, shuffle_buffer: 3, ..options(STREAMS, resampled, OnCorrupt::Skip) };
        let batches: Vec<_> = [1, 2, 3]
            .iter()
            .map(|&w| {
                let source = Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
                global(&source, &keys, 0..5, w)
            })
            .collect();
        assert!(batches.windows(2).all(|p| p[0] == p[1]), "resampled {resampled}: batches differ between W");
        let skipped: Vec<u64> = [1, 2, 3].iter().map(|&w| saved_after(&shards, &o, &keys, 5, w).skipped()).collect();
        assert!(skipped[0] > 0 && skipped.windows(2).all(|p| p[0] == p[1]), "resampled {resampled}: left out {skipped:?}");
    }
    // max_skipped outside (0, 1): an error naming the key.
    for f in [0.0, 1.0, -0.5, 2.0] {
        let o = WebDatasetOptions { max_skipped: Some(f), ..options(4, true, OnCorrupt::Skip) };
        let err = o.validate(12, 1).unwrap_err().to_string();
        assert!(err.contains("webdataset.max_skipped"), "{err}");
    }
}
