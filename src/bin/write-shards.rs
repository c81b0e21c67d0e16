//! `write-shards`: a data set as webdataset tar shards (`data.format: webdataset`).
//!
//! ```text
//! write-shards --format folder --dir DIR [--split train] --out OUT [--prefix train] [--per-shard 1000]
//!              [--limit N] [--seed 0 | --in-order]
//! ```
//!
//! Reads split `--split` of the data set at `--dir` in `--format` (`folder`: the image files
//! of `DIR/<split>/<class>/`, kept as they are, JPEG or PNG; `idx`, `cifar10`: the decoded
//! images, written as PNG) and writes `OUT/<prefix>-000000.tar`, ... with `--per-shard`
//! samples each: members `<key>.jpg|png` and `<key>.cls` (the class id), keys
//! `<split>_<index>`. The samples are shuffled first (keyed by `--seed`; `--in-order` keeps
//! the data set's order), so that every shard mixes the classes, as a shuffle buffer needs.
//! For a folder, `OUT/classes.txt` lists the class names by id. Prints the shard pattern
//! to put under `data.webdataset.train` (or `test`).

use std::io::Write;
use std::path::PathBuf;

use allgrad::data::webdataset::ShardWriter;
use allgrad::data::{Cifar10, Dataset, FolderOptions, IdxDataset, ImageFolder, Split};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Folder,
    Idx,
    Cifar10,
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
    let data: Box<dyn Dataset> = match args.format {
        Format::Folder => {
            let f = ImageFolder::open(args.dir.join(&args.split), &FolderOptions::default())
                .with_context(|| format!("opening {}", args.dir.join(&args.split).display()))?;
            folder = Some(f.clone());
            Box::new(f)
        }
        Format::Idx => Box::new(IdxDataset::open_dir(&args.dir, split)?),
        Format::Cifar10 => Box::new(Cifar10::open_dir(&args.dir, split)?),
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
        let (ext, bytes) = match &folder {
            Some(f) => {
                let path = f.path(i).context("sample without a file")?;
                let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                let ext = if ext == "jpeg" { "jpg".to_string() } else { ext };
                (ext, std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
            }
            None => ("png".to_string(), data.get(i)?.to_png()?),
        };
        writer.write(&key, &[(ext.as_str(), &bytes), ("cls", cls.as_bytes())])?;
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
