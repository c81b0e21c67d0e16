//! The PyTorch side of a step benchmark (`scripts/bench/bench_simclr_step.py --worker`,
//! `scripts/bench/bench_simcse_step.py --worker` or `scripts/bench/bench_clip_step.py
//! --worker`) as a child process that runs one step (or one layer breakdown, or a profile) per
//! command, so the two implementations alternate in one invocation while
//! each keeps its warm model and memory.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{bail, Context};

use crate::sample::Sample;

pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The worker's first line, e.g. `READY torch=2.5.1 threads=2`.
    pub banner: String,
}

/// `key=value` fields of an answer line after its tag, as numbers.
fn fields(line: &str, tag: &str) -> anyhow::Result<Sample> {
    let rest = line.strip_prefix(tag).with_context(|| format!("the PyTorch worker answered {line:?}, expected {tag}"))?;
    let mut s = Sample::new();
    for kv in rest.split_whitespace() {
        if let Some((k, v)) = kv.split_once('=') {
            if let Ok(v) = v.parse() {
                s.insert(k.to_string(), v);
            }
        }
    }
    Ok(s)
}

impl Peer {
    /// Starts the worker `script` (a path relative to the repository root) for `batch` with `python` and the options `--NAME VALUE` of
    /// `options`; `Ok(None)` when PyTorch is not installed (the worker exits with status 2).
    pub fn spawn(python: &str, script: &str, batch: usize, options: &[(&str, String)]) -> anyhow::Result<Option<Peer>> {
        // `script` is relative to the repository root: that of the checkout the benchmark was
        // built from, else the working directory (a binary built on one machine and run from a
        // copy of the repository on another).
        // This crate sits two folders below the repository root (crates/allgrad-bench).
        let built = format!("{}/../../{script}", env!("CARGO_MANIFEST_DIR"));
        let script = if std::path::Path::new(&built).exists() { built } else { script.to_string() };
        let mut args = vec!["--worker".to_string(), "--batch".to_string(), batch.to_string()];
        // An empty value passes a flag (`--tf32`) alone.
        for (name, value) in options {
            args.push(format!("--{name}"));
            if !value.is_empty() {
                args.push(value.clone());
            }
        }
        let mut child = match Command::new(python).arg(&script).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => {
                println!("(no PyTorch column: cannot run {python}: {e}; set PYTHON to an interpreter with torch)");
                return Ok(None);
            }
        };
        let stdin = child.stdin.take().context("worker stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("worker stdout")?);
        let mut banner = String::new();
        stdout.read_line(&mut banner)?;
        if !banner.starts_with("READY") {
            let status = child.wait()?;
            if status.code() == Some(2) {
                println!("(no PyTorch column: {python} cannot import torch; set PYTHON to an interpreter with torch)");
                return Ok(None);
            }
            bail!("the PyTorch worker ({python} {script}) did not start: {status}, first line {banner:?}");
        }
        Ok(Some(Peer { child, stdin, stdout, banner: banner.trim().to_string() }))
    }

    fn ask(&mut self, cmd: &str) -> anyhow::Result<String> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        self.line()
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the PyTorch worker exited ({:?})", self.child.wait()?);
        }
        Ok(line.trim().to_string())
    }

    /// One timed training step.
    pub fn step(&mut self) -> anyhow::Result<Sample> {
        let line = self.ask("step")?;
        fields(&line, "STEP")
    }

    /// The lines the worker answers `cmd` with, up to its `DONE` line (a profile's table).
    pub fn lines(&mut self, cmd: &str) -> anyhow::Result<Vec<String>> {
        let mut line = self.ask(cmd)?;
        let mut out = Vec::new();
        while line != "DONE" {
            out.push(line);
            line = self.line()?;
        }
        Ok(out)
    }

    /// The layer breakdown: (kind, count, forward s, backward s) per layer type.
    pub fn layers(&mut self) -> anyhow::Result<Vec<(String, usize, f64, f64)>> {
        let mut line = self.ask("layers")?;
        let mut out = Vec::new();
        while line != "DONE" {
            let kind = line.split_whitespace().nth(1).and_then(|k| k.strip_prefix("kind=")).unwrap_or("?").to_string();
            let f = fields(&line, "LAYER")?;
            let get = |k: &str| f.get(k).copied().with_context(|| format!("no {k} in the PyTorch worker's {line:?}"));
            out.push((kind, get("count")? as usize, get("fwd")?, get("bwd")?));
            line = self.line()?;
        }
        Ok(out)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}
