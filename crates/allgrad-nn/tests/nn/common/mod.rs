//! Helpers shared by the test files: seeded data, comparisons and finite differences.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// A seeded tensor with entries uniform in [-1, 1) (splitmix64; identical on every machine).
pub fn rand_tensor(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let data: Vec<f64> = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// A seeded trainable variable.
pub fn rand_var(shape: &[usize], seed: u64, dtype: DType) -> Var {
    Var::from_tensor(&rand_tensor(shape, seed, dtype)).unwrap()
}

/// All elements as f64, row-major.
pub fn to_f64_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Norm-wise relative error `‖a − b‖₂ / ‖b‖₂` of `a` against the reference `b`
/// (`allgrad_testkit::close::rel_err`: rounding makes an element's error proportional to the
/// terms summed into it, not to the element, so a whole tensor is measured against its norm).
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    allgrad_testkit::close::rel_err(&to_f64_vec(a), &to_f64_vec(b))
}

/// Panics with `what` and the error when [`rel_err`] of `a` against `b` exceeds `tol`.
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shape mismatch");
    allgrad_testkit::close::assert_rel(&to_f64_vec(a), &to_f64_vec(b), tol, what);
}

/// Tolerance for comparing two implementations in a dtype.
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        _ => 1e-5,
    }
}

/// Central-difference gradient of the scalar `f` at `x` (f64), one element at a time.
pub fn fd_grad(f: &dyn Fn(&Tensor) -> Result<Tensor>, x: &Tensor, eps: f64) -> Tensor {
    let base = to_f64_vec(x);
    let mut g = vec![0.0; base.len()];
    for i in 0..base.len() {
        let mut v = base.clone();
        v[i] = base[i] + eps;
        let plus = eval(f, &v, x);
        v[i] = base[i] - eps;
        let minus = eval(f, &v, x);
        g[i] = (plus - minus) / (2.0 * eps);
    }
    Tensor::from_vec(g, x.shape(), &Device::Cpu).unwrap()
}

/// Central-difference derivative of the scalar `f` at `x` along `dir`.
pub fn fd_directional(f: &dyn Fn(&Tensor) -> Result<Tensor>, x: &Tensor, dir: &Tensor, eps: f64) -> f64 {
    let plus = f(&(x + (dir * eps).unwrap()).unwrap()).unwrap().to_scalar::<f64>().unwrap();
    let minus = f(&(x - (dir * eps).unwrap()).unwrap()).unwrap().to_scalar::<f64>().unwrap();
    (plus - minus) / (2.0 * eps)
}

/// `<a, b>` over all elements, in f64.
pub fn dot(a: &Tensor, b: &Tensor) -> f64 {
    to_f64_vec(a).iter().zip(to_f64_vec(b)).map(|(x, y)| x * y).sum()
}

fn eval(f: &dyn Fn(&Tensor) -> Result<Tensor>, v: &[f64], like: &Tensor) -> f64 {
    let t = Tensor::from_vec(v.to_vec(), like.shape(), &Device::Cpu).unwrap();
    f(&t).unwrap().to_scalar::<f64>().unwrap()
}

/// The error message of a failed call, for asserting on its content.
pub fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}
