//! Counting the traffic between the host and a device where it happens (a patch carried by
//! allgrad, see its `third_party/README.md`).
//!
//! Every device→host read (`to_scalar`, `to_vec0..3`, `to_device` to the CPU, and the CUDA
//! backend's `clone_dtoh` / `memcpy_dtoh`), every host→device upload (`Tensor::new`,
//! `from_vec`, `from_slice`, `to_device` to a device, and the CUDA backend's `clone_htod` /
//! `memcpy_htod`) and every explicit synchronisation (`Device::synchronize`) is counted here, per
//! thread and for the whole process. The uploads of kernel launch parameters (a strided
//! layout's dims and strides, which Candle's CUDA kernels take as a small device buffer) are
//! counted apart, as `param_uploads`: they are asynchronous and part of launching a kernel.
//!
//! **The CPU counted as a device.** A CPU tensor's values are on the host, so reading one costs
//! nothing. To count on a machine without a GPU what a GPU step would read, the CPU can be
//! *counted as a device*, for one thread ([`set_cpu_as_device_for_thread`]) or for the whole
//! process ([`set_cpu_as_device_for_process`]): then the reads and uploads of CPU tensors made
//! through the same calls are counted as if the CPU were the GPU. Code that stands for work a
//! device does in its own memory (a CPU collective standing for NCCL's) runs its host copies
//! inside [`uncounted`].

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::Device;

/// Counts of the traffic between the host and a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Device→host reads: each blocks the host until the device has finished the work queued
    /// before it.
    pub reads: u64,
    /// Host→device uploads of values.
    pub uploads: u64,
    /// Explicit synchronisations of a device with the host.
    pub syncs: u64,
    /// Uploads of kernel launch parameters (layouts), asynchronous.
    pub param_uploads: u64,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;

    /// The traffic between two snapshots (`later - earlier`).
    fn sub(self, earlier: Traffic) -> Traffic {
        Traffic {
            reads: self.reads - earlier.reads,
            uploads: self.uploads - earlier.uploads,
            syncs: self.syncs - earlier.syncs,
            param_uploads: self.param_uploads - earlier.param_uploads,
        }
    }
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, o: Traffic) {
        self.reads += o.reads;
        self.uploads += o.uploads;
        self.syncs += o.syncs;
        self.param_uploads += o.param_uploads;
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Read,
    Upload,
    Sync,
    Param,
}

static PROCESS_CPU_AS_DEVICE: AtomicBool = AtomicBool::new(false);
static PROCESS: [AtomicU64; 4] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

thread_local! {
    static THREAD_CPU_AS_DEVICE: Cell<bool> = const { Cell::new(false) };
    static THREAD: Cell<Traffic> = const { Cell::new(Traffic { reads: 0, uploads: 0, syncs: 0, param_uploads: 0 }) };
    static UNCOUNTED: Cell<u32> = const { Cell::new(0) };
}

/// Counts the CPU as a device on this thread (see the module docs), or not; returns the
/// previous setting of this thread.
pub fn set_cpu_as_device_for_thread(on: bool) -> bool {
    THREAD_CPU_AS_DEVICE.with(|c| c.replace(on))
}

/// Counts the CPU as a device on every thread of the process, or not; returns the previous
/// setting.
pub fn set_cpu_as_device_for_process(on: bool) -> bool {
    PROCESS_CPU_AS_DEVICE.swap(on, Ordering::SeqCst)
}

/// Whether the CPU is counted as a device on this thread: set for this thread or for the
/// process.
pub fn cpu_as_device() -> bool {
    THREAD_CPU_AS_DEVICE.with(|c| c.get()) || PROCESS_CPU_AS_DEVICE.load(Ordering::Relaxed)
}

/// Whether traffic with `dev` is counted on this thread: a device other than the CPU always,
/// the CPU when it is counted as a device.
pub fn counts(dev: &Device) -> bool {
    !dev.is_cpu() || cpu_as_device()
}

/// This thread's traffic so far (the difference of two snapshots is a region's).
pub fn thread_traffic() -> Traffic {
    THREAD.with(|t| t.get())
}

/// The traffic of every thread of the process so far.
pub fn process_traffic() -> Traffic {
    Traffic {
        reads: PROCESS[Kind::Read as usize].load(Ordering::Relaxed),
        uploads: PROCESS[Kind::Upload as usize].load(Ordering::Relaxed),
        syncs: PROCESS[Kind::Sync as usize].load(Ordering::Relaxed),
        param_uploads: PROCESS[Kind::Param as usize].load(Ordering::Relaxed),
    }
}

/// Runs `f` with nothing counted on this thread: for host copies that stand for work a device
/// does in its own memory (see the module docs). Nests.
pub fn uncounted<R>(f: impl FnOnce() -> R) -> R {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            UNCOUNTED.with(|u| u.set(u.get() - 1));
        }
    }
    UNCOUNTED.with(|u| u.set(u.get() + 1));
    let _restore = Restore;
    f()
}

fn count(kind: Kind) {
    if UNCOUNTED.with(|u| u.get()) > 0 {
        return;
    }
    PROCESS[kind as usize].fetch_add(1, Ordering::Relaxed);
    THREAD.with(|t| {
        let mut v = t.get();
        match kind {
            Kind::Read => v.reads += 1,
            Kind::Upload => v.uploads += 1,
            Kind::Sync => v.syncs += 1,
            Kind::Param => v.param_uploads += 1,
        }
        t.set(v);
    });
}

/// Counts one read of a value on `dev` (when traffic with it counts): for code that copies
/// device memory to the host by other means than Candle's (its own staging through cudarc).
pub fn count_read(dev: &Device) {
    if counts(dev) {
        count(Kind::Read)
    }
}

/// Counts one upload of host values to `dev` (when traffic with it counts).
pub fn count_upload(dev: &Device) {
    if counts(dev) {
        count(Kind::Upload)
    }
}

/// Counts one synchronisation of `dev` with the host (when traffic with it counts).
pub fn count_sync(dev: &Device) {
    if counts(dev) {
        count(Kind::Sync)
    }
}

/// A read of a CPU tensor's values (counted when the CPU is counted as a device).
pub(crate) fn cpu_read() {
    if cpu_as_device() {
        count(Kind::Read)
    }
}

/// An upload of host values into a CPU tensor (counted when the CPU is counted as a device).
pub(crate) fn cpu_upload() {
    if cpu_as_device() {
        count(Kind::Upload)
    }
}

/// A device read, upload, synchronisation or parameter upload by the CUDA backend: always
/// counted.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_read() {
    count(Kind::Read)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_upload() {
    count(Kind::Upload)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_sync() {
    count(Kind::Sync)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_param_upload() {
    count(Kind::Param)
}
