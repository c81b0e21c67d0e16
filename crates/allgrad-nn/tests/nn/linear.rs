//! `linear` against a plain f64 computation (values and the three gradients, with and
//! without bias, 2-D and 3-D inputs, a strided input, sizes spanning several bias blocks and
//! several of the GEMM's depth blocks), against finite differences in f64, against Candle's
//! composed ops in f32; an untracked input gets no gradient while the parameters get theirs;
//! the backward's products with an empty inner dimension are zeros; errors that name the shapes.

use allgrad_nn::{dense_product, linear};
use candle_core::{DType, Tensor};

use crate::common::{assert_close, err_text, fd_grad, rand_tensor, rand_var, to_f64_vec};

/// `y[r, o] = b[o] + Σ_i x[r, i] w[o, i]` and the gradients of `Σ y·p`, in f64 loops.
struct Reference {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

fn reference(x: &[f64], w: &[f64], b: Option<&[f64]>, p: &[f64], rows: usize, inp: usize, out: usize) -> Reference {
    let mut r = Reference { y: vec![0.0; rows * out], dx: vec![0.0; rows * inp], dw: vec![0.0; out * inp], db: vec![0.0; out] };
    for i in 0..rows {
        for o in 0..out {
            let dot: f64 = (0..inp).map(|k| x[i * inp + k] * w[o * inp + k]).sum();
            r.y[i * out + o] = dot + b.map_or(0.0, |b| b[o]);
            let g = p[i * out + o];
            r.db[o] += g;
            for k in 0..inp {
                r.dx[i * inp + k] += g * w[o * inp + k];
                r.dw[o * inp + k] += g * x[i * inp + k];
            }
        }
    }
    r
}

fn vec_tensor(v: Vec<f64>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &candle_core::Device::Cpu).unwrap()
}

#[test]
fn values_and_gradients_match_a_plain_computation() {
    // (leading dims, in, out, strided input): out 130 spans three 64-column bias blocks.
    // (1031 rows, in 517, out 67): odd sizes whose GEMMs span several depth blocks of the GEMM
    // (512 deep) for ∂W (depth: the rows) and the forward (depth: in), so a destination the
    // backward's GEMMs write without a zero fill first is written by the first block and
    // accumulated by the next; its 1031 x 67 output gradient is two chunks of the
    // bias gradient's row sums (978 rows, then 53).
    for (lead, inp, out, strided) in [
        (vec![5], 7, 3, false),
        (vec![3, 4], 9, 130, false),
        (vec![6, 2], 5, 11, true),
        (vec![1], 1, 1, false),
        (vec![1031], 517, 67, false),
    ] {
        for dtype in [DType::F32, DType::F64] {
            for with_bias in [true, false] {
                let rows: usize = lead.iter().product();
                let xshape: Vec<usize> = if strided { vec![inp, lead[0], lead[1]] } else { [lead.clone(), vec![inp]].concat() };
                let xv = rand_var(&xshape, 1, dtype);
                // The strided case feeds a transposed view `[lead0, lead1, in]`.
                let x = if strided { xv.as_tensor().permute((1, 2, 0)).unwrap() } else { xv.as_tensor().clone() };
                let w = rand_var(&[out, inp], 2, dtype);
                let b = rand_var(&[out], 3, dtype);
                let yshape = [lead.clone(), vec![out]].concat();
                let p = rand_tensor(&yshape, 4, dtype);
                let what = format!("{lead:?} in {inp} out {out} strided={strided} bias={with_bias} {dtype:?}");

                let y = linear(&x, w.as_tensor(), with_bias.then_some(b.as_tensor())).unwrap();
                assert_eq!(y.dims(), yshape.as_slice(), "{what}");
                let grads = (&y * &p).unwrap().sum_all().unwrap().backward().unwrap();

                let bv = to_f64_vec(b.as_tensor());
                let r = reference(
                    &to_f64_vec(&x),
                    &to_f64_vec(w.as_tensor()),
                    with_bias.then_some(&bv[..]),
                    &to_f64_vec(&p),
                    rows,
                    inp,
                    out,
                );
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                let dx = grads.get(&xv).unwrap();
                let dx = if strided { dx.permute((1, 2, 0)).unwrap() } else { dx.clone() };
                assert_close(&y, &vec_tensor(r.y, &yshape), tol, &format!("y {what}"));
                assert_close(&dx, &vec_tensor(r.dx, x.dims()), tol, &format!("dx {what}"));
                assert_close(grads.get(&w).unwrap(), &vec_tensor(r.dw, &[out, inp]), tol, &format!("dw {what}"));
                match grads.get(&b) {
                    Some(db) => {
                        assert!(with_bias, "{what}: a bias gradient without a bias");
                        assert_close(db, &vec_tensor(r.db, &[out]), tol, &format!("db {what}"));
                    }
                    None => assert!(!with_bias, "{what}: no bias gradient"),
                }
            }
        }
    }
}

