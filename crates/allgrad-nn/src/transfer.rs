//! Moving values between the host and a device, and the device path on the CPU.
//!
//! Every device→host read, host→device upload and synchronisation is counted where it happens:
//! in Candle's copy functions (`candle_core::host_traffic`, a patch allgrad carries: `to_vec*`,
//! `to_scalar`, `Tensor::new`, `from_vec`, `to_device`, the CUDA backend's copies) and in
//! allgrad's own staging, which counts through the same place ([`crate::host_traffic`] per
//! thread, [`crate::process_host_traffic`] for every thread). No read can go around the count:
//! the functions here are conveniences (one read of several tensors, f64 on the host), not the
//! counting place.
//!
//! A read blocks the host until the device has finished everything queued before it: one
//! inside the forward or the backward stops the CPU from running ahead of the GPU (it waits
//! for each kernel it launched before launching the next). The training step therefore keeps
//! statistics, coefficients and per-shape constants on the device and reads one small batch of
//! figures per step, after the optimizer's launches; the counters make that a test.
//!
//! **The device path on the CPU.** [`set_device_path`] makes this thread (and
//! [`set_device_path_for_process`] every thread) run CPU tensors through the code path CUDA
//! tensors take: batch norm's statistics, coefficients and backward sums stay in tensors and
//! are computed by the finalize ops' CPU twins instead of host arithmetic, SyncBatchNorm
//! all-reduces tensors, the trainer reads its figures once per step; and Candle counts the
//! reads and uploads of CPU tensors as if they lived on a device (the CPU is "counted as a
//! device"). So a CPU test can count the reads a GPU step would make, and compare the device
//! path's results with the host path's (the CPU default), without a GPU. Tensors on a device
//! other than the CPU always take the device path.

use candle_core::host_traffic as counted;
use candle_core::{DType, Device, Result, Shape, Tensor, WithDType};

/// Makes this thread run CPU tensors through the device path (see the module docs), or not
/// (the default); returns the previous setting of this thread. A rank run as a thread sets it
/// for itself.
pub fn set_device_path(on: bool) -> bool {
    counted::set_cpu_as_device_for_thread(on)
}

/// Makes every thread of the process run CPU tensors through the device path (the loader's
/// and a kernel pool's threads too, whose reads are then counted), or not; returns the
/// previous setting. `ALLGRAD_DEVICE_PATH=1` sets it when a run starts.
pub fn set_device_path_for_process(on: bool) -> bool {
    counted::set_cpu_as_device_for_process(on)
}

/// Whether this thread runs CPU tensors through the device path (set for the thread or for
/// the process).
pub fn device_path() -> bool {
    counted::cpu_as_device()
}

/// Whether tensors on `dev` take the device path on this thread: a device other than the CPU
/// always, the CPU with [`set_device_path`] on.
pub fn takes_device_path(dev: &Device) -> bool {
    counted::counts(dev)
}

/// `t`'s elements, flattened, on the host: one read.
pub fn read_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// `t`'s elements as f64 (converted on the device), flattened, on the host: one read.
pub fn read_f64(t: &Tensor) -> Result<Vec<f64>> {
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
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let flat: Vec<Tensor> = ts.iter().map(|t| t.flatten_all()?.to_dtype(DType::F64)).collect::<Result<_>>()?;
    let all = if flat.len() == 1 { flat[0].clone() } else { Tensor::cat(&flat, 0)? };
    all.to_vec1::<f64>()
}

/// `t` copied to the host: one read when `t` is on a device (or on the CPU on the device path,
/// where the copy is a clone that Candle does not see as a read, so it is counted here).
pub fn to_host(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cpu() {
        counted::count_read(t.device());
    }
    t.to_device(&Device::Cpu)
}

/// `v` as a tensor of `shape` on `dev`: one upload when `dev` takes the device path.
pub fn upload<T: WithDType, S: Into<Shape>>(v: Vec<T>, shape: S, dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(v, shape, dev)
}

/// `t` (a host tensor) copied to `dev`: one upload when `dev` is another device.
pub fn to_device(t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.device().same_device(dev) {
        return Ok(t.clone());
    }
    t.to_device(dev)
}

/// `v` as a `[]` tensor of `t`'s dtype on `t`'s device, made there (a fill and a conversion,
/// never an upload): for `t.broadcast_maximum(&constant(t, 1e-12)?)` where `t.maximum(1e-12)`
/// would upload its scalar. The same value as Candle's scalar operand (`v` as f64, converted).
pub fn constant(t: &Tensor, v: f64) -> Result<Tensor> {
    Tensor::full(v, (), t.device())?.to_dtype(t.dtype())
}

thread_local! {
    /// The longest `0..n` made on each device so far on this thread.
    static NUMBERS: std::cell::RefCell<Vec<Tensor>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `0, 1, …, n − 1` as a `[n]` u32 tensor on `dev` (column or row numbers): uploaded once per
/// device and thread (the longest asked for so far, grown when a longer one is asked), then a
/// view of it, so that a step that needs the same numbers again uploads nothing.
pub fn numbers(n: usize, dev: &Device) -> Result<Tensor> {
    if n > u32::MAX as usize {
        candle_core::bail!("numbers: {n} does not fit u32");
    }
    let loc = dev.location();
    let kept =
        NUMBERS.with(|k| k.borrow().iter().find(|t| t.device().location() == loc && t.dim(0).is_ok_and(|m| m >= n)).cloned());
    if let Some(t) = kept {
        return t.narrow(0, 0, n);
    }
    let t = Tensor::arange(0u32, n as u32, dev)?;
    NUMBERS.with(|k| {
        let mut k = k.borrow_mut();
        k.retain(|o| o.device().location() != loc);
        k.push(t.clone());
    });
    Ok(t)
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
        crate::trace::count_heuristic_query();
        let d = host_traffic() - before;
        assert_eq!((d.reads, d.uploads, d.heuristic_queries), (3, 1, 1), "{d:?}");
        // Candle's own calls are counted the same way: nothing goes around the count.
        let before = host_traffic();
        t.to_vec1::<f32>().unwrap();
        t.sum_all().unwrap().to_scalar::<f32>().unwrap();
        Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let d = host_traffic() - before;
        assert_eq!((d.reads, d.uploads), (2, 1), "{d:?}");
        assert!(read_scalar(&t).unwrap_err().to_string().contains("3 values"));
        // Numbers: uploaded once, then views of the kept tensor.
        let before = host_traffic();
        assert_eq!(numbers(5, &Device::Cpu).unwrap().to_vec1::<u32>().unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(numbers(3, &Device::Cpu).unwrap().dims(), [3]);
        let d = host_traffic() - before;
        assert_eq!((d.reads, d.uploads), (1, 1), "{d:?}");
        // Another thread has its own switch and counts.
        std::thread::spawn(|| assert!(!device_path())).join().unwrap();
        set_device_path(false);
    }
}
