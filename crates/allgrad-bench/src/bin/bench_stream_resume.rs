//! What resuming a webdataset stream costs, before and after saved positions: the time to the
//! first batch at 90% of an epoch, read forward from the epoch's start (no saved position, as
//! a checkpoint without `stream.json` resumes) and from a saved position (the streams' shards
//! opened at their offsets, the shuffle buffers read again), as `scripts/bench/bench_stream_resume.sh`
//! runs it.
//!
//! ```text
//! bench_stream_resume --shards DIR --samples 50000 --per-shard 1000 --side 256
//! ```
//!
//! Writes `--samples` JPEGs of `--side`² pixels (each different) into shards of `--per-shard`
//! under `DIR` (kept and reused when `DIR/manifest.txt` says they are these), then, for an
//! epoch of all of them in global batches of `--global-batch` from `--streams` streams with
//! shuffle buffers of `--buffer`:
//!
//! - `forward`: a fresh stream asked for the batch at `--at` (0.9) of the epoch: every stream is
//!   read from the epoch's start (decoding each sample under `--on-corrupt skip`);
//! - `saved`: the position after that batch, through JSON as a checkpoint holds it, and a fresh
//!   stream resumed there asked for the next batch.
//!
//! Each prints `RESULT\t<forward|saved>\t<seconds>\t<samples read>`; then the two batches'
//! check (the resumed stream's batch equals the uninterrupted stream's next batch).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use allgrad::data::webdataset::{OnCorrupt, ShardStream, ShardWriter, StreamLoader, StreamState, WebDatasetOptions};
use allgrad::data::{Chw, ColorMode, DataResult, Image, LoaderConfig, Pipeline, ViewKey};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Where the shards are written (and reused).
    #[arg(long)]
    shards: PathBuf,
    /// Samples in the epoch (all of the shards).
    #[arg(long, default_value_t = 50_000)]
    samples: usize,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    per_shard: usize,
    /// Side of the square JPEGs.
    #[arg(long, default_value_t = 256)]
    side: u32,
    /// Streams.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Global batch (a multiple of the streams).
    #[arg(long, default_value_t = 256)]
    global_batch: usize,
    /// Shuffle buffer of each stream.
    #[arg(long, default_value_t = 1000)]
    buffer: usize,
    /// Loader worker threads.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Where in the epoch the resume is, as a fraction.
    #[arg(long, default_value_t = 0.9)]
    at: f64,
    /// Draw shards with replacement.
    #[arg(long)]
    resampled: bool,
    /// `skip` decodes every sample on the way forward.
    #[arg(long, default_value = "error")]
    on_corrupt: String,
}

/// One view per sample: the mean of its pixels (the bench times reading the stream, not views).
struct Mean;

impl Pipeline for Mean {
    fn num_views(&self) -> usize {
        1
    }

    fn view(&self, img: &Image, _: ViewKey) -> DataResult<Chw> {
        let mean = img.pixels.iter().map(|&b| b as f32).sum::<f32>() / img.pixels.len().max(1) as f32;
        Ok(Chw { channels: 1, height: 1, width: 1, data: vec![mean] })
    }
}

fn write_shards(a: &Args) -> Result<Vec<PathBuf>> {
    let manifest = a.shards.join("manifest.txt");
    let want = format!("samples {} per_shard {} side {}\n", a.samples, a.per_shard, a.side);
    let names = |n: usize| (0..n).map(|i| a.shards.join(format!("bench-{i:06}.tar"))).collect::<Vec<_>>();
    let shards = a.samples.div_ceil(a.per_shard);
    if std::fs::read_to_string(&manifest).ok().as_deref() == Some(want.as_str()) {
        return Ok(names(shards));
    }
    eprintln!("writing {} samples into {} ...", a.samples, a.shards.display());
    let mut w = ShardWriter::new(&a.shards, "bench", a.per_shard)?;
    for i in 0..a.samples {
        let img = image::RgbImage::from_fn(a.side, a.side, |x, y| {
            image::Rgb([(x as usize + i) as u8, (y as usize + 3 * i) as u8, ((x ^ y) as usize + 7 * i) as u8])
        });
        let mut jpeg = Vec::new();
        image::DynamicImage::ImageRgb8(img)
            .write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageOutputFormat::Jpeg(90))
            .context("encoding a JPEG")?;
        let cls = (i % 1000).to_string();
        w.write(&format!("s{i:08}"), &[("jpg", &jpeg), ("cls", cls.as_bytes())])?;
    }
    let written = w.finish()?;
    if written != names(shards) {
        bail!("the writer named its shards otherwise than expected");
    }
    std::fs::write(&manifest, want)?;
    Ok(written)
}

/// The batches of `plan` from `source` as they come: the time to the first, each one's values,
/// and the stream's position right after the first was handed out.
fn batches(source: &Arc<ShardStream>, plan: Vec<Vec<usize>>, workers: usize) -> Result<(f64, Vec<Vec<f32>>, StreamState)> {
    let cfg = LoaderConfig { workers, prefetch: 1, ..Default::default() };
    let started = Instant::now();
    let mut loader = StreamLoader::new(source.clone(), Arc::new(Mean), 1, 0, plan, &cfg, &Device::Cpu)?;
    let first = loader.next().context("no batch")??;
    let secs = started.elapsed().as_secs_f64();
    let state = source.state()?;
    let mut values = vec![first.views[0].flatten_all()?.to_vec1::<f32>()?];
    for b in loader {
        values.push(b?.views[0].flatten_all()?.to_vec1::<f32>()?);
    }
    Ok((secs, values, state))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let on_corrupt = match a.on_corrupt.as_str() {
        "error" => OnCorrupt::Error,
        "skip" => OnCorrupt::Skip,
        other => bail!("--on-corrupt {other}: error or skip"),
    };
    std::fs::create_dir_all(&a.shards)?;
    let shards = write_shards(&a)?;
    let opts = WebDatasetOptions {
        train: vec!["bench".into()],
        epoch_samples: a.samples,
        streams: a.streams,
        shuffle_buffer: a.buffer,
        resampled: a.resampled,
        on_corrupt,
        ..Default::default()
    };
    let open = || -> Result<Arc<ShardStream>> {
        Ok(Arc::new(ShardStream::new(shards.clone(), opts.clone(), a.global_batch, ColorMode::Rgb)?))
    };
    let steps = a.samples / a.global_batch;
    let k = ((steps as f64 * a.at) as usize).min(steps.saturating_sub(2));
    let batch = |b: usize| vec![(b * a.global_batch..(b + 1) * a.global_batch).collect::<Vec<_>>()];
    println!(
        "# {} samples, {} shards, streams {}, global batch {}, buffer {}, resume at step {k} of {steps}",
        a.samples,
        shards.len(),
        a.streams,
        a.global_batch,
        a.buffer
    );

    let forward = open()?;
    let (secs, uninterrupted, state) = batches(&forward, vec![batch(k)[0].clone(), batch(k + 1)[0].clone()], a.workers)?;
    println!("RESULT\tforward\t{secs:.3}\t{}", forward.samples_read());
    let saved: StreamState = serde_json::from_str(&serde_json::to_string(&state)?)?;

    let resumed = open()?;
    resumed.resume_from(saved)?;
    let (secs, got, _) = batches(&resumed, batch(k + 1), a.workers)?;
    println!("RESULT\tsaved\t{secs:.3}\t{}", resumed.samples_read());
    if got[0] != uninterrupted[1] {
        bail!("the resumed batch differs from the uninterrupted stream's");
    }
    println!("CHECK\tthe batch after the saved position equals the uninterrupted stream's");
    Ok(())
}