#[test]
fn an_untracked_input_gets_no_gradient_and_the_parameters_theirs() {
    // A constant input (pixels into a patch embedding): its gradient is not computed, and the
    // weight's and bias's are those of the plain computation.
    let (rows, inp, out) = (37, 19, 23);
    for dtype in [DType::F32, DType::F64] {
        let x = rand_tensor(&[rows, inp], 21, dtype);
        let w = rand_var(&[out, inp], 22, dtype);
        let b = rand_var(&[out], 23, dtype);
        let p = rand_tensor(&[rows, out], 24, dtype);
        for with_bias in [true, false] {
            let what = format!("{dtype:?} bias={with_bias}");
            let y = linear(&x, w.as_tensor(), with_bias.then_some(b.as_tensor())).unwrap();
            let grads = (&y * &p).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(grads.get(&x).is_none(), "{what}: an input gradient for an untracked input");
            let bv = to_f64_vec(b.as_tensor());
            let r = reference(
                &to_f64_vec(&x),
                &to_f64_vec(w.as_tensor()),
                with_bias.then_some(&bv[..]),
                &to_f64_vec(&p),
                rows,
                inp,
                out,
            );
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            assert_close(grads.get(&w).unwrap(), &vec_tensor(r.dw, &[out, inp]), tol, &format!("dw {what}"));
            if with_bias {
                assert_close(grads.get(&b).unwrap(), &vec_tensor(r.db, &[out]), tol, &format!("db {what}"));
            }
        }
    }
}

#[test]
fn products_over_an_empty_inner_dimension_are_zeros() {
    // ∂W over no rows and ∂x through no outputs: nothing is summed, and the buffers that the
    // GEMM would otherwise write must hold zeros, not whatever the allocation held.
    let zero_rows = dense_product("dw", [&[], &[1.0; 6], &[], &[]], (0, 3, 2)).unwrap();
    assert_eq!(zero_rows, vec![0.0; 6]);
    let no_outputs = dense_product("dx", [&[1.0; 12], &[], &[], &[]], (4, 3, 0)).unwrap();
    assert_eq!(no_outputs, vec![0.0; 12]);
    assert!(dense_product("dy", [&[], &[], &[], &[]], (0, 0, 0)).is_none());
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let x = rand_tensor(&[2, 3, 4], 5, DType::F64);
    let w = rand_tensor(&[5, 4], 6, DType::F64);
    let b = rand_tensor(&[5], 7, DType::F64);
    let p = rand_tensor(&[2, 3, 5], 8, DType::F64);
    let loss = |x: &Tensor, w: &Tensor, b: &Tensor| (linear(x, w, Some(b))? * &p)?.sum_all();
    let vars = [&x, &w, &b].map(|t| candle_core::Var::from_tensor(t).unwrap());
    let grads = loss(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor()).unwrap().backward().unwrap();
    // The loss is linear in each argument: central differences are exact but for rounding at
    // any step, and 1/2 (a power of two) adds none of its own.
    let fd_x = fd_grad(&|t| loss(t, &w, &b), &x, 0.5);
    let fd_w = fd_grad(&|t| loss(&x, t, &b), &w, 0.5);
    let fd_b = fd_grad(&|t| loss(&x, &w, t), &b, 0.5);
    assert_close(grads.get(&vars[0]).unwrap(), &fd_x, 1e-12, "dx vs finite differences");
    assert_close(grads.get(&vars[1]).unwrap(), &fd_w, 1e-12, "dw vs finite differences");
    assert_close(grads.get(&vars[2]).unwrap(), &fd_b, 1e-12, "db vs finite differences");
}

#[test]
fn f32_equals_candles_composed_ops() {
    // 2,048 rows over several GEMM blocks, in f32: the encoder's use.
    let x = rand_var(&[64, 32, 48], 9, DType::F32);
    let w = rand_var(&[96, 48], 10, DType::F32);
    let b = rand_var(&[96], 11, DType::F32);
    let p = rand_tensor(&[64, 32, 96], 12, DType::F32);
    let fused = linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap();
    let composed = x.as_tensor().broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap().broadcast_add(b.as_tensor()).unwrap();
    assert_close(&fused, &composed, 1e-5, "forward");
    let g1 = (&fused * &p).unwrap().sum_all().unwrap().backward().unwrap();
    let g2 = (&composed * &p).unwrap().sum_all().unwrap().backward().unwrap();
    for (v, name) in [(&x, "dx"), (&w, "dw"), (&b, "db")] {
        assert_close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-5, name);
    }
}

#[test]
fn misfitting_inputs_are_errors_naming_them() {
    let x = rand_tensor(&[2, 3], 1, DType::F32);
    let e = err_text(linear(&x, &rand_tensor(&[4, 5], 2, DType::F32), None));
    assert!(e.contains("linear") && e.contains("[4, 5]") && e.contains("last dimension is 3"), "{e}");
    let e = err_text(linear(&x, &rand_tensor(&[4, 3], 2, DType::F32), Some(&rand_tensor(&[5], 3, DType::F32))));
    assert!(e.contains("linear") && e.contains("bias") && e.contains("[5]") && e.contains("4 outputs"), "{e}");
    let e = err_text(linear(&x, &rand_tensor(&[4, 3], 2, DType::F64), None));
    assert!(e.contains("linear") && e.contains("F32") && e.contains("F64"), "{e}");
    let e = err_text(linear(&x, &rand_tensor(&[4, 3, 1], 2, DType::F32), None));
    assert!(e.contains("linear") && e.contains("[out, in]"), "{e}");
}
