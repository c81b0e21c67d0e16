//! Shared helpers of the integration tests of the plain collectives of `ProcessGroup`
//! (`all_reduce.rs`, `redistribution.rs`, `rooted_and_p2p.rs`, `subgroups.rs`,
//! `failures.rs`), which use the public API only.
//!
//! Every rank's input is different and generated deterministically from (rank, test salt,
//! element index), so each rank computes the full expected result itself, serially and in
//! f64, from all ranks' inputs; the library is never compared with itself. Covered:
//! - all_reduce (Sum, Avg, Prod, Max, Min), all_gather (equal and uneven dim-0 sizes, a rank
//!   with no rows), reduce_scatter (equal and uneven), broadcast from every root, reduce to
//!   every root, all_to_all (equal and uneven splits), send/recv around the ring, barrier;
//!   for every dtype, W in 1..=4 and sizes 0, 1, 7 and 300_007 (the last takes the ring and
//!   chain paths, which start above 256 KiB);
//! - all_reduce results are bitwise identical on every rank (inputs that round, too);
//! - subgroups (`new_group`), with members in the order given;
//! - a killed peer and mismatched collectives fail every rank quickly, naming the culprit.
//!
//! Ranks as threads are on one host, so their large collectives (all_reduce, all_gather and
//! reduce_scatter of 64 KiB and more) go through shared memory: the large cases above test that
//! path, in several pieces (the slots hold 1 MiB per rank). The same large cases also run with
//! shared memory off (`ThreadWorld::shm(false)`), over the TCP rings, and both paths must agree
//! bitwise on exact data. Mismatched calls fail the same way on both paths and across them.
//!
//! Each test runs many cases inside one `run_threads` world per world size; `ThreadWorld`'s
//! watchdog turns a hang into a failure.

// Each test file uses a part of these helpers.
#![allow(dead_code, unused_imports)]

pub use std::ops::Range;
pub use std::sync::atomic::{AtomicUsize, Ordering};
pub use std::time::{Duration, Instant};

pub use allgrad_dist::{run_threads, ProcessGroup, ReduceOp, ThreadWorld};
pub use candle_core::{DType, Device, Tensor, WithDType};
pub use half::{bf16, f16};

pub const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U32, DType::U8];
pub const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];
/// Element counts per rank: empty, one, odd, and large (not divisible by 2, 3 or 4; above
/// the 256 KiB direct-path threshold for every dtype, u8 included at W >= 2).
pub const SIZES: [usize; 4] = [0, 1, 7, LARGE];
pub const LARGE: usize = 300_007;
/// Row counts for the 3-column uneven cases; the large one makes ~300k elements per rank.
pub const ROW_SIZES: [usize; 4] = [0, 1, 7, 100_003];
pub const COLS: usize = 3;

// ------------------------------------------------------------------ deterministic inputs

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Floats: multiples of 1/4 in [-4, 4]; integers: 0..=3 (i64: -3..=3).
    General,
    /// Floats: multiples of 1/4 in [0.5, 1.5], one in eight an exact zero; integers as General.
    Prod,
    /// Floats with full mantissas in [-4, 4) (sums round, so the summation order shows).
    Rough,
    /// Floats with full mantissas in [0.5, 1.5).
    RoughProd,
}

pub fn kind_for(op: ReduceOp) -> Kind {
    if op == ReduceOp::Prod {
        Kind::Prod
    } else {
        Kind::General
    }
}

pub fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser.
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A test salt from a tag and the case parameters.
pub fn salt(tag: &str, dtype: DType, n: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in tag.bytes().chain(format!("{dtype:?}/{n}").bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

pub fn is_int(d: DType) -> bool {
    matches!(d, DType::I64 | DType::U32 | DType::U8)
}

/// Rounds `v` to the nearest value of `dtype`.
pub fn quantize(dtype: DType, v: f64) -> f64 {
    fn q<T: WithDType>(v: f64) -> f64 {
        T::from_f64(v).to_f64()
    }
    match dtype {
        DType::F32 => q::<f32>(v),
        DType::F64 => v,
        DType::F16 => q::<f16>(v),
        DType::BF16 => q::<bf16>(v),
        _ => v,
    }
}

pub fn value(dtype: DType, kind: Kind, h: u64) -> f64 {
    if is_int(dtype) {
        return if dtype == DType::I64 { (h % 7) as f64 - 3.0 } else { (h % 4) as f64 };
    }
    let unit = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    match kind {
        Kind::General => ((h % 33) as f64 - 16.0) * 0.25,
        Kind::Prod if h.is_multiple_of(8) => 0.0,
        Kind::Prod => 0.5 + 0.25 * ((h >> 3) % 5) as f64,
        Kind::Rough => quantize(dtype, (unit - 0.5) * 8.0),
        Kind::RoughProd => quantize(dtype, 0.5 + unit),
    }
}

/// Elements `range` of rank `rank`'s input for the case `salt` (index-addressable, so a rank
/// can generate just the part of another rank's input it needs).
pub fn gen(dtype: DType, kind: Kind, rank: usize, salt: u64, range: Range<usize>) -> Vec<f64> {
    let seed = mix(salt ^ mix(((rank as u64) << 8) | kind as u64));
    range.map(|i| value(dtype, kind, mix(seed ^ i as u64))).collect()
}

/// The serial reference: reduces equal-length inputs element-wise, in f64.
pub fn fold(op: ReduceOp, dtype: DType, parts: &[Vec<f64>]) -> Vec<f64> {
    let n = parts[0].len();
    let w = parts.len() as f64;
    (0..n)
        .map(|i| {
            let mut acc = parts[0][i];
            for p in &parts[1..] {
                let x = p[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Prod => acc * x,
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                };
            }
            if op == ReduceOp::Avg {
                acc /= w;
                if is_int(dtype) {
                    acc = acc.trunc(); // integer averages truncate
                }
            }
            acc
        })
        .collect()
}

// ------------------------------------------------------------------ tensors

/// Runs `$body` with `$T` the element type of a dtype (the crate's own dispatch).
macro_rules! with_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        allgrad_dist::with_elem_type!($dtype, $T => $body, d => panic!("no test type for {d:?}"))
    };
}

