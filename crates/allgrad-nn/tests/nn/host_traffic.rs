//! The counting of host↔device traffic that allgrad's patch adds to Candle
//! (`candle_core::host_traffic`, `third_party/README.md`): Candle's own reads and uploads of CPU
//! tensors count when the CPU is counted as a device (for the thread or for the process), on the
//! thread that made them and for the process; copies in an `uncounted` scope do not.

use candle_core::host_traffic::{self, Traffic};
use candle_core::{Device, Tensor};

fn reads_and_uploads(t: Traffic) -> (u64, u64) {
    (t.reads, t.uploads)
}

#[test]
fn candles_own_reads_and_uploads_count_only_when_the_cpu_counts_as_a_device() {
    let before = host_traffic::thread_traffic();
    let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    t.to_vec1::<f32>().unwrap();
    assert_eq!(host_traffic::thread_traffic() - before, Traffic::default(), "the host path counts nothing");

    let was = host_traffic::set_cpu_as_device_for_thread(true);
    let (thread, process) = (host_traffic::thread_traffic(), host_traffic::process_traffic());
    // Uploads: Tensor::new, from_vec, from_slice, arange (3 + 1).
    let t = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &Device::Cpu).unwrap();
    Tensor::from_vec(vec![1f64], 1, &Device::Cpu).unwrap();
    Tensor::from_slice(&[1u32, 2], 2, &Device::Cpu).unwrap();
    Tensor::arange(0u32, 4, &Device::Cpu).unwrap();
    // Reads: to_scalar, to_vec0, to_vec1, to_vec2, to_vec3 (5).
    t.sum_all().unwrap().to_scalar::<f32>().unwrap();
    t.sum_all().unwrap().to_vec0::<f32>().unwrap();
    t.to_vec1::<f32>().unwrap();
    t.reshape((2, 2)).unwrap().to_vec2::<f32>().unwrap();
    t.reshape((1, 2, 2)).unwrap().to_vec3::<f32>().unwrap();
    // Not counted: copies inside `uncounted`, and ops, fills and zeros (made on the device).
    host_traffic::uncounted(|| t.to_vec1::<f32>().unwrap());
    Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
    Tensor::full(2f32, 3, &Device::Cpu).unwrap();
    (&t * 2.0).unwrap().exp().unwrap();
    let d = host_traffic::thread_traffic() - thread;
    assert_eq!(reads_and_uploads(d), (5, 4), "{d:?}");
    // The process counts include this thread's (and maybe other tests' running beside it).
    let p = host_traffic::process_traffic() - process;
    assert!(p.reads >= 5 && p.uploads >= 4, "{p:?}");
    // Another thread has its own switch.
    std::thread::spawn(|| {
        let before = host_traffic::thread_traffic();
        Tensor::new(&[1f32], &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(host_traffic::thread_traffic() - before, Traffic::default());
    })
    .join()
    .unwrap();
    host_traffic::set_cpu_as_device_for_thread(was);
}

#[test]
fn allgrads_host_traffic_is_candles_count_with_the_heuristic_queries() {
    let was = allgrad_nn::transfer::set_device_path(true);
    let before = allgrad_nn::host_traffic();
    let t = Tensor::new(&[1f64, 2.0], &Device::Cpu).unwrap();
    t.to_vec1::<f64>().unwrap();
    let d = allgrad_nn::host_traffic() - before;
    allgrad_nn::transfer::set_device_path(was);
    assert_eq!((d.reads, d.uploads, d.syncs), (1, 1, 0), "{d:?}");
}
