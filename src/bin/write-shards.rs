//! `write-shards`: a data set as webdataset tar shards (`data.format: webdataset`), or image-caption
//! pairs as captioned shards (`method: clip`, `data.shards`).
//!
//! ```text
//! write-shards --format folder --dir DIR [--split train] --out OUT [--prefix train] [--per-shard 1000]
//!              [--limit N] [--seed 0 | --in-order] [--captions CLIP_CONFIG]
//! write-shards --format csv --dir PAIRS.csv --out OUT ...
//! ```
//!
//! Reads split `--split` of the data set at `--dir` in `--format` (`folder`: the image files
//! of `DIR/<split>/<class>/`, kept as they are, JPEG, PNG or WebP; `idx`, `cifar10`: the decoded
//! images, written as PNG) and writes `OUT/<prefix>-000000.tar`, ... with `--per-shard`
//! samples each: members `<key>.jpg|png|webp` and `<key>.cls` (the class id), keys
//! `<split>_<index>`. The samples are shuffled first (keyed by `--seed`; `--in-order` keeps
//! the data set's order), so that every shard mixes the classes, as a shuffle buffer needs.
//! For a folder, `OUT/classes.txt` lists the class names by id. Prints the shard pattern
//! to put under `data.webdataset.train` (or `test`).
//!
//! Captioned shards, as img2dataset writes them (a `txt` member per sample beside the image):
//! `--format csv` reads a CSV of `image,caption` (the image files kept as they are);
//! `--captions CONFIG` captions a labelled data set as a CLIP run config's `data.classes` and
//! `data.templates` do (the config's seed picks each sample's caption, as training on
//! `data.images` would), so that shards of Fashion-MNIST train as `configs/clip.yaml` does.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use allgrad::data::webdataset::ShardWriter;
use allgrad::data::{Cifar10, Dataset, FolderOptions, IdxDataset, ImageFolder, Split};
use allgrad::models::clip::{ClassCaptions, CsvPairs};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Folder,
    Idx,
    Cifar10,
    /// A CSV of `image,caption` pairs (`--dir` is the CSV file).
    Csv,
}

/// Write a data set as webdataset tar shards.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The data set's format.
    #[arg(long, value_enum)]
    format: Format,
    /// The data set's folder (for `folder`: the one holding `train/` and `test/`).
    #[arg(long)]
    dir: PathBuf,
    /// Which split: train or test.
    #[arg(long, default_value = "train")]
    split: String,
    /// Where to write the shards.
    #[arg(long)]
    out: PathBuf,
    /// Shard names: `<prefix>-NNNNNN.tar` (default: the split).
    #[arg(long)]
    prefix: Option<String>,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    per_shard: usize,
    /// Write only the first N samples (after shuffling); 0 for all.
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Seed of the shuffle before writing.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the data set's order (no shuffle).
    #[arg(long)]
    in_order: bool,
    /// Caption every sample (a `txt` member) from the class names and templates of this CLIP
    /// run config (`data.classes`, `data.templates`, `seed`).
    #[arg(long)]
    captions: Option<PathBuf>,
}

/// The class-caption settings of a CLIP run config: (classes, templates, seed).
fn caption_settings(path: &std::path::Path) -> Result<(Vec<Vec<String>>, Vec<String>, u64)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_yaml::Value = serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let data = &v["data"];
    let classes: Vec<Vec<String>> = serde_yaml::from_value(data["classes"].clone())
        .with_context(|| format!("{}: data.classes (a list of name lists)", path.display()))?;
    let templates: Vec<String> = serde_yaml::from_value(data["templates"].clone())
        .with_context(|| format!("{}: data.templates (a list of strings)", path.display()))?;
    let seed = v["seed"].as_u64().unwrap_or(0);
    Ok((classes, templates, seed))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let split = match args.split.as_str() {
        "train" => Split::Train,
        "test" => Split::Test,
        other => bail!("--split {other}: expected train or test"),
    };
    let prefix = args.prefix.clone().unwrap_or_else(|| args.split.clone());
    let mut folder = None;
    let mut csv = None;
    let data: Arc<dyn Dataset> = match args.format {
        Format::Folder => {
            let f = ImageFolder::open(args.dir.join(&args.split), &FolderOptions::default())
                .with_context(|| format!("opening {}", args.dir.join(&args.split).display()))?;
            folder = Some(f.clone());
            Arc::new(f)
        }
        Format::Idx => Arc::new(IdxDataset::open_dir(&args.dir, split)?),
        Format::Cifar10 => Arc::new(Cifar10::open_dir(&args.dir, split)?),
        Format::Csv => {
            let pairs = CsvPairs::open(&args.dir)?;
            csv = Some(pairs.clone());
            Arc::new(pairs)
        }
    };
    let data: Arc<dyn Dataset> = match &args.captions {
        Some(config) => {
            let (classes, templates, seed) = caption_settings(config)?;
            Arc::new(ClassCaptions::new(data, classes, templates, seed, None)?)
        }
        None => data,
    };
    let mut order: Vec<usize> = (0..data.len()).collect();
    if !args.in_order {
        allgrad::rng::shuffle(&mut allgrad::rng::stream(&[args.seed, 0x5AAD_0001]), &mut order);
    }
    if args.limit > 0 {
        order.truncate(args.limit);
    }
    let mut writer = ShardWriter::new(&args.out, &prefix, args.per_shard)?;
    for &i in &order {
        let key = format!("{}_{i:08}", args.split);
        let cls = data.label(i)?.to_string();
        let file = match (&folder, &csv) {
            (Some(f), _) => Some(f.path(i).context("sample without a file")?.to_path_buf()),
            (_, Some(c)) => Some(c.path(i)?.to_path_buf()),
            _ => None,
        };
        let (ext, bytes) = match file {
            Some(path) => {
                let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                let ext = if ext == "jpeg" { "jpg".to_string() } else { ext };
                (ext, std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?)
            }
            None => ("png".to_string(), data.get(i)?.to_png()?),
        };
        let text = data.text(i)?;
        let mut members: Vec<(&str, &[u8])> = vec![(ext.as_str(), &bytes)];
        if csv.is_none() {
            members.push(("cls", cls.as_bytes()));
        }
        if let Some(t) = &text {
            members.push(("txt", t.as_bytes()));
        }
        writer.write(&key, &members)?;
    }
    let pattern = writer.pattern();
    let shards = writer.finish()?;
    if let Some(f) = &folder {
        let mut out = std::fs::File::create(args.out.join("classes.txt"))?;
        for name in f.classes() {
            writeln!(out, "{name}")?;
        }
    }
    eprintln!("{} samples in {} shard(s) under {}", order.len(), shards.len(), args.out.display());
    println!("{pattern}");
    Ok(())
}
