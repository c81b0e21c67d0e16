//! The backward pass of the patched candle-core (third_party/README.md): the first gradient of
//! a tensor is stored as it is, later ones added. Checked here: sums over several consumers
//! against a plain f64 computation, gradients shared between tensors, contiguous results of
//! strided gradients, gradients that are views into a larger buffer stored in a buffer of their
//! own, and the errors of a gradient with the wrong shape or dtype; and that a multi-gradient
//! backward (`conv2d_backward`) hands over buffers the store keeps without a copy. And the
//! second change, `Tensor::backward_release`: each node is freed once its gradient is passed
//! on, what the caller still holds survives, and the gradients equal those of `backward`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, Var};

fn var(v: &[f64], shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

#[test]
fn contributions_of_several_consumers_are_summed() {
    // loss = Σ c·(x·x + x) + Σ x: x has four contributions, ∂x = c·(2x + 1) + 1.
    let xs = [0.5, -1.25, 2.0, 3.5];
    let cs = [1.0, -2.0, 0.25, 4.0];
    let x = var(&xs, &[4]);
    let c = Tensor::from_vec(cs.to_vec(), 4, &Device::Cpu).unwrap();
    let y = ((x.as_tensor() * x.as_tensor()).unwrap() + x.as_tensor()).unwrap();
    let loss = ((&y * &c).unwrap().sum_all().unwrap() + x.as_tensor().sum_all().unwrap()).unwrap();
    let g = values(loss.backward().unwrap().get(x.as_tensor()).unwrap());
    let expected: Vec<f64> = xs.iter().zip(&cs).map(|(x, c)| c * (2.0 * x + 1.0) + 1.0).collect();
    assert_eq!(g, expected);
}

#[test]
fn tensors_that_share_an_upstream_gradient_each_get_it() {
    // y = a + b: both get ∂y; then a second use of a adds to a's only.
    let (a, b) = (var(&[1.0, 2.0, 3.0], &[3]), var(&[4.0, 5.0, 6.0], &[3]));
    let c = Tensor::from_vec(vec![2.0, -1.0, 0.5], 3, &Device::Cpu).unwrap();
    let y = (a.as_tensor() + b.as_tensor()).unwrap();
    let loss = ((&y * &c).unwrap().sum_all().unwrap() + (a.as_tensor() * 3.0).unwrap().sum_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(values(grads.get(b.as_tensor()).unwrap()), vec![2.0, -1.0, 0.5]);
    assert_eq!(values(grads.get(a.as_tensor()).unwrap()), vec![5.0, 2.0, 3.5]);
    // b's gradient is still ∂y after a's was summed.
    assert_eq!(values(grads.get(b.as_tensor()).unwrap()), vec![2.0, -1.0, 0.5]);
}

#[test]
fn strided_gradients_are_stored_contiguous() {
    let x = var(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let c = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], (3, 2), &Device::Cpu).unwrap();
    let loss = (x.as_tensor().t().unwrap() * &c).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert!(g.is_contiguous());
    assert_eq!(g.dims(), &[2, 3]);
    assert_eq!(values(g), vec![1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
}

/// The identity, whose backward returns a gradient of another shape or dtype (a bug in an op).
struct BadBackward {
    wrong_dtype: bool,
}

impl CustomOp1 for BadBackward {
    fn name(&self) -> &'static str {
        "bad-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(if self.wrong_dtype { grad.to_dtype(DType::F32)? } else { grad.flatten_all()? }))
    }
}

#[test]
fn a_gradient_of_the_wrong_shape_or_dtype_is_an_error() {
    for wrong_dtype in [false, true] {
        let x = var(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
        let loss = x.as_tensor().apply_op1(BadBackward { wrong_dtype }).unwrap().sum_all().unwrap();
        let err = loss.backward().map(|_| ()).unwrap_err().to_string();
        let expected = if wrong_dtype { "dtype mismatch in add" } else { "shape mismatch in add" };
        assert!(err.contains(expected), "{err}");
    }
}

/// `x + y` (same shapes), whose backward computes both gradients into one buffer and returns
/// two views of it, as allgrad's fused ops do.
struct SharedBufferBackward;

impl CustomOp2 for SharedBufferBackward {
    fn name(&self) -> &'static str {
        "shared-buffer-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (s1.as_slice::<f64>()?, s2.as_slice::<f64>()?);
        Ok((CpuStorage::F64(a.iter().zip(b).map(|(a, b)| a + b).collect()), l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count();
        let flat = Tensor::cat(&[grad.flatten_all()?, (grad.flatten_all()? * 2.0)?], 0)?;
        Ok((Some(flat.narrow(0, 0, n)?.reshape(x.shape())?), Some(flat.narrow(0, n, n)?.reshape(x.shape())?)))
    }
}

/// Elements of the storage behind `t`.
fn storage_len(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => s.as_slice::<f64>().unwrap().len(),
        _ => unreachable!("the test runs on the CPU"),
    }
}

#[test]
fn a_view_into_a_larger_buffer_is_stored_in_a_buffer_of_its_own() {
    let (x, y) = (var(&[1.0, 2.0, 3.0], &[3]), var(&[4.0, 5.0, 6.0], &[3]));
    let loss = x.as_tensor().apply_op2(y.as_tensor(), SharedBufferBackward).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let (gx, gy) = (grads.get(x.as_tensor()).unwrap(), grads.get(y.as_tensor()).unwrap());
    assert_eq!((values(gx), values(gy)), (vec![1.0; 3], vec![2.0; 3]));
    // Each owns exactly its 3 elements: neither keeps the 6-element buffer alive.
    assert_eq!((storage_len(gx), storage_len(gy)), (3, 3));
}

#[test]
fn conv2d_backward_returns_each_gradient_in_a_buffer_of_its_own() {
    // What the store then keeps without a copy (one flat `[∂x | ∂w]` buffer would be copied out).
    let seq = |n: usize| (0..n).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>();
    let t = |shape: &[usize]| Tensor::from_vec(seq(shape.iter().product()), shape, &Device::Cpu).unwrap();
    let (x, w, g) = (t(&[2, 3, 5, 5]), t(&[4, 3, 3, 3]), t(&[2, 4, 5, 5]));
    let params = allgrad_nn::ConvParams { stride: 1, padding: 1, dilation: 1, groups: 1 };
    let grads = allgrad_nn::conv2d_backward(&x, &w, &g, params, true, true).unwrap();
    let (dx, dw) = (grads.input.unwrap(), grads.weight.unwrap());
    assert_eq!((dx.dims(), dw.dims()), (x.dims(), w.dims()));
    assert_eq!((storage_len(&dx), storage_len(&dw)), (x.elem_count(), w.elem_count()));
}

/// The identity, which sets `dropped` when the op is dropped (with the node that holds it) and,
/// in its backward, records in `seen` whether `watch` (another op's flag) was set by then.
struct Watched {
    dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
    watch: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    seen: std::sync::Arc<std::sync::Mutex<Option<bool>>>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.dropped.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl CustomOp1 for Watched {
    fn name(&self) -> &'static str {
        "watched-identity"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s {
            CpuStorage::F64(v) => {
                Ok((CpuStorage::F64(v[l.start_offset()..l.start_offset() + l.shape().elem_count()].to_vec()), l.shape().clone()))
            }
            _ => candle_core::bail!("f64 only"),
        }
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if let Some(w) = &self.watch {
            *self.seen.lock().unwrap() = Some(w.load(std::sync::atomic::Ordering::SeqCst));
        }
        Ok(Some(grad.clone()))
    }
}

/// `loss = Σ c·second(first(x)²)` with two [`Watched`] identities: returns the loss, whether
/// `second`'s node was gone when `first`'s backward ran (read through the returned cell), and
/// `first`'s and `second`'s drop flags.
#[allow(clippy::type_complexity)]
fn watched_graph(
    x: &Var,
) -> (Tensor, std::sync::Arc<std::sync::Mutex<Option<bool>>>, [std::sync::Arc<std::sync::atomic::AtomicBool>; 2]) {
    use std::sync::{atomic::AtomicBool, Arc, Mutex};
    let flags = [Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false))];
    let seen = Arc::new(Mutex::new(None));
    let first = Watched { dropped: flags[0].clone(), watch: Some(flags[1].clone()), seen: seen.clone() };
    let second = Watched { dropped: flags[1].clone(), watch: None, seen: seen.clone() };
    let y = x.as_tensor().apply_op1(first).unwrap().sqr().unwrap().apply_op1(second).unwrap();
    let c = Tensor::from_vec(vec![1.5, -2.0, 0.25], 3, &Device::Cpu).unwrap();
    ((y * c).unwrap().sum_all().unwrap(), seen, flags)
}

#[test]
fn backward_release_frees_each_node_once_its_gradient_is_passed_on() {
    let x = var(&[0.5, -1.0, 3.0], &[3]);
    // ∂x = 2·c·x.
    let expected = vec![1.5, 4.0, 1.5];
    let (loss, seen, flags) = watched_graph(&x);
    let grads = loss.backward_release().unwrap();
    assert_eq!(values(grads.get(x.as_tensor()).unwrap()), expected);
    assert_eq!(*seen.lock().unwrap(), Some(true), "the later node was still alive when the earlier one's backward ran");
    assert!(flags.iter().all(|f| f.load(std::sync::atomic::Ordering::SeqCst)), "the graph outlived backward_release");

    // `backward` keeps the graph (the caller holds the loss) and gives the same gradient.
    let (loss, seen, flags) = watched_graph(&x);
    let grads = loss.backward().unwrap();
    assert_eq!(values(grads.get(x.as_tensor()).unwrap()), expected);
    assert_eq!(*seen.lock().unwrap(), Some(false));
    assert!(!flags[1].load(std::sync::atomic::Ordering::SeqCst));
    drop(loss);
    assert!(flags.iter().all(|f| f.load(std::sync::atomic::Ordering::SeqCst)));
}

#[test]
fn backward_release_keeps_what_the_caller_still_holds() {
    // The caller keeps an intermediate: it (and the graph below it) survives, with its value,
    // and the gradients equal those of `backward`.
    let xs = [0.5, -1.25, 2.0, 3.5];
    let x = var(&xs, &[4]);
    let c = Tensor::from_vec(vec![1.0, -2.0, 0.25, 4.0], 4, &Device::Cpu).unwrap();
    let y = ((x.as_tensor() * x.as_tensor()).unwrap() + x.as_tensor()).unwrap();
    let loss = ((&y * &c).unwrap().sum_all().unwrap() + x.as_tensor().sum_all().unwrap()).unwrap();
    let kept = loss.backward().unwrap();
    let released = loss.backward_release().unwrap();
    assert_eq!(values(released.get(x.as_tensor()).unwrap()), values(kept.get(x.as_tensor()).unwrap()));
    let expected: Vec<f64> = xs.iter().map(|x| x * x + x).collect();
    assert_eq!(values(&y), expected);
    // y still has its graph: a second backward through it works.
    let again = y.sum_all().unwrap().backward_release().unwrap();
    assert_eq!(values(again.get(x.as_tensor()).unwrap()), xs.iter().map(|x| 2.0 * x + 1.0).collect::<Vec<_>>());
}
