//! What the machine is doing: load average, CPU time used by every process (from
//! `/proc/stat`, Linux only), what the processor is (SIMD level, caches) and this process's
//! resource usage (getrusage, and allocations where the binary installs [`Counting`], or the
//! heap's live and peak bytes where it installs [`Peak`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// The system allocator, counting allocations and their bytes (a binary installs it with
/// `#[global_allocator]`; two relaxed atomic additions per allocation).
pub struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// The system allocator, keeping the heap's live bytes and their peak (the memory benchmarks
/// install it with `#[global_allocator]`; [`heap_live`], [`heap_peak`], [`reset_heap_peak`]).
pub struct Peak;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call forwards to the system allocator with the caller's arguments; the
// counters are only statistics.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

/// Heap bytes live now (under [`Peak`]).
pub fn heap_live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most heap bytes live at once since the last [`reset_heap_peak`] (under [`Peak`]).
pub fn heap_peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak from `bytes`; returns the peak until now.
pub fn reset_heap_peak(bytes: usize) -> usize {
    PEAK.swap(bytes, Ordering::Relaxed)
}

/// The processor in one paragraph: model, the widest SIMD level it has, the level allgrad-nn's
/// own vectorised loops run with (`ALLGRAD_CPU_SIMD`) and the GEMM's, and the cache sizes of
/// CPU 0 (from `/sys`, Linux only).
pub fn processor() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cpu = allgrad_nn::SimdLevel::detected();
    let ours = match allgrad_nn::simd_level() {
        Ok(l) => l.name().to_string(),
        Err(e) => format!("error: {e}"),
    };
    // The GEMM crate (Candle's matmul and allgrad-nn's) picks AVX-512 kernels on CPUs with
    // AVX-512 F, else AVX2+FMA ones; it does not read ALLGRAD_CPU_SIMD.
    let gemm = match cpu {
        allgrad_nn::SimdLevel::Avx512 => "avx512",
        allgrad_nn::SimdLevel::Avx2 => "avx2",
        allgrad_nn::SimdLevel::Baseline => "baseline",
    };
    let mut caches = Vec::new();
    for i in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).map(|s| s.trim().to_string());
        let (Ok(level), Ok(kind), Ok(size)) = (read("level"), read("type"), read("size")) else { break };
        if kind == "Instruction" {
            continue;
        }
        let shared = read("shared_cpu_list").unwrap_or_default();
        caches.push(format!("L{level} {size} (CPUs {shared})"));
    }
    let caches = if caches.is_empty() { "unknown".to_string() } else { caches.join(", ") };
    format!("processor: {model}; widest SIMD {}; allgrad-nn loops {ours}, GEMM {gemm}; caches of CPU 0: {caches}", cpu.name())
}

/// The 1-, 5- and 15-minute load averages and the running/total task count, as the kernel
/// prints them (`None` where `/proc/loadavg` is absent).
pub fn load_average() -> Option<(f64, String)> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let first = s.split_whitespace().next()?.parse().ok()?;
    Some((first, s.split_whitespace().take(4).collect::<Vec<_>>().join(" ")))
}

/// Prints the load average; with `busy`, warns when the 1-minute figure is above it (an idle
/// machine shows a few hundredths; a compile or another benchmark shows about one per busy
/// core). After a run the figure includes the benchmark's own threads: pass `None` then.
pub fn report_load(when: &str, busy: Option<f64>) {
    match load_average() {
        Some((one, all)) => {
            println!("load average {when}: {all} (1, 5, 15 min, running/total tasks) on {} CPUs", cpus());
            if let Some(busy) = busy.filter(|&b| one > b) {
                println!(
                    "WARNING: the machine is busy (1-minute load {one:.2} > {busy}): timings taken now are not \
                     figures; only same-process ratios mean anything. (After a build, wait a minute.)"
                );
            }
        }
        None => println!("load average {when}: unknown (no /proc/loadavg)"),
    }
}

/// Online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Seconds of CPU time all processes spent busy (not idle, not waiting for I/O) since boot,
/// summed over CPUs; `None` without `/proc/stat`.
pub fn busy_cpu_seconds() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = s.lines().next()?.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0.0)).collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    let busy: f64 = fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(busy / ticks)
}

/// This process's user and system CPU seconds (all threads), minor page faults, allocations
/// and their bytes (0 unless the binary installs [`Counting`]) and allgrad-nn's copies of
/// strided inputs and their bytes, so far.
#[derive(Clone, Copy)]
pub struct Usage {
    pub at: Instant,
    pub user: f64,
    pub sys: f64,
    pub minflt: f64,
    pub allocs: f64,
    pub alloc_bytes: f64,
    pub copies: f64,
    pub copy_bytes: f64,
}

