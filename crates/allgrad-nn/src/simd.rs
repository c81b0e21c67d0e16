//! Which SIMD instruction set allgrad-nn's own vectorised loops run with: the element-wise maths
//! of [`crate::vmath`] (`exp`, `erf`: GELU, softmax, attention) and the layer norm's rows.
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
pub(crate) fn active() -> SimdLevel {
    simd_level().unwrap_or_else(|_| SimdLevel::detected())
}

/// [`simd_level`] for an op about to run its vectorised loops, counted in [`simd_paths`].
pub(crate) fn for_kernel() -> candle_core::Result<SimdLevel> {
    let level = simd_level()?;
    PATHS.with(|p| {
        let mut v = p.get();
        match level {
            SimdLevel::Avx512 => v.avx512 += 1,
            SimdLevel::Avx2 => v.avx2 += 1,
            SimdLevel::Baseline => v.baseline += 1,
        }
        p.set(v);
    });
    Ok(level)
}

thread_local! {
    static FORCED: Cell<Option<SimdLevel>> = const { Cell::new(None) };
    static PATHS: Cell<SimdPaths> = const { Cell::new(SimdPaths { avx512: 0, avx2: 0, baseline: 0 }) };
}

/// Kernel calls planned on this thread per level (ops with a vectorised row loop: layer norm
/// forward and backward, GELU forward and backward), for the tests of each path.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimdPaths {
    /// Calls that ran the AVX-512 copies.
    pub avx512: u64,
    /// Calls that ran the AVX2 copies.
    pub avx2: u64,
    /// Calls that ran the baseline copies.
    pub baseline: u64,
}

/// The counts of this thread so far.
#[doc(hidden)]
pub fn simd_paths() -> SimdPaths {
    PATHS.with(Cell::get)
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
/// `#[inline(always)]` function) in a copy compiled for each level, the one `$level` names.
macro_rules! dispatch {
    ($level:expr, fn $name:ident<$t:ident: $bound:path>($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<$t: $bound>($($arg: $ty),*) -> $ret $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<$t: $bound>($($arg: $ty),*) -> $ret $body
        // Out of line like the others, so that profiles and instruction counts name each copy.
        #[inline(never)]
        fn baseline<$t: $bound>($($arg: $ty),*) -> $ret $body
        match $level {
            // SAFETY: a level above the CPU's is refused when the setting is read or forced
            // (`SimdLevel::parse`), so the CPU has the features of the copy called.
            #[cfg(target_arch = "x86_64")]
            $crate::simd::SimdLevel::Avx512 => unsafe { avx512::<$t>($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            $crate::simd::SimdLevel::Avx2 => unsafe { avx2::<$t>($($arg),*) },
            _ => baseline::<$t>($($arg),*),
        }
    }};
    ($level:expr, fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512($($arg: $ty),*) $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2($($arg: $ty),*) $body
        #[inline(never)]
        fn baseline($($arg: $ty),*) $body
        match $level {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            $crate::simd::SimdLevel::Avx512 => unsafe { avx512($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            $crate::simd::SimdLevel::Avx2 => unsafe { avx2($($arg),*) },
            _ => baseline($($arg),*),
        }
    }};
}
pub(crate) use dispatch;
