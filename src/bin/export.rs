//! `export`: a run's model for PyTorch. The ResNet of a SimCLR, BarlowTwins or face run under
//! torchvision's and timm's parameter names (`allgrad_train::method::resnet_export`); a SimCSE
//! or CLIP run as a Hugging Face folder (`--format hf`, as `export-hf`).
//!
//! ```text
//! export --run runs/simclr/TIME --format torchvision|timm|safetensors|hf [--out DIR]
//! ```
//!
//! The default DIR is the run's `export/<format>/` (`hf/` for `--format hf`).

use std::path::PathBuf;

use allgrad_train::method::resnet_export::{export_run, ExportFormat};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    /// torchvision's ResNet (width 64, the ImageNet stem, 3 input channels).
    Torchvision,
    /// timm's ResNet (width 64, the ImageNet stem, 1 or 3 input channels).
    Timm,
    /// Any ResNet of a run, under the same names, with a note of what loads it.
    Safetensors,
    /// A Hugging Face folder (SimCSE, CLIP).
    Hf,
}

/// Export a run's model for PyTorch (torchvision, timm, plain safetensors, Hugging Face).
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The run directory (config.yaml and checkpoints/).
    #[arg(long)]
    run: PathBuf,
    /// What to write.
    #[arg(long, value_enum)]
    format: Format,
    /// Where to write the folder (default: RUN/export/FORMAT, or RUN/hf).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let format = match args.format {
        Format::Torchvision => ExportFormat::Torchvision,
        Format::Timm => ExportFormat::Timm,
        Format::Safetensors => ExportFormat::Safetensors,
        Format::Hf => {
            let cfg = std::fs::read_to_string(args.run.join("config.yaml")).unwrap_or_default();
            let out = if cfg.lines().any(|l| l.trim() == "method: clip") {
                allgrad_train::method::clip_export::export_run(&args.run, args.out.as_deref())?
            } else {
                allgrad_train::method::simcse_export::export_run(&args.run, args.out.as_deref())?
            };
            println!("{}", out.display());
            return Ok(());
        }
    };
    let out = export_run(&args.run, format, args.out.as_deref())?;
    println!("{}", out.display());
    Ok(())
}
