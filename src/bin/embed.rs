//! `embed`: sentence embeddings from a Hugging Face BERT folder (pretrained, or exported by a
//! SimCSE run with `export-hf`), one JSON object per input line (the logic is
//! `allgrad_models::bert::embed_lines`).
//!
//! ```text
//! embed --model DIR [--pooling mean|cls|cls-before-pooler] [--max-len N] [--normalize] [FILE]
//! echo "a sentence" | embed --model data/models/all-MiniLM-L6-v2 --normalize
//! ```
//! prints `{"text": ..., "ids": [...], "embedding": [...]}` per non-empty line of FILE (or stdin).

use std::io::BufRead;
use std::path::PathBuf;

use allgrad_models::bert::{embed_lines, BertFolder, Pooling};
use anyhow::Context;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PoolingArg {
    Mean,
    Cls,
    /// `[CLS]` as the last layer leaves it (also spelled `cls_before_pooler`, as in SimCSE).
    #[value(alias = "cls_before_pooler")]
    ClsBeforePooler,
}

/// Embed sentences (one per line) with a Hugging Face BERT folder.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Folder with config.json, model.safetensors and tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// How the sentence embedding is read: mean of the tokens, the pooler over `[CLS]` (`cls`),
    /// or `[CLS]` as the last layer leaves it.
    #[arg(long, value_enum, default_value = "mean")]
    pooling: PoolingArg,
    /// Truncate to this many tokens, special tokens included.
    #[arg(long, default_value_t = 128)]
    max_len: usize,
    /// Scale every embedding to unit length.
    #[arg(long)]
    normalize: bool,
    /// Input file (default: stdin).
    file: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pooling = match args.pooling {
        PoolingArg::Mean => Pooling::Mean,
        PoolingArg::Cls => Pooling::Cls,
        PoolingArg::ClsBeforePooler => Pooling::ClsBeforePooler,
    };
    let folder = BertFolder::open(&args.model)?;
    let input: Box<dyn BufRead> = match &args.file {
        Some(f) => Box::new(std::io::BufReader::new(std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?)),
        None => Box::new(std::io::stdin().lock()),
    };
    embed_lines(&folder, pooling, args.max_len, args.normalize, input, std::io::stdout().lock())?;
    Ok(())
}
