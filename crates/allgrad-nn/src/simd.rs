//! Which SIMD instruction set allgrad-nn's own vectorised loops run with: the element-wise maths
//! of [`crate::vmath`] (`exp`, `erf`: GELU, softmax, attention), the layer norm's rows, the
//! channel sums, batch norm's passes and conv2d's im2col and col2im; and, through the exported [`simd_dispatch!`](crate::simd_dispatch),
//! the loops of the tiled loss's fused kernel in allgrad-models.
//!
//! An op takes its [`SimdPlan`] (the level and the counters of the thread that plans it) once,
//! and its parallel tasks run the copy the plan names; the dispatch arm that runs counts itself
//! ([`simd_paths`]), so a dispatch that ran another copy than the one asked for shows in the
//! counts. f64 GELU (Candle's scalar `erf`) and f64 `exp` (the C library's) have one copy,
//! whatever the level: f64 GELU counts as baseline.
//!
//! The crate is built for baseline x86-64 so that one binary runs on every machine of a
//! cluster; these loops carry copies compiled for AVX2 (+FMA) and for AVX-512 (F), chosen at
//! run time. Every copy performs the same IEEE operations in the same order (no fast-math, no
//! implied FMA contraction, and row sums kept in [`LANES`] fixed partial sums whatever the
//! register width), so all of them give identical bits: the level changes the speed only.
//! The GEMM crate picks its own kernels at run time (AVX-512 where the CPU has it) and does
//! not read this setting.
//!
//! `ALLGRAD_CPU_SIMD` (read once) forces a level: `auto` (the default: the widest the CPU has),
//! `avx512`, `avx2` or `baseline`. A value outside those, or a level the CPU lacks, is an error
//! naming the variable, returned by the first op that runs one of these loops (and by
//! [`simd_level`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::error::NnError;

/// Partial sums a row reduction keeps (one AVX-512 register of f32, two of AVX2): fixed, so
/// that a sum does not depend on the path.
pub(crate) const LANES: usize = 16;

/// The environment variable that forces a level.
pub const SIMD_VAR: &str = "ALLGRAD_CPU_SIMD";

/// An instruction set the vectorised loops can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// x86-64's SSE2 (or the target's baseline elsewhere).
    Baseline,
    /// AVX2 with FMA (256-bit).
    Avx2,
    /// AVX-512 F (512-bit).
    Avx512,
}

impl SimdLevel {
    /// The name `ALLGRAD_CPU_SIMD` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Baseline => "baseline",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// The widest level this CPU has.
    pub fn detected() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return SimdLevel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Baseline
    }

    /// The level a value of `ALLGRAD_CPU_SIMD` names on a CPU whose widest level is `cpu`.
    ///
    /// # Errors
    /// [`NnError::Setting`] naming the variable, for a value that is not `auto`, `avx512`,
    /// `avx2` or `baseline`, or a level above `cpu`.
    pub fn parse(value: &str, cpu: SimdLevel) -> Result<SimdLevel, NnError> {
        let bad = |why: String| NnError::Setting { var: SIMD_VAR, value: value.to_string(), why };
        let level = match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => return Ok(cpu),
            "avx512" => SimdLevel::Avx512,
            "avx2" => SimdLevel::Avx2,
            "baseline" => SimdLevel::Baseline,
            _ => return Err(bad("expected auto, avx512, avx2 or baseline".into())),
        };
        if level > cpu {
            return Err(bad(format!("this CPU's widest level is {}", cpu.name())));
        }
        Ok(level)
    }
}

/// The level of `ALLGRAD_CPU_SIMD` (read once), or the error its value gives.
fn setting() -> &'static Result<SimdLevel, NnError> {
    static SETTING: OnceLock<Result<SimdLevel, NnError>> = OnceLock::new();
    SETTING.get_or_init(|| match std::env::var(SIMD_VAR) {
        Ok(v) => SimdLevel::parse(&v, SimdLevel::detected()),
        Err(std::env::VarError::NotPresent) => Ok(SimdLevel::detected()),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(NnError::Setting { var: SIMD_VAR, value: v.to_string_lossy().into_owned(), why: "not valid UTF-8".into() })
        }
    })
}

