//! The loader on ImageNet-sized JPEGs: SimCLR's two views at 224, or (`--pipeline eval`) the
//! evaluation / CLIP view (decode, shortest side to 224 with Pillow's bicubic filter, the centre
//! 224x224, CLIP's normalisation: [`allgrad::data::Preprocess`]), as
//! `scripts/bench/bench_loader.sh` runs it beside torchvision (scripts/bench/bench_loader.py).
//!
//! ```text
//! bench_loader --images DIR loader --workers 2 --samples 512
//! bench_loader --images DIR stages --samples 200
//! bench_loader --images DIR --pipeline eval loader --workers 1 [--scaled-decode]
//! ```
//!
//! With `--pipeline eval` the RESULT lines say `loader-eval` and `stage-eval`, and the stages
//! are read, decode, resize+crop and to tensor.
//!
//! - `loader`: [`allgrad::data::Loader`] with `--workers` threads over `DIR/train` (an image
//!   folder), batches of `--batch` in file order, both views of every sample; the time from
//!   the start to the last batch, after one warm-up batch. Prints
//!   `RESULT\tloader\tallgrad\t<workers>\t<samples/s>`.
//! - `decoded`: the decoded pixels of the first images, for scripts/reference/compare_views.py.
//! - `stages`: one thread, each sample read, decoded and its two views built stage by stage
//!   ([`allgrad::data::Augment::apply_staged`]); prints
//!   `RESULT\tstage\tallgrad\t<stage>\t<ms per sample>` for read, decode, crop+resize (with
//!   the flip), jitter (with grayscale), blur, to tensor (normalisation), and total. Per
//!   sample: both views together.
//!
//! The recipe: RandomResizedCrop 224 (scale 0.08-1), flip 0.5, colour jitter (0.4, 0.4, 0.4,
//! 0.1) with p 0.8, grayscale 0.2, Gaussian blur (23 taps, sigma 0.1-2) with p 0.5, ImageNet
//! mean and std; the same as the torchvision peer's.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use allgrad::data::{
    AugmentConfig, ColorJitter, Dataset, FloatImage, FolderOptions, GaussianBlur, ImageFolder, Loader, LoaderConfig, Normalize,
    Pipeline, Preprocess, RandomGrayscale, RandomHorizontalFlip, RandomResizedCrop, Resample, Stage, TwoViews, ViewKey,
};
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Args {
    /// The image set (scripts/data/make_loader_images.py): `DIR/train/<class>/<n>.jpg`.
    #[arg(long)]
    images: PathBuf,
    /// Output side of the views.
    #[arg(long, default_value_t = 224)]
    size: usize,
    /// `simclr` (two augmented views) or `eval` (the evaluation / CLIP view).
    #[arg(long, default_value = "simclr", value_parser = ["simclr", "eval"])]
    pipeline: String,
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Samples per second through the threaded loader.
    Loader {
        /// Worker threads.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Samples timed (after one warm-up batch).
        #[arg(long, default_value_t = 512)]
        samples: usize,
        /// Samples per batch.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Decode JPEGs at the size the crop needs (`data.loader.scaled_decode`).
        #[arg(long)]
        scaled_decode: bool,
    },
    /// Milliseconds per sample of each stage, on one thread.
    Stages {
        /// Samples timed.
        #[arg(long, default_value_t = 200)]
        samples: usize,
    },
    /// The decoded pixels of the first samples (for scripts/reference/compare_views.py): per image its
    /// width and height (u32, little-endian), then its RGB bytes.
    Decoded {
        /// Images written.
        #[arg(long, default_value_t = 50)]
        samples: usize,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
    },
}

