//! The one place where values cross between the host and a device: every device→host read,
//! host→device upload and cuDNN heuristic query of allgrad goes through here and is counted
//! per calling thread ([`crate::host_traffic`]).
//!
//! A read blocks the host until the device has finished everything queued before it: one
//! inside the forward or the backward stops the CPU from running ahead of the GPU (it waits
//! for each kernel it launched before launching the next). The training step therefore keeps
//! statistics, coefficients and per-shape constants on the device and reads one small batch of
//! figures per step, after the optimizer's launches; the counters make that a test.
//!
//! **The device path on the CPU.** [`set_device_path`] makes this thread run CPU tensors
//! through the code path CUDA tensors take: batch norm's statistics, coefficients and backward
//! sums stay in tensors and are computed by the finalize ops' CPU twins instead of host
//! arithmetic, SyncBatchNorm all-reduces tensors, the trainer reads its figures once per step;
//! and the reads and uploads of CPU tensors made here are counted as if they lived on a
//! device. So a CPU test can count the reads a GPU step would make, and compare the device
//! path's results with the host path's (the CPU default), without a GPU. Tensors on a device
//! other than the CPU always take the device path.

use std::cell::Cell;

use candle_core::{DType, Device, Result, Shape, Tensor, WithDType};

use crate::trace::count_traffic;

thread_local! {
    static DEVICE_PATH: Cell<bool> = const { Cell::new(false) };
}

/// Makes this thread run CPU tensors through the device path (see the module docs), or not
/// (the default); returns the previous setting. Per thread: a rank run as a thread sets it
/// for itself.
pub fn set_device_path(on: bool) -> bool {
    DEVICE_PATH.with(|p| p.replace(on))
}

/// Whether this thread runs CPU tensors through the device path ([`set_device_path`]).
pub fn device_path() -> bool {
    DEVICE_PATH.with(|p| p.get())
}

/// Whether tensors on `dev` take the device path on this thread: a device other than the CPU
/// always, the CPU with [`set_device_path`] on.
pub fn takes_device_path(dev: &Device) -> bool {
    !dev.is_cpu() || device_path()
}

fn count_read(dev: &Device) {
    if takes_device_path(dev) {
        count_traffic(|t| t.reads += 1);
    }
}

fn count_upload(dev: &Device) {
    if takes_device_path(dev) {
        count_traffic(|t| t.uploads += 1);
    }
}

/// Counts one cuDNN heuristic query.
#[cfg_attr(not(feature = "cudnn"), allow(dead_code))]
pub(crate) fn count_heuristic_query() {
    count_traffic(|t| t.heuristic_queries += 1);
}

/// `t`'s elements, flattened, on the host: one read.
pub fn read_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    count_read(t.device());
    t.flatten_all()?.to_vec1::<T>()
}

/// `t`'s elements as f64 (converted on the device), flattened, on the host: one read.
pub fn read_f64(t: &Tensor) -> Result<Vec<f64>> {
    count_read(t.device());
    t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
}

/// The one value of `t` (any shape of one element) as f64: one read.
pub fn read_scalar(t: &Tensor) -> Result<f64> {
    let v = read_f64(t)?;
    match v.as_slice() {
        [x] => Ok(*x),
        _ => candle_core::bail!("read_scalar: a tensor of shape {:?} holds {} values, not one", t.dims(), v.len()),
    }
}

/// Every element of `ts` (on one device), as f64, in order: ONE read of their concatenation
/// (made on the device), however many tensors there are.
pub fn read_batched(ts: &[&Tensor]) -> Result<Vec<f64>> {
    let Some(first) = ts.first() else { return Ok(Vec::new()) };
    let flat: Vec<Tensor> = ts.iter().map(|t| t.flatten_all()?.to_dtype(DType::F64)).collect::<Result<_>>()?;
    let all = if flat.len() == 1 { flat[0].clone() } else { Tensor::cat(&flat, 0)? };
    count_read(first.device());
    all.to_vec1::<f64>()
}

/// `t` copied to the host: one read when `t` is on a device.
pub fn to_host(t: &Tensor) -> Result<Tensor> {
    count_read(t.device());
    t.to_device(&Device::Cpu)
}

/// `v` as a tensor of `shape` on `dev`: one upload when `dev` takes the device path.
pub fn upload<T: WithDType, S: Into<Shape>>(v: Vec<T>, shape: S, dev: &Device) -> Result<Tensor> {
    count_upload(dev);
    Tensor::from_vec(v, shape, dev)
}

/// `t` (a host tensor) copied to `dev`: one upload when `dev` takes the device path.
pub fn to_device(t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.device().same_device(dev) {
        return Ok(t.clone());
    }
    count_upload(dev);
    t.to_device(dev)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_traffic;

    #[test]
    fn cpu_tensors_count_only_on_the_device_path() {
        let t = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
        let before = host_traffic();
        assert_eq!(read_f64(&t).unwrap(), [1.0, 2.0, 3.0]);
        upload(vec![1f64], 1, &Device::Cpu).unwrap();
        assert_eq!(host_traffic() - before, Default::default(), "the host path counts nothing");
        let was = set_device_path(true);
        assert!(!was && device_path());
        let before = host_traffic();
        read_f64(&t).unwrap();
        assert_eq!(read_batched(&[&t, &t.sum_all().unwrap()]).unwrap(), [1.0, 2.0, 3.0, 6.0]);
        assert_eq!(read_scalar(&t.sum_all().unwrap()).unwrap(), 6.0);
        upload(vec![1f64, 2.0], 2, &Device::Cpu).unwrap();
        count_heuristic_query();
        let d = host_traffic() - before;
        assert_eq!((d.reads, d.uploads, d.heuristic_queries), (3, 1, 1), "{d:?}");
        assert!(read_scalar(&t).unwrap_err().to_string().contains("3 values"));
        // Another thread has its own switch and counts.
        std::thread::spawn(|| assert!(!device_path())).join().unwrap();
        set_device_path(false);
    }
}