/// The level allgrad-nn's vectorised loops run with on this thread: the one [`force_simd`]
/// set, else `ALLGRAD_CPU_SIMD`'s, else the widest the CPU has.
///
/// # Errors
/// [`NnError::Setting`] when `ALLGRAD_CPU_SIMD` holds a bad value (see the module docs).
pub fn simd_level() -> Result<SimdLevel, NnError> {
    if let Some(level) = FORCED.with(Cell::get) {
        return Ok(level);
    }
    setting().clone()
}

/// [`simd_level`] for the loops that cannot fail (`vmath`'s slices): a bad setting has already
/// failed the op that called them, or the caller is outside an op; they take the CPU's level.
pub(crate) fn active() -> SimdPlan {
    SimdPlan::on_this_thread(simd_level().unwrap_or_else(|_| SimdLevel::detected()))
}

/// [`simd_level`] for an op about to run its vectorised loops: the plan its copies are chosen
/// by, counted in [`simd_paths`] of this thread when a copy runs (on whichever thread).
pub(crate) fn for_kernel() -> candle_core::Result<SimdPlan> {
    Ok(simd_plan()?)
}

/// The plan of an op about to run vectorised loops (for kernels outside this crate that use
/// [`simd_dispatch!`](crate::simd_dispatch)): [`simd_level`] and this thread's counters.
///
/// # Errors
/// [`NnError::Setting`] when `ALLGRAD_CPU_SIMD` holds a bad value (see the module docs).
#[doc(hidden)]
pub fn simd_plan() -> Result<SimdPlan, NnError> {
    Ok(SimdPlan::on_this_thread(simd_level()?))
}

/// Copies run per level, for one planning thread: atomics, because the copies run on the
/// worker threads of the op's pool.
#[derive(Default)]
struct Sink {
    avx512: AtomicU64,
    avx2: AtomicU64,
    baseline: AtomicU64,
}

thread_local! {
    static FORCED: Cell<Option<SimdLevel>> = const { Cell::new(None) };
    // One per thread that plans ops, for the life of the process (three counters: a worker's
    // copies may still count into it while the planning thread exits).
    static SINK: &'static Sink = Box::leak(Box::default());
}

/// The level an op's copies run at and where they count (see [`simd_paths`]): made on the
/// thread that plans the op, copied into its parallel tasks, and read by the dispatch, whose
/// arm that runs counts itself ([`SimdPlan::ran`]).
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct SimdPlan {
    level: SimdLevel,
    sink: &'static Sink,
}

impl std::fmt::Debug for SimdPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimdPlan").field("level", &self.level).finish_non_exhaustive()
    }
}

impl SimdPlan {
    pub(crate) fn on_this_thread(level: SimdLevel) -> SimdPlan {
        SimdPlan { level, sink: SINK.with(|s| *s) }
    }

    /// The level whose copy the dispatch is to run.
    pub fn level(self) -> SimdLevel {
        self.level
    }