pub fn tensor(dtype: DType, vals: &[f64], shape: &[usize]) -> Tensor {
    with_type!(dtype, T => {
        let v: Vec<T> = vals.iter().map(|x| T::from_f64(*x)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    })
}

pub fn read(t: &Tensor) -> Vec<f64> {
    with_type!(t.dtype(), T => t.flatten_all().unwrap().to_vec1::<T>().unwrap().into_iter().map(|x| x.to_f64()).collect())
}

/// FNV-1a of the tensor's raw bytes: equal digests mean bitwise-equal data.
pub fn bits_digest(t: &Tensor) -> u64 {
    let bytes: Vec<u8> = with_type!(t.dtype(), T => {
        let v = t.flatten_all().unwrap().to_vec1::<T>().unwrap();
        bytemuck::cast_slice::<T, u8>(&v).to_vec()
    });
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The relative tolerance of a reduction's result in `dtype`. A result combines at most 4
/// inputs, rounding to the dtype at each of at most 3 steps (and once more for an average), so
/// its error is at most 4 unit roundoffs of the values it passed through: f64 4·2⁻⁵³ ≈ 4.4e-16,
/// f32 4·2⁻²⁴ ≈ 2.4e-7 (both held to the workspace's defaults, 1e-12 and 1e-5), f16 4·2⁻¹¹ ≈
/// 2.0e-3 and bf16 4·2⁻⁸ ≈ 1.6e-2: 2e-2 for both half types is bf16's bound.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 | DType::BF16 => 2e-2,
        _ => 0.0,
    }
}

/// Checks `got` against the reference: exact for integers and when `exact`, else each element
/// within the dtype's tolerance relative to itself (`allgrad_testkit::close::elem_rel_err`;
/// every element is a reduction rounded on its own scale; an expected zero must be exact). A
/// NaN fails.
pub fn check_values(what: &str, dtype: DType, exact: bool, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {} elements, expected {}", got.len(), want.len());
    let tol = if exact { 0.0 } else { tolerance(dtype) };
    let (e, i) = allgrad_testkit::close::elem_rel_err(got, want, f64::MIN_POSITIVE);
    if e > tol {
        panic!("{what}: element {i} is {}, expected {} (relative error {e:e}, tolerance {tol:e})", got[i], want[i]);
    }
}

/// Like [`check_values`], with each element's error relative to `scale[i]` instead of the
/// element: for sums whose inputs cancel, rounding is relative to the partial sums, which are
/// bounded by the sum of the inputs' magnitudes, not by the result.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn check_scaled(what: &str, dtype: DType, exact: bool, got: &[f64], want: &[f64], scale: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {} elements, expected {}", got.len(), want.len());
    let tol = if exact { 0.0 } else { tolerance(dtype) };
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        if !((g - w).abs() <= tol * s) {
            panic!("{what}: element {i} is {g}, expected {w} (tolerance {tol:e} of {s})");
        }
    }
}

pub fn check(what: &str, t: &Tensor, dtype: DType, shape: &[usize], exact: bool, want: &[f64]) {
    assert_eq!(t.dtype(), dtype, "{what}: dtype");
    assert_eq!(t.dims(), shape, "{what}: shape");
    check_values(what, dtype, exact, &read(t), want);
}

pub fn exact_op(op: ReduceOp, dtype: DType) -> bool {
    is_int(dtype) || matches!(op, ReduceOp::Max | ReduceOp::Min)
}

/// A world of `w` thread-ranks with a generous per-call timeout; panics with the harness's
/// message (which names the failing rank and case) on error.
pub fn world<T: Send>(w: usize, f: impl Fn(ProcessGroup) -> candle_core::Result<T> + Sync) -> Vec<T> {
    ThreadWorld::new(w).timeout(Duration::from_secs(30)).run(f).unwrap_or_else(|e| panic!("world of {w} ranks failed: {e}"))
}

/// [`world`] with shared memory on or off.
pub fn world_with<T: Send>(w: usize, shm: bool, f: impl Fn(ProcessGroup) -> candle_core::Result<T> + Sync) -> Vec<T> {
    let tw = ThreadWorld::new(w).timeout(Duration::from_secs(30)).shm(shm);
    tw.run(f).unwrap_or_else(|e| panic!("world of {w} ranks (shared memory {shm}) failed: {e}"))
}

/// Whether this host offers shared memory (`/dev/shm`).
pub fn shm_available() -> bool {
    std::path::Path::new("/dev/shm").is_dir()
}

/// Whether a `w`-rank thread world is expected to use shared memory for large collectives
/// (ALLGRAD_SHM=0 in the test's environment turns it off where the test does not force it).
pub fn expect_shm(w: usize) -> bool {
    w > 1 && shm_available() && std::env::var("ALLGRAD_SHM").map_or(true, |v| v.trim() != "0")
}

/// Dim-0 sizes of the uneven cases: rank 1 has no rows, the others all differ.
pub fn uneven_rows(q: usize, w: usize, base: usize) -> usize {
    if w > 1 && q == 1 {
        0
    } else {
        base + q
    }
}

pub fn offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect()
}
