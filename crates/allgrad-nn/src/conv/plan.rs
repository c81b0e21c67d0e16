//! What selects a cuDNN convolution plan, and the cache of plans: plain Rust, so the key logic
//! and the counting are tested on any machine (`cudnn.rs` keeps the plans themselves).
//!
//! A plan (descriptors, algorithm, workspace size) depends on the geometry (batch, channels,
//! sizes, kernel, stride, padding, dilation, groups), the data type, the math mode (plain FMA,
//! TF32 allowed, bf16 tensor cores) and the direction (forward, input gradient, weight
//! gradient). Asking cuDNN's heuristic for an algorithm costs 70-100 µs on the host; a training
//! step repeats the same shapes every step, so each key is asked once per thread and device,
//! and each query is counted ([`crate::HostTraffic::heuristic_queries`]).
// Used by the cuDNN path only (and by the tests here, on any build).
#![cfg_attr(not(feature = "cudnn"), allow(dead_code))]

use std::collections::HashMap;

use candle_core::DType;

use super::im2col::ConvGeom;

/// The math a convolution may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Math {
    /// Plain multiply-adds in the data type (f64; f32 without TF32).
    Fma,
    /// f32 with TF32 tensor cores allowed ([`crate::set_tf32`]).
    Tf32,
    /// bf16 on tensor cores, accumulating in f32.
    TensorOp,
}

impl Math {
    /// The math of a convolution of `dtype` with TF32 allowed or not.
    pub fn of(dtype: DType, tf32: bool) -> Math {
        match dtype {
            DType::F32 if tf32 => Math::Tf32,
            DType::BF16 | DType::F16 => Math::TensorOp,
            _ => Math::Fma,
        }
    }
}

/// Which pass of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Direction {
    /// `y = conv(x, w)`.
    Forward,
    /// `∂x` from `∂y` and `w`.
    BackwardData,
    /// `∂w` from `x` and `∂y`.
    BackwardFilter,
}

/// Everything a cuDNN plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    /// `[n, c, h, w, o, kh, kw, stride, padding, dilation, groups]`.
    geometry: [usize; 11],
    dtype: DType,
    math: Math,
    direction: Direction,
}

impl PlanKey {
    /// The key of a convolution of geometry `g`, data type `dtype`, with TF32 allowed or not.
    pub fn new(g: &ConvGeom, dtype: DType, tf32: bool, direction: Direction) -> PlanKey {
        let geometry = [g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.stride, g.pad, g.dil, g.groups];
        PlanKey { geometry, dtype, math: Math::of(dtype, tf32), direction }
    }

    /// The math mode.
    pub fn math(&self) -> Math {
        self.math
    }
}

/// Plans by key, each built once: a miss builds it (one heuristic query, counted), a hit
/// returns it.
pub(crate) struct PlanCache<P> {
    plans: HashMap<PlanKey, P>,
}

impl<P> Default for PlanCache<P> {
    fn default() -> Self {
        PlanCache { plans: HashMap::new() }
    }
}

impl<P> PlanCache<P> {
    /// The plan of `key`, built by `build` (which asks cuDNN's heuristic) when missing.
    pub fn get_or_build<E>(&mut self, key: PlanKey, build: impl FnOnce() -> Result<P, E>) -> Result<&mut P, E> {
        use std::collections::hash_map::Entry;
        match self.plans.entry(key) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                crate::trace::count_heuristic_query();
                Ok(e.insert(build()?))
            }
        }
    }

    /// Plans held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.plans.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_traffic;

    fn geom(stride: usize, pad: usize) -> ConvGeom {
        let out = (32 + 2 * pad - 3) / stride + 1;
        ConvGeom { n: 8, c: 16, h: 32, w: 32, o: 32, kh: 3, kw: 3, oh: out, ow: out, stride, pad, dil: 1, groups: 1 }
    }

    #[test]
    fn a_repeat_hits_and_a_dtype_math_stride_padding_or_direction_change_misses() {
        let mut cache: PlanCache<u32> = PlanCache::default();
        let mut built = 0u32;
        let before = host_traffic();
        let mut get = |key: PlanKey| -> u32 {
            *cache
                .get_or_build(key, || -> Result<u32, ()> {
                    built += 1;
                    Ok(built)
                })
                .unwrap()
        };
        let base = PlanKey::new(&geom(1, 1), DType::F32, false, Direction::Forward);
        assert_eq!(get(base), 1);
        assert_eq!(get(base), 1, "a repeat must hit");
        assert_eq!(get(PlanKey::new(&geom(1, 1), DType::F32, false, Direction::Forward)), 1, "an equal key must hit");
        let misses = [
            PlanKey::new(&geom(1, 1), DType::F64, false, Direction::Forward),
            PlanKey::new(&geom(1, 1), DType::F32, true, Direction::Forward),
            PlanKey::new(&geom(2, 1), DType::F32, false, Direction::Forward),
            PlanKey::new(&geom(1, 0), DType::F32, false, Direction::Forward),
            PlanKey::new(&geom(1, 1), DType::F32, false, Direction::BackwardData),
            PlanKey::new(&geom(1, 1), DType::F32, false, Direction::BackwardFilter),
        ];
        for (i, k) in misses.iter().enumerate() {
            assert_eq!(get(*k), i as u32 + 2, "{k:?} must miss");
            assert_eq!(get(*k), i as u32 + 2, "{k:?} must hit the second time");
        }
        let queries = (host_traffic() - before).heuristic_queries;
        assert_eq!(queries, 7, "one heuristic query per plan built");
        assert_eq!(cache.len(), 7);
    }

    #[test]
    fn tf32_changes_only_f32_math() {
        assert_eq!(Math::of(DType::F32, false), Math::Fma);
        assert_eq!(Math::of(DType::F32, true), Math::Tf32);
        assert_eq!(Math::of(DType::F64, true), Math::Fma, "f64 never takes TF32");
        assert_eq!(Math::of(DType::BF16, false), Math::TensorOp);
        let k = |tf32| PlanKey::new(&geom(1, 1), DType::F64, tf32, Direction::Forward);
        assert_eq!(k(false), k(true), "an f64 plan does not depend on the TF32 switch");
    }
}