    /// Counts one run of `level`'s copy: called by the dispatch arm that runs (and by the
    /// loops that have one copy, with [`SimdLevel::Baseline`]), never by the planner.
    pub fn ran(self, level: SimdLevel) {
        let c = match level {
            SimdLevel::Avx512 => &self.sink.avx512,
            SimdLevel::Avx2 => &self.sink.avx2,
            SimdLevel::Baseline => &self.sink.baseline,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Copies of the vectorised loops that ran per level for the ops planned on one thread (a
/// copy is one call of a dispatched loop: an op runs one or more per parallel task), counted
/// by the arm of the dispatch that ran, for the tests of each path.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimdPaths {
    /// Runs of the AVX-512 copies.
    pub avx512: u64,
    /// Runs of the AVX2 copies.
    pub avx2: u64,
    /// Runs of the baseline copies (and of the loops that have only one copy: f64 GELU).
    pub baseline: u64,
}

impl SimdPaths {
    /// The count of `level`.
    pub fn at(self, level: SimdLevel) -> u64 {
        match level {
            SimdLevel::Avx512 => self.avx512,
            SimdLevel::Avx2 => self.avx2,
            SimdLevel::Baseline => self.baseline,
        }
    }
}

/// The counts of the ops planned on this thread so far (their copies may have run on other
/// threads; read it after the ops returned).
#[doc(hidden)]
pub fn simd_paths() -> SimdPaths {
    SINK.with(|s| SimdPaths {
        avx512: s.avx512.load(Ordering::Relaxed),
        avx2: s.avx2.load(Ordering::Relaxed),
        baseline: s.baseline.load(Ordering::Relaxed),
    })
}

/// Sets the level of the ops planned on this thread until the guard drops (for the tests of
/// each path; the kernels' parallel tasks take the level their op was planned with).
///
/// # Errors
/// [`NnError::Setting`] when the CPU lacks `level`.
#[doc(hidden)]
pub fn force_simd(level: SimdLevel) -> Result<ForcedSimd, NnError> {
    let level = SimdLevel::parse(level.name(), SimdLevel::detected())?;
    Ok(ForcedSimd(FORCED.with(|f| f.replace(Some(level)))))
}

/// Restores the level before [`force_simd`] on drop.
#[doc(hidden)]
pub struct ForcedSimd(Option<SimdLevel>);

impl Drop for ForcedSimd {
    fn drop(&mut self) {
        FORCED.with(|f| f.set(self.0));
    }
}

/// Runs `$body` (an expression of `$level`-independent code, typically a call of an
/// `#[inline(always)]` function) in a copy compiled for each level, the one the [`SimdPlan`]
/// `$plan` names; the arm that runs counts itself in the plan's [`simd_paths`]. Exported (hidden)
/// for the kernels of the crates above this one.
#[doc(hidden)]
#[macro_export]
macro_rules! simd_dispatch {
    ($plan:expr, fn $name:ident<$t:ident: $bound:path>($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<$t: $bound>($($arg: $ty),*) -> $ret $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<$t: $bound>($($arg: $ty),*) -> $ret $body
        // Out of line like the others, so that profiles and instruction counts name each copy.
        #[inline(never)]
        fn baseline<$t: $bound>($($arg: $ty),*) -> $ret $body
        let plan: $crate::SimdPlan = $plan;
        match plan.level() {
            // SAFETY: a level above the CPU's is refused when the setting is read or forced
            // (`SimdLevel::parse`), so the CPU has the features of the copy called.
            #[cfg(target_arch = "x86_64")]
            $crate::SimdLevel::Avx512 => {
                plan.ran($crate::SimdLevel::Avx512);
                unsafe { avx512::<$t>($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::SimdLevel::Avx2 => {
                plan.ran($crate::SimdLevel::Avx2);
                unsafe { avx2::<$t>($($arg),*) }
            }
            _ => {
                plan.ran($crate::SimdLevel::Baseline);
                baseline::<$t>($($arg),*)
            }
        }
    }};
    ($plan:expr, fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512($($arg: $ty),*) $(-> $ret)? $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2($($arg: $ty),*) $(-> $ret)? $body
        #[inline(never)]
        fn baseline($($arg: $ty),*) $(-> $ret)? $body
        let plan: $crate::SimdPlan = $plan;
        match plan.level() {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            $crate::SimdLevel::Avx512 => {
                plan.ran($crate::SimdLevel::Avx512);
                unsafe { avx512($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::SimdLevel::Avx2 => {
                plan.ran($crate::SimdLevel::Avx2);
                unsafe { avx2($($arg),*) }
            }
            _ => {
                plan.ran($crate::SimdLevel::Baseline);
                baseline($($arg),*)
            }
        }
    }};
}
pub(crate) use crate::simd_dispatch as dispatch;

#[cfg(test)]
mod tests {
    use super::*;

    /// Planning an op moves no counter; each dispatch counts the arm that ran, into the counters
    /// of the thread that planned it, also when the copy runs on another thread.
    #[test]
    fn the_counters_move_in_the_arm_that_runs_not_when_a_level_is_planned() {
        let cpu = SimdLevel::detected();
        for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|&l| l <= cpu) {
            let _forced = force_simd(level).unwrap();
            let before = simd_paths();
            let plan = for_kernel().unwrap();
            assert_eq!(plan.level(), level);
            assert_eq!(simd_paths(), before, "planning at {} counted a run", level.name());
            let twice = |x: f32| -> f32 {
                dispatch!(
                    plan,
                    fn body(x: f32) -> f32 {
                        x * 2.0
                    }
                )
            };
            assert_eq!(std::thread::scope(|s| s.spawn(|| twice(1.5)).join().unwrap()), 3.0);
            assert_eq!(twice(2.0), 4.0);
            let after = simd_paths();
            for other in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                let want = if other == level { 2 } else { 0 };
                assert_eq!(after.at(other) - before.at(other), want, "forced {}: runs at {}", level.name(), other.name());
            }
        }
    }
}