/// SimCLR's ImageNet views at `size`.
fn recipe(size: usize) -> AugmentConfig {
    AugmentConfig {
        crop: Some(RandomResizedCrop { size, scale: [0.08, 1.0], ratio: [3.0 / 4.0, 4.0 / 3.0] }),
        flip: RandomHorizontalFlip { p: 0.5 },
        color_jitter: ColorJitter { brightness: 0.4, contrast: 0.4, saturation: 0.4, hue: 0.1, p: 0.8 },
        grayscale: RandomGrayscale { p: 0.2 },
        blur: GaussianBlur { kernel: 23, sigma: [0.1, 2.0], p: 0.5 },
        normalize: Normalize { mean: vec![0.485, 0.456, 0.406], std: vec![0.229, 0.224, 0.225] },
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = args.images.join("train");
    let data =
        Arc::new(ImageFolder::open(&root, &FolderOptions::default()).with_context(|| format!("opening {}", root.display()))?);
    let views = Arc::new(TwoViews::new(recipe(args.size))?);
    let eval = args.pipeline == "eval";
    let clip = Arc::new(clip_view(args.size)?);
    match args.mode {
        Mode::Loader { workers, samples, batch, scaled_decode } => {
            let (pipeline, kind): (Arc<dyn Pipeline>, _) = if eval { (clip, "loader-eval") } else { (views, "loader") };
            loader(data, pipeline, kind, workers, samples, batch, scaled_decode)
        }
        Mode::Stages { samples } if eval => stages_eval(&data, &clip, samples),
        Mode::Stages { samples } => stages(&data, &views, samples),
        Mode::Decoded { samples, out } => {
            let mut bytes = Vec::new();
            for i in 0..samples.min(data.len()) {
                let img = data.get(i)?;
                bytes.extend((img.width as u32).to_le_bytes());
                bytes.extend((img.height as u32).to_le_bytes());
                bytes.extend(&img.pixels);
            }
            std::fs::write(&out, bytes).with_context(|| format!("writing {}", out.display()))
        }
    }
}

/// The evaluation / CLIP view at `size`: OpenAI CLIP's preprocessing.
fn clip_view(size: usize) -> Result<Preprocess> {
    let p = Preprocess {
        channels: 3,
        shortest_edge: Some(size),
        crop: Some([size, size]),
        resample: Resample::Bicubic,
        normalize: Normalize { mean: vec![0.48145466, 0.4578275, 0.40821073], std: vec![0.26862954, 0.261_302_6, 0.275_777_1] },
        random_crop: None,
    };
    p.validate()?;
    Ok(p)
}

fn loader(
    data: Arc<ImageFolder>,
    views: Arc<dyn Pipeline>,
    kind: &str,
    workers: usize,
    samples: usize,
    batch: usize,
    scaled_decode: bool,
) -> Result<()> {
    let total = samples + batch; // one warm-up batch
    if total > data.len() {
        bail!("{total} samples asked for (with a warm-up batch of {batch}), the set has {}", data.len());
    }
    let plan: Vec<Vec<usize>> = (0..total / batch).map(|b| (b * batch..(b + 1) * batch).collect()).collect();
    let cfg = LoaderConfig { workers, prefetch: 2 * workers.max(1), scaled_decode };
    let mut loader = Loader::new(data, views, 0, 0, plan, &cfg, &candle_core::Device::Cpu)?;
    loader.next().context("no batch")??;
    let start = Instant::now();
    let mut n = 0;
    for b in loader {
        n += b?.indices.len();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    println!("RESULT\t{kind}\tallgrad\t{workers}\t{rate:.1}");
    Ok(())
}

fn stages(data: &ImageFolder, views: &TwoViews, samples: usize) -> Result<()> {
    let names = ["read", "decode", "crop+resize", "jitter", "blur", "to tensor"];
    let mut secs = [0f64; 6];
    let n = samples.min(data.len());
    for i in 0..n {
        let path = data.path(i).context("no such sample")?;
        let t = Instant::now();
        let bytes = std::fs::read(path)?;
        secs[0] += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let img = allgrad::data::decode_image(&bytes, Default::default(), path)?;
        secs[1] += t.elapsed().as_secs_f64();
        for view in 0..2 {
            let key = ViewKey { seed: 0, epoch: 0, index: i as u64, view };
            let mut t = Instant::now();
            let aug = if view == 0 { views.first() } else { views.second() };
            aug.apply_staged(&img, key, |stage| {
                let k = match stage {
                    Stage::CropResize => 2,
                    Stage::Jitter => 3,
                    Stage::Blur => 4,
                    Stage::ToTensor => 5,
                };
                secs[k] += t.elapsed().as_secs_f64();
                t = Instant::now();
            })?;
        }
    }
    for (name, s) in names.iter().zip(secs) {
        println!("RESULT\tstage\tallgrad\t{name}\t{:.3}", s / n as f64 * 1e3);
    }
    println!("RESULT\tstage\tallgrad\ttotal\t{:.3}", secs.iter().sum::<f64>() / n as f64 * 1e3);
    Ok(())
}

fn stages_eval(data: &ImageFolder, view: &Preprocess, samples: usize) -> Result<()> {
    let names = ["read", "decode", "resize+crop", "to tensor"];
    let mut secs = [0f64; 4];
    let n = samples.min(data.len());
    for i in 0..n {
        let path = data.path(i).context("no such sample")?;
        let t = Instant::now();
        let bytes = std::fs::read(path)?;
        secs[0] += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let img = allgrad::data::decode_image(&bytes, Default::default(), path)?;
        secs[1] += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let key = ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 };
        let out = view.resized(&img, key)?;
        secs[2] += t.elapsed().as_secs_f64();
        let t = Instant::now();
        view.normalize.apply(&FloatImage::from_image(&out))?;
        secs[3] += t.elapsed().as_secs_f64();
    }
    for (name, s) in names.iter().zip(secs) {
        println!("RESULT\tstage-eval\tallgrad\t{name}\t{:.3}", s / n as f64 * 1e3);
    }
    println!("RESULT\tstage-eval\tallgrad\ttotal\t{:.3}", secs.iter().sum::<f64>() / n as f64 * 1e3);
    Ok(())
}
