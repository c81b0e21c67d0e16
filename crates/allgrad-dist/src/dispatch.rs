//! The one dtype dispatch of the collectives: from a Candle [`DType`] to the Rust element type
//! that carries it ([`with_elem_type!`](crate::with_elem_type)).

use candle_core::DType;

use crate::error::DistError;
use crate::reduce::SUPPORTED_DTYPES;

/// Runs `$body` with the type `$T` bound to the Rust element type of the Candle dtype
/// `$dtype`, for the dtypes of [`SUPPORTED_DTYPES`](crate::SUPPORTED_DTYPES) (every such type
/// implements [`Elem`](crate::Elem)); any other dtype evaluates `$other` with `$d` bound to it.
///
/// ```
/// use allgrad_dist::with_elem_type;
/// use candle_core::{DType, Device, Tensor};
///
/// let x = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
/// let bytes = with_elem_type!(x.dtype(), T => x.to_vec1::<T>().unwrap().len() * std::mem::size_of::<T>(),
///                             d => panic!("no element type for {d:?}"));
/// assert_eq!(bytes, 12);
/// ```
#[macro_export]
macro_rules! with_elem_type {
    ($dtype:expr, $T:ident => $body:expr, $d:ident => $other:expr) => {
        match $dtype {
            $crate::__private::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::__private::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::__private::DType::F16 => {
                type $T = $crate::__private::f16;
                $body
            }
            $crate::__private::DType::BF16 => {
                type $T = $crate::__private::bf16;
                $body
            }
            $crate::__private::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::__private::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::__private::DType::U8 => {
                type $T = u8;
                $body
            }
            $d => $other,
        }
    };
}

/// The error for a dtype the collectives do not carry.
pub(crate) fn unsupported_dtype(d: DType) -> DistError {
    DistError::Invalid(format!("collectives support the dtypes {SUPPORTED_DTYPES:?}, not {d:?}"))
}

/// Paths [`with_elem_type!`](crate::with_elem_type) names, so that callers need no
/// dependency on `half` or `candle_core` of their own.
#[doc(hidden)]
pub mod __private {
    pub use candle_core::DType;
    pub use half::{bf16, f16};
}
