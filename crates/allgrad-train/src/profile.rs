//! Named regions of a training step, each timed and with the host traffic it caused (device→host
//! reads, host→device uploads, synchronisations, cuDNN heuristic queries: [`allgrad_nn::host_traffic`],
//! the step's own thread), and the traffic of every thread of the process over the whole step
//! ([`allgrad_nn::process_host_traffic`]: the loader's and the kernels' threads too).
//!
//! The trainer marks the same regions in every step (`forward`, `backward`, `gradient sync`,
//! `optimizer`, `read`: see [`REGIONS`]); [`crate::Trainer::last_step_profile`] returns the
//! last step's and [`crate::Trainer::profile_table`] the totals over the steps so far. On the CPU a
//! region's time is wall-clock. On CUDA the host runs ahead of the device, so with profiling on
//! (`train --profile`, or `ALLGRAD_PROFILE=1`) each mark also records a CUDA event on the
//! device's stream and a region's time is the device's time between its two events (read once,
//! at the end of the step: profiling costs one wait per step); with profiling off the regions'
//! traffic is still counted and the times are the host's launch time.
//!
//! With profiling on, the passes of allgrad-nn's ops are timed too, by kind (`conv`,
//! `batch_norm`, `relu`, `linear`, `pool`, `layer_norm`, `attention`, `gelu`; forward and
//! backward; [`allgrad_nn::set_op_timing`]), and the table lists them under the regions.

use std::collections::BTreeMap;
use std::time::Instant;

use std::cell::Cell;

use allgrad_nn::{host_traffic, process_host_traffic, HostTraffic, OpTime, Pass};
use candle_core::Device;

/// The regions of a step, in order.
pub const REGIONS: [&str; 5] = ["forward", "backward", "gradient sync", "optimizer", "read"];

/// One region of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// Its name (one of [`REGIONS`]).
    pub name: &'static str,
    /// Seconds: the device's time between the region's CUDA events when profiling on CUDA,
    /// wall-clock otherwise.
    pub seconds: f64,
    /// The traffic it caused.
    pub traffic: HostTraffic,
}

/// The regions of one step (a region entered several times, `forward` and `backward` with
/// `train.accumulate`, is summed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepProfile {
    /// In the order first entered.
    pub regions: Vec<Region>,
    /// The traffic of every thread of the process from the start of the step's first region
    /// to the end of its last (the loader's uploads of coming batches included).
    pub process: HostTraffic,
}

impl StepProfile {
    /// The region named `name`, if the step entered it.
    pub fn region(&self, name: &str) -> Option<&Region> {
        self.regions.iter().find(|r| r.name == name)
    }

    /// The traffic of the whole step.
    pub fn traffic(&self) -> HostTraffic {
        let mut t = HostTraffic::default();
        for r in &self.regions {
            t += r.traffic;
        }
        t
    }

    fn add(&mut self, name: &'static str, seconds: f64, traffic: HostTraffic) {
        match self.regions.iter_mut().find(|r| r.name == name) {
            Some(r) => {
                r.seconds += seconds;
                r.traffic += traffic;
            }
            None => self.regions.push(Region { name, seconds, traffic }),
        }
    }
}

/// Where a region began.
pub(crate) struct Mark {
    at: Instant,
    traffic: HostTraffic,
    event: Option<Event>,
}

#[cfg(feature = "cuda")]
type Event = candle_core::cuda::cudarc::driver::CudaEvent;
#[cfg(not(feature = "cuda"))]
type Event = ();

