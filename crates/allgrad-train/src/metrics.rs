//! What a person sees: `metrics.jsonl`, a progress bar (or periodic lines when the output is
//! not a terminal), and `loss.png` at the end.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use crate::config::{LogConfig, Progress};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// Steps completed.
    pub step: usize,
    /// Epoch of the step.
    pub epoch: usize,
    /// Mean over ranks of the per-rank losses (absent on evaluation lines).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss: Option<f64>,
    /// Learning rate of the step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lr: Option<f64>,
    /// Global samples per second since the last line.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub samples_per_s: Option<f64>,
    /// Global gradient norm before clipping.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_norm: Option<f64>,
    /// On a device (or the CPU's device path, `ALLGRAD_DEVICE_PATH=1`): the host traffic of the
    /// step this line is about, rank 0's.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub host_traffic: Option<StepTraffic>,
    /// A stream of `webdataset` shards: the samples (and shard faults) its streams left out so
    /// far in this epoch (`on_corrupt: skip`), over all ranks.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub data_skipped: Option<u64>,
    /// Evaluation metrics.
    #[serde(flatten)]
    pub eval: std::collections::BTreeMap<String, f64>,
}

impl Record {
    /// The line's scalars by name, as TensorBoard gets them: `loss`, `lr`, `samples_per_s`,
    /// `grad_norm`, `host_traffic/<field>`, `data_skipped` and each evaluation figure under its own name;
    /// `step` and `epoch` are where they stand, not scalars.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        let named = [("loss", self.loss), ("lr", self.lr), ("samples_per_s", self.samples_per_s), ("grad_norm", self.grad_norm)];
        for (name, v) in named {
            if let Some(v) = v {
                out.push((name.to_string(), v));
            }
        }
        if let Some(t) = &self.host_traffic {
            let fields = [
                ("step_reads", t.step_reads),
                ("step_uploads", t.step_uploads),
                ("reads", t.reads),
                ("uploads", t.uploads),
                ("syncs", t.syncs),
            ];
            out.extend(fields.iter().map(|(k, v)| (format!("host_traffic/{k}"), *v as f64)));
        }
        if let Some(n) = self.data_skipped {
            out.push(("data_skipped".into(), n as f64));
        }
        out.extend(self.eval.iter().map(|(k, v)| (k.clone(), *v)));
        out
    }
}

/// A step's host traffic ([`allgrad_nn::HostTraffic`]) in a metrics line: what a step on a
/// device keeps at zero (`step_reads`) and what it moves in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTraffic {
    /// Reads and synchronisations of the step's own thread in its forward, backward, gradient
    /// sync and optimizer: zero on a device, where nothing may wait for it before the update's
    /// launches.
    pub step_reads: u64,
    /// Uploads of the step's own thread in those regions: the inputs and random masks a method
    /// makes on the step's thread (none when a loader builds them ahead).
    pub step_uploads: u64,
    /// Device→host reads of every thread of the process during the step: one, the loss and the
    /// gradient norm read together after the update.
    pub reads: u64,
    /// Host→device uploads of every thread during the step (the loader's coming batches).
    pub uploads: u64,
    /// Explicit synchronisations of every thread during the step.
    pub syncs: u64,
}

