//! Reduction operators and the element types collectives carry.

use candle_core::DType;
use half::{bf16, f16};

/// How an all_reduce, reduce or reduce_scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks (sum, then divided by the group size; integers divide truncating).
    Avg,
    /// Product over ranks.
    Prod,
    /// Element-wise maximum (NaN wins, so a diverged rank is never hidden).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Prod => 3,
            ReduceOp::Max => 4,
            ReduceOp::Min => 5,
        }
    }
}

/// An element type the collectives can carry and reduce. Implemented for the dtypes of
/// [`SUPPORTED_DTYPES`].
pub trait Elem: bytemuck::Pod + candle_core::WithDType {
    /// `acc[i] = acc[i] op x[i]`; `Avg` sums here (the division comes last).
    fn combine(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// `acc[i] /= n`.
    fn divide(acc: &mut [Self], n: usize);
}

/// The dtypes collectives support.
pub const SUPPORTED_DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U32, DType::U8];

pub(crate) fn dtype_code(d: DType) -> u8 {
    match d {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I64 => 3,
        DType::BF16 => 4,
        DType::F16 => 5,
        DType::F32 => 6,
        DType::F64 => 7,
        _ => 0,
    }
}

pub(crate) fn dtype_name(code: u8) -> String {
    let d = [DType::U8, DType::U32, DType::I64, DType::BF16, DType::F16, DType::F32, DType::F64];
    match code {
        1..=7 => format!("{:?}", d[code as usize - 1]).to_lowercase(),
        c => format!("dtype#{c}"),
    }
}

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn combine(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                let it = acc.iter_mut().zip(x);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(a, b)| *a = a.wrapping_add(*b)),
                    ReduceOp::Prod => it.for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                    ReduceOp::Max => it.for_each(|(a, b)| *a = (*a).max(*b)),
                    ReduceOp::Min => it.for_each(|(a, b)| *a = (*a).min(*b)),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                acc.iter_mut().for_each(|a| *a /= n as $t);
            }
        }
    };
}
int_elem!(u8);
int_elem!(u32);
int_elem!(i64);

#[inline]
fn fmax<T: PartialOrd + Copy>(a: T, b: T, a_nan: bool, b_nan: bool) -> T {
    if a_nan {
        a
    } else if b_nan || b > a {
        b
    } else {
        a
    }
}
#[inline]
fn fmin<T: PartialOrd + Copy>(a: T, b: T, a_nan: bool, b_nan: bool) -> T {
    if a_nan {
        a
    } else if b_nan || b < a {
        b
    } else {
        a
    }
}

macro_rules! float_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn combine(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                let it = acc.iter_mut().zip(x);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(a, b)| *a += *b),
                    ReduceOp::Prod => it.for_each(|(a, b)| *a *= *b),
                    ReduceOp::Max => it.for_each(|(a, b)| *a = fmax(*a, *b, a.is_nan(), b.is_nan())),
                    ReduceOp::Min => it.for_each(|(a, b)| *a = fmin(*a, *b, a.is_nan(), b.is_nan())),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                acc.iter_mut().for_each(|a| *a /= n as $t);
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn combine(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                // Each step is computed in f32 and rounded once, like a half-precision add.
                let it = acc.iter_mut().zip(x);
                let f = |a: &mut $t, b: &$t, g: &dyn Fn(f32, f32) -> f32| *a = <$t>::from_f32(g(a.to_f32(), b.to_f32()));
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(a, b)| f(a, b, &|a, b| a + b)),
                    ReduceOp::Prod => it.for_each(|(a, b)| f(a, b, &|a, b| a * b)),
                    ReduceOp::Max => it.for_each(|(a, b)| *a = fmax(*a, *b, a.is_nan(), b.is_nan())),
                    ReduceOp::Min => it.for_each(|(a, b)| *a = fmin(*a, *b, a.is_nan(), b.is_nan())),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                acc.iter_mut().for_each(|a| *a = <$t>::from_f32(a.to_f32() / n as f32));
            }
        }
    };
}
half_elem!(f16);
half_elem!(bf16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_and_min_propagate_nan() {
        let mut a = [1.0f32, f32::NAN, 3.0];
        f32::combine(ReduceOp::Max, &mut a, &[f32::NAN, 2.0, 1.0]);
        assert!(a[0].is_nan() && a[1].is_nan() && a[2] == 3.0);
        let mut b = [bf16::from_f32(1.0)];
        bf16::combine(ReduceOp::Min, &mut b, &[bf16::from_f32(-2.0)]);
        assert_eq!(b[0].to_f32(), -2.0);
    }

    #[test]
    fn integer_average_truncates() {
        let mut a = [7i64, -7];
        i64::divide(&mut a, 2);
        assert_eq!(a, [3, -3]);
    }
}
