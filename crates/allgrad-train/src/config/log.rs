//! The `log` section: how often `metrics.jsonl` gets a line, how rank 0 shows progress, and
//! whether `loss.png` and TensorBoard's events file are written (the writers: `crate::metrics`,
//! `crate::tensorboard`).

use serde::{Deserialize, Serialize};

/// The `log` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Write a metrics line every this many steps.
    pub every: usize,
    /// Progress display on rank 0.
    pub progress: Progress,
    /// Draw `loss.png` at the end.
    pub plot: bool,
    /// Write every scalar of `metrics.jsonl` (loss, learning rate, samples/s, gradient norm,
    /// host traffic, evaluation figures) at the same step to a TensorBoard events file beside
    /// it, `events.out.tfevents.<secs>.<host>`, rank 0 only, flushed after each record. On by
    /// default: a few hundred bytes per line.
    pub tensorboard: bool,
}

/// How rank 0 shows progress.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    /// A bar when stderr is a terminal, log lines otherwise.
    Auto,
    /// Always a bar.
    Bar,
    /// Log lines every `every` steps.
    Lines,
    /// Nothing but the summary.
    Quiet,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { every: 10, progress: Progress::Auto, plot: true, tensorboard: true }
    }
}