/// The metrics file of a run (rank 0 only).
pub struct MetricsLog {
    path: PathBuf,
    file: File,
    /// Every record, for the plot.
    pub history: Vec<Record>,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl`. On resume, keeps the lines up to `resume_step` (a crash may
    /// have left lines past the checkpoint) and appends after them; otherwise starts afresh.
    ///
    /// Kept lines are written back as they were, byte for byte (re-serialising parsed numbers
    /// could change their last digit), into a temporary file that then replaces the old one,
    /// so a crash while resuming never loses the history.
    pub fn open(dir: &Path, resume_step: Option<usize>) -> std::io::Result<MetricsLog> {
        let path = dir.join("metrics.jsonl");
        let mut history = Vec::new();
        let mut kept = String::new();
        if let (Some(limit), Ok(f)) = (resume_step, File::open(&path)) {
            for line in BufReader::new(f).lines() {
                let line = line?;
                if let Ok(r) = serde_json::from_str::<Record>(&line) {
                    if r.step <= limit {
                        history.push(r);
                        kept.push_str(&line);
                        kept.push('\n');
                    }
                }
            }
        }
        let tmp = dir.join("metrics.jsonl.tmp");
        std::fs::write(&tmp, kept.as_bytes())?;
        std::fs::rename(&tmp, &path)?;
        let file = OpenOptions::new().append(true).open(&path)?;
        Ok(MetricsLog { path, file, history })
    }

    /// Appends a record.
    pub fn write(&mut self, r: Record) -> std::io::Result<()> {
        writeln!(self.file, "{}", serde_json::to_string(&r).expect("records serialise"))?;
        self.file.flush()?;
        self.history.push(r);
        Ok(())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Rank 0's progress display.
pub struct ProgressView {
    bar: Option<indicatif::ProgressBar>,
    lines: bool,
    quiet: bool,
    started: Instant,
}

impl ProgressView {
    /// A display for `total` steps starting at `done`.
    pub fn new(mode: Progress, total: usize, done: usize) -> Self {
        let use_bar = match mode {
            Progress::Bar => true,
            Progress::Auto => std::io::stderr().is_terminal(),
            _ => false,
        };
        let bar = use_bar.then(|| {
            let b = indicatif::ProgressBar::new(total as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]")
                    .expect("valid template"),
            );
            b.set_position(done as u64);
            b
        });
        let lines = mode == Progress::Lines || (mode == Progress::Auto && !use_bar);
        ProgressView { bar, lines, quiet: mode == Progress::Quiet, started: Instant::now() }
    }

    /// Shows the state after a step.
    pub fn update(&self, step: usize, total: usize, loss: f64, lr: f64, samples_per_s: f64, log_line: bool) {
        let msg = format!("loss {}  lr {lr:.3e}  {samples_per_s:.0} samples/s", significant(loss));
        if let Some(b) = &self.bar {
            b.set_position(step as u64);
            b.set_message(msg);
        } else if self.lines && log_line {
            eprintln!("step {step}/{total}  {msg}  ({:.1} s)", self.started.elapsed().as_secs_f64());
        }
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None if !self.quiet => eprintln!("{line}"),
            None => {}
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// `x` with four significant digits, for progress lines and summaries: `1.235`, `0.0003142`
/// (a SimCSE loss near 3e-5, `0.0000` at four decimals, prints as `3.142e-5`), `12346`.
pub fn significant(x: f64) -> String {
    if !x.is_finite() || x == 0.0 {
        return format!("{x}");
    }
    let magnitude = x.abs().log10().floor() as i32;
    if !(-4..6).contains(&magnitude) {
        return format!("{x:.3e}");
    }
    format!("{x:.*}", (3 - magnitude).max(0) as usize)
}

/// Draws `loss.png`: loss, learning rate and (when the objective's `evaluate` returned any)
/// every evaluation metric (kNN, linear probe, ...) against steps, one panel each, stacked
/// with the same step axis. Text needs a TrueType font: `font` (ALLGRAD_FONT, see
/// [`crate::settings`]), else DejaVu Sans where Debian installs it; without one the curves
/// are drawn unlabelled.
pub fn plot(history: &[Record], path: &Path, font: Option<&Path>) -> Result<(), String> {
    use plotters::prelude::*;
    let pts = |f: &dyn Fn(&Record) -> Option<f64>| -> Vec<(f64, f64)> {
        history.iter().filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v))).collect()
    };
    let loss = pts(&|r| r.loss);
    if loss.is_empty() {
        return Err("no loss values to plot".into());
    }
    type Panel = (String, Vec<(f64, f64)>, RGBColor);
    let mut panels: Vec<Panel> = vec![("loss".into(), loss, BLUE), ("learning rate".into(), pts(&|r| r.lr), RED)];
    let names: std::collections::BTreeSet<&String> = history.iter().flat_map(|r| r.eval.keys()).collect();
    let colors = [RGBColor(0, 128, 0), RGBColor(128, 0, 128), RGBColor(200, 120, 0), RGBColor(0, 128, 128)];
    for (i, name) in names.into_iter().enumerate() {
        panels.push((format!("{name} (evaluation)"), pts(&|r| r.eval.get(name).copied()), colors[i % colors.len()]));
    }
    panels.retain(|p| !p.1.is_empty());
    let labelled = register_font(font);
    let root = BitMapBackend::new(path, (900, 300 * panels.len() as u32 + 100)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((panels.len(), 1));
    let x_max = history.iter().map(|r| r.step).max().unwrap_or(1).max(1) as f64;
    for (area, (name, data, color)) in areas.iter().zip(&panels) {
        let (lo, hi) = data.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (_, y)| (a.min(*y), b.max(*y)));
        let pad = ((hi - lo) * 0.05).max(1e-12 + hi.abs() * 0.01);
        let mut chart = ChartBuilder::on(area);
        chart.margin(15);
        if labelled {
            chart.caption(name, ("sans-serif", 22)).x_label_area_size(35).y_label_area_size(70);
        }
        let mut chart = chart.build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad)).map_err(|e| e.to_string())?;
        if labelled {
            chart.configure_mesh().x_desc("step").draw().map_err(|e| e.to_string())?;
        }
        chart.draw_series(LineSeries::new(data.iter().copied(), color.stroke_width(2))).map_err(|e| e.to_string())?;
        // Evaluations are few: mark each point.
        if data.len() < 50 {
            chart.draw_series(data.iter().map(|p| Circle::new(*p, 4, color.filled()))).map_err(|e| e.to_string())?;
        }
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

fn register_font(font: Option<&Path>) -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let system = Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf");
        for c in font.into_iter().chain([system]) {
            if let Ok(bytes) = std::fs::read(c) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!("no TrueType font found (set ALLGRAD_FONT): loss.png is drawn without labels");
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_print_with_four_significant_digits_at_any_size() {
        let cases = [
            (1.23456, "1.235"),
            (12.3456, "12.35"),
            (3.14159e-5, "3.142e-5"),
            (3.14159e-4, "0.0003142"),
            (-0.0123456, "-0.01235"),
            (1.234567e-7, "1.235e-7"),
            (123456.7, "123457"),
            (9.87e8, "9.870e8"),
            (0.0, "0"),
            (f64::NAN, "NaN"),
        ];
        for (x, want) in cases {
            assert_eq!(significant(x), want, "{x}");
        }
    }

    fn record(step: usize, loss: Option<f64>, eval: &[(&str, f64)]) -> Record {
        Record {
            step,
            epoch: 0,
            loss,
            lr: loss.map(|_| 0.1),
            samples_per_s: None,
            grad_norm: None,
            host_traffic: None,
            data_skipped: None,
            eval: eval.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn a_resume_keeps_the_lines_up_to_its_step_byte_for_byte_and_drops_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        // 23/96 is a number whose parse-and-print round trip through serde_json's default
        // float parser changes the last digit (to ...337): the kept lines must not go through it.
        let lines = [
            r#"{"step":0,"epoch":0,"retrieval_top1":0.23958333333333334}"#,
            r#"{"step":1,"epoch":0,"loss":2.7111597061157227,"lr":0.2,"samples_per_s":6855.2625565559165,"grad_norm":1.0372818520518763}"#,
            r#"{"step":2,"epoch":0,"loss":2.6994853019714355,"lr":0.4,"grad_norm":1.1448522645529682}"#,
        ];
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n") + "\n{\"step\":3,\"ep").unwrap();
        let mut log = MetricsLog::open(dir.path(), Some(1)).unwrap();
        assert_eq!(log.history.len(), 2);
        log.write(record(2, Some(1.5), &[])).unwrap();
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let got: Vec<&str> = text.lines().collect();
        assert_eq!(got[..2], lines[..2]);
        assert_eq!(got.len(), 3, "{text}");
        assert!(got[2].starts_with(r#"{"step":2,"epoch":0,"loss":1.5"#), "{text}");
        assert!(!dir.path().join("metrics.jsonl.tmp").exists());
        // A fresh run starts afresh.
        MetricsLog::open(dir.path(), None).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap(), "");
    }

    #[test]
    fn the_plot_has_one_panel_per_evaluation_metric() {
        let dir = tempfile::tempdir().unwrap();
        let mut h: Vec<Record> = (1..=20).map(|s| record(s, Some(3.0 / s as f64), &[])).collect();
        h.push(record(0, None, &[("knn_top1", 0.2), ("linear_top1", 0.25)]));
        h.push(record(20, None, &[("knn_top1", 0.5), ("linear_top1", 0.6)]));
        let (with, without) = (dir.path().join("with.png"), dir.path().join("without.png"));
        plot(&h, &with, None).unwrap();
        plot(&h[..20], &without, None).unwrap();
        // Four panels (loss, lr, two metrics) of 300 px against two.
        let height = |p: &Path| {
            let b = std::fs::read(p).unwrap();
            u32::from_be_bytes([b[20], b[21], b[22], b[23]])
        };
        assert_eq!((height(&with), height(&without)), (1300, 700));
        assert!(plot(&h[20..], &without, None).unwrap_err().contains("no loss"));
    }
}