/// A region of the current step: name, host seconds, traffic, start and end events.
type Entry = (&'static str, f64, HostTraffic, Option<(Event, Event)>);

/// Marks regions and keeps the last step's profile and the totals.
pub(crate) struct StepProfiler {
    /// Record CUDA events (profiling on a CUDA device).
    device: Option<Device>,
    /// This step's regions so far.
    current: Vec<Entry>,
    /// The process's traffic when this step's first region began, and when its last ended.
    process_start: Cell<Option<HostTraffic>>,
    process_end: HostTraffic,
    last: StepProfile,
    /// The first step (allocations, cuDNN plans, per-shape constants), kept out of the totals
    /// once a second step has run.
    first: Option<StepProfile>,
    totals: BTreeMap<&'static str, (f64, HostTraffic)>,
    steps: usize,
    /// Time the ops' passes (profiling on).
    ops: bool,
    /// The ops' times of the last step, and their totals (after the first step).
    ops_last: Vec<OpTime>,
    ops_totals: BTreeMap<(&'static str, Pass), (f64, u64)>,
}

impl StepProfiler {
    /// A profiler; `profiling`: time regions with CUDA events when `device` is a CUDA device,
    /// and the ops' passes (the trainer turns [`allgrad_nn::set_op_timing`] on for its thread).
    pub fn new(device: &Device, profiling: bool) -> Self {
        let device = (profiling && device.is_cuda()).then(|| device.clone());
        StepProfiler {
            device,
            current: Vec::new(),
            process_start: Cell::new(None),
            process_end: HostTraffic::default(),
            last: StepProfile::default(),
            first: None,
            totals: BTreeMap::new(),
            steps: 0,
            ops: profiling,
            ops_last: Vec::new(),
            ops_totals: BTreeMap::new(),
        }
    }

    /// The ops' times of the last step (empty unless profiling).
    pub fn last_ops(&self) -> &[OpTime] {
        &self.ops_last
    }

    fn event(&self) -> Option<Event> {
        #[cfg(feature = "cuda")]
        if let Some(Device::Cuda(d)) = &self.device {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            return d.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok();
        }
        let _ = &self.device;
        None
    }

    /// The start of a region.
    pub fn mark(&self) -> Mark {
        if self.process_start.get().is_none() {
            self.process_start.set(Some(process_host_traffic()));
        }
        Mark { event: self.event(), at: Instant::now(), traffic: host_traffic() }
    }

    /// The end of region `name`, begun at `m`.
    pub fn record(&mut self, name: &'static str, m: Mark) {
        let seconds = m.at.elapsed().as_secs_f64();
        let traffic = host_traffic() - m.traffic;
        self.process_end = process_host_traffic();
        let events = match (m.event, self.event()) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => None,
        };
        self.current.push((name, seconds, traffic, events));
    }

    /// Ends the step: device times are read (one wait for the device), the step's profile kept.
    pub fn finish_step(&mut self) {
        let mut step = StepProfile::default();
        if let Some(start) = self.process_start.take() {
            step.process = self.process_end - start;
        }
        for (name, host_seconds, traffic, events) in self.current.drain(..) {
            let seconds = match events {
                #[cfg(feature = "cuda")]
                Some((a, b)) => a.elapsed_ms(&b).map(|ms| ms as f64 / 1e3).unwrap_or(host_seconds),
                #[cfg(not(feature = "cuda"))]
                Some(_) => host_seconds,
                None => host_seconds,
            };
            step.add(name, seconds, traffic);
        }
        if self.ops {
            self.ops_last = allgrad_nn::take_op_times();
            if self.first.is_some() {
                for o in &self.ops_last {
                    let t = self.ops_totals.entry((o.kind, o.pass)).or_default();
                    t.0 += o.seconds;
                    t.1 += o.calls;
                }
            }
        }
        if self.first.is_none() {
            self.first = Some(step.clone());
        } else {
            for r in &step.regions {
                let t = self.totals.entry(r.name).or_default();
                t.0 += r.seconds;
                t.1 += r.traffic;
            }
            self.steps += 1;
        }
        self.last = step;
    }

    /// Drops a step begun but not finished (an error).
    pub fn abandon_step(&mut self) {
        self.current.clear();
        self.process_start.set(None);
        if self.ops {
            allgrad_nn::take_op_times();
        }
    }

    /// The last finished step's profile.
    pub fn last(&self) -> &StepProfile {
        &self.last
    }

    /// The totals so far as a table: per region, time per step and share, reads, uploads and
    /// cuDNN heuristic queries per step, over the steps after the first (the first alone when
    /// only one has run).
    pub fn table(&self) -> String {
        let mut totals = self.totals.clone();
        let (mut steps, mut which) = (self.steps, "after the first");
        if steps == 0 {
            for r in self.first.iter().flat_map(|f| &f.regions) {
                totals.insert(r.name, (r.seconds, r.traffic));
            }
            (steps, which) = (usize::from(self.first.is_some()), "the first");
        }
        let n = steps.max(1) as f64;
        let total: f64 = totals.values().map(|t| t.0).sum();
        let clock = if self.device.is_some() { "device time (CUDA events)" } else { "wall-clock" };
        let mut out = format!(
            "step profile over {steps} step(s) ({which}), {clock}\n{:<14} {:>10} {:>6} {:>8} {:>8} {:>10}\n",
            "region", "ms/step", "share", "reads", "uploads", "cudnn q."
        );
        let order = REGIONS.iter().filter(|r| totals.contains_key(*r));
        let mut all = HostTraffic::default();
        for name in order {
            let (s, t) = totals[name];
            all += t;
            out += &format!(
                "{:<14} {:>10.3} {:>5.1}% {:>8.1} {:>8.1} {:>10.1}\n",
                name,
                s / n * 1e3,
                if total > 0.0 { 100.0 * s / total } else { 0.0 },
                t.reads as f64 / n,
                t.uploads as f64 / n,
                t.heuristic_queries as f64 / n
            );
        }
        out += &format!(
            "{:<14} {:>10.3} {:>6} {:>8.1} {:>8.1} {:>10.1}\n",
            "step",
            total / n * 1e3,
            "",
            all.reads as f64 / n,
            all.uploads as f64 / n,
            all.heuristic_queries as f64 / n
        );
        let ops: Vec<OpTime> = if self.steps > 0 {
            self.ops_totals.iter().map(|(&(kind, pass), &(seconds, calls))| OpTime { kind, pass, seconds, calls }).collect()
        } else {
            self.ops_last.clone()
        };
        if !ops.is_empty() {
            out += &format!("{:<14} {:>10} {:>6} {:>8}\n", "op, pass", "ms/step", "share", "calls");
            for OpTime { kind, pass, seconds: s, calls } in ops {
                let pass = if pass == Pass::Forward { "fwd" } else { "bwd" };
                out += &format!(
                    "{:<14} {:>10.3} {:>5.1}% {:>8.1}\n",
                    format!("{kind} {pass}"),
                    s / n * 1e3,
                    if total > 0.0 { 100.0 * s / total } else { 0.0 },
                    calls as f64 / n
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_summed_per_step_and_tabled_with_their_traffic() {
        let mut p = StepProfiler::new(&Device::Cpu, true);
        for _ in 0..3 {
            for name in ["forward", "backward", "forward", "backward", "optimizer"] {
                let m = p.mark();
                std::thread::sleep(std::time::Duration::from_millis(2));
                p.record(name, m);
            }
            p.finish_step();
        }
        let last = p.last();
        assert_eq!(last.regions.iter().map(|r| r.name).collect::<Vec<_>>(), ["forward", "backward", "optimizer"]);
        assert!(last.region("forward").unwrap().seconds >= 0.004, "two entries of 2 ms: {last:?}");
        let table = p.table();
        assert!(table.contains("over 2 step(s) (after the first), wall-clock"), "{table}");
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].starts_with("forward") && lines[4].starts_with("optimizer") && lines[5].starts_with("step"), "{table}");
    }
}
