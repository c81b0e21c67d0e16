//! `export-hf`: the encoder of a SimCSE run (its newest checkpoint) as a Hugging Face folder
//! that `transformers.AutoModel`, `sentence-transformers` and `embed` load (the logic is
//! `allgrad_train::method::simcse_export::export_run`), or a CLIP run's model as a folder
//! `transformers`' `CLIPModel` loads (`allgrad_train::method::clip_export::export_run`).
//!
//! ```text
//! export-hf --run runs/simcse/TIME [--out DIR]      (default DIR: the run's hf/)
//! ```

use std::path::PathBuf;

use clap::Parser;

/// Export a SimCSE run's encoder or a CLIP run's model as a Hugging Face folder.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The run directory (config.yaml and checkpoints/).
    #[arg(long)]
    run: PathBuf,
    /// Where to write the folder (default: RUN/hf).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The run's method picks the exporter (its config.yaml says `method: clip` or `simcse`).
    let cfg = std::fs::read_to_string(args.run.join("config.yaml")).unwrap_or_default();
    let clip = cfg.lines().any(|l| l.trim() == "method: clip");
    let out = if clip {
        allgrad_train::method::clip_export::export_run(&args.run, args.out.as_deref())?
    } else {
        allgrad_train::method::simcse_export::export_run(&args.run, args.out.as_deref())?
    };
    println!("{}", out.display());
    Ok(())
}