impl Usage {
    pub fn now() -> Usage {
        // SAFETY: getrusage writes one rusage struct, which we own, zero-initialised.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        let (copies, copy_bytes) = allgrad_nn::strided_copies();
        Usage {
            at: Instant::now(),
            user: secs(r.ru_utime),
            sys: secs(r.ru_stime),
            minflt: r.ru_minflt as f64,
            allocs: ALLOCS.load(Ordering::Relaxed) as f64,
            alloc_bytes: ALLOC_BYTES.load(Ordering::Relaxed) as f64,
            copies: copies as f64,
            copy_bytes: copy_bytes as f64,
        }
    }

    /// The backward's counts between `self` (its start) and `end`, as sample entries: minor
    /// page faults, allocations, allocated MiB, allgrad-nn's strided copies and their MiB.
    pub fn backward_counts(&self, end: &Usage) -> [(&'static str, f64); 5] {
        [
            ("bwd_minflt", end.minflt - self.minflt),
            ("bwd_allocs", end.allocs - self.allocs),
            ("bwd_alloc_mib", (end.alloc_bytes - self.alloc_bytes) / (1u64 << 20) as f64),
            ("bwd_copies", end.copies - self.copies),
            ("bwd_copy_mib", (end.copy_bytes - self.copy_bytes) / (1u64 << 20) as f64),
        ]
    }
}

/// min, median and max (the median of an even count is the mean of the middle two).
pub fn summary(values: &[f64]) -> Option<(f64, f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    Some((v[0], med, v[n - 1]))
}

/// Peak device memory of a step on CUDA: the high watermark of the memory pool Candle's
/// allocations come from (cudarc allocates with `cuMemAllocAsync` from the device's current
/// pool), reset before the step and read after it, in MiB: the bytes of live allocations
/// (tensors, cuDNN and cuBLAS workspaces), the figure PyTorch's
/// `torch.cuda.max_memory_allocated` gives of its caching allocator. `None` on the CPU, on a
/// build without CUDA, where the context allocates without pools (`cuMemAlloc`: the pool would
/// read 0), or where the pool cannot be read.
pub mod device_peak {
    use candle_core::Device;

    #[cfg(feature = "cuda")]
    fn pool(dev: &Device) -> Option<candle_core::cuda::cudarc::driver::sys::CUmemoryPool> {
        use candle_core::cuda::cudarc::driver::result;
        let Device::Cuda(d) = dev else { return None };
        let ctx = d.cuda_stream().context().clone();
        if !ctx.has_async_alloc() {
            return None;
        }
        // SAFETY: the CUdevice comes from the live context of Candle's device.
        unsafe { result::device::get_mem_pool(ctx.cu_device()) }.ok()
    }

    #[cfg(feature = "cuda")]
    pub fn reset(dev: &Device) {
        use candle_core::cuda::cudarc::driver::{result, sys};
        if let Some(p) = pool(dev) {
            let mut zero: u64 = 0;
            // SAFETY: a valid pool; USED_MEM_HIGH takes a cuuint64_t (only 0 resets it).
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
            let _ = unsafe { result::mem_pool::set_attribute(p, attr, (&mut zero as *mut u64).cast()) };
        }
    }

    #[cfg(feature = "cuda")]
    pub fn read(dev: &Device) -> Option<f64> {
        use candle_core::cuda::cudarc::driver::{result, sys};
        let p = pool(dev)?;
        let mut high: u64 = 0;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: a valid pool; USED_MEM_HIGH writes a cuuint64_t.
        unsafe { result::mem_pool::get_attribute(p, attr, (&mut high as *mut u64).cast()) }.ok()?;
        Some(high as f64 / (1u64 << 20) as f64)
    }

    /// The memory the pool holds from the driver (`RESERVED_MEM_CURRENT`), in MiB: flat from
    /// the second step on when the pool keeps its memory between steps
    /// (`allgrad_nn::keep_pool_memory`).
    #[cfg(feature = "cuda")]
    pub fn reserved(dev: &Device) -> Option<f64> {
        use candle_core::cuda::cudarc::driver::{result, sys};
        let p = pool(dev)?;
        let mut bytes: u64 = 0;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT;
        // SAFETY: a valid pool; RESERVED_MEM_CURRENT writes a cuuint64_t.
        unsafe { result::mem_pool::get_attribute(p, attr, (&mut bytes as *mut u64).cast()) }.ok()?;
        Some(bytes as f64 / (1u64 << 20) as f64)
    }

    #[cfg(not(feature = "cuda"))]
    pub fn reserved(_: &Device) -> Option<f64> {
        None
    }

    #[cfg(not(feature = "cuda"))]
    pub fn reset(_: &Device) {}

    #[cfg(not(feature = "cuda"))]
    pub fn read(_: &Device) -> Option<f64> {
        None
    }
}
