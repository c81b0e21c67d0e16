//! Memory-allocator settings for CPU training.
//!
//! A training step allocates and frees the same large buffers (activations, im2col columns,
//! gradients) over and over. With glibc's defaults every block above a dynamic threshold is
//! a fresh `mmap`, zero-filled by the kernel page by page on first touch and returned with
//! `munmap` when freed, and the heap top is trimmed back to the system: a ResNet-18 SimCLR
//! step at batch 64 then spends about a quarter of its time on that.
//! [`tune_allocator`] keeps freed memory in the process for reuse instead. The cost is that
//! the resident size stays at the step's peak, which a training process reaches every step
//! anyway. Set `ALLGRAD_MALLOC_TUNE=0` to keep the defaults. Any value but `0` or `1` also
//! keeps them here, and `train` then stops with an error naming the variable
//! (`allgrad_train::Settings` checks it).

/// Keeps large allocations in the heap and freed memory in the process (glibc on Linux;
/// elsewhere it does nothing). Call it first thing in `main`, before large allocations.
/// Returns whether the settings were applied.
pub fn tune_allocator() -> bool {
    match std::env::var("ALLGRAD_MALLOC_TUNE").as_deref().map(str::trim) {
        Err(_) | Ok("" | "1") => {}
        Ok(_) => return false,
    }
    imp::tune()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    pub fn tune() -> bool {
        // SAFETY: mallopt only changes allocator parameters; it is called with valid
        // parameter codes and values, and glibc serialises it against other allocations.
        unsafe {
            let max = libc::c_int::MAX;
            // Older glibc versions refuse thresholds above 32 MiB: fall back to that.
            let mmap = libc::mallopt(libc::M_MMAP_THRESHOLD, max) == 1 || libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1;
            let trim = libc::mallopt(libc::M_TRIM_THRESHOLD, max) == 1;
            mmap && trim
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub fn tune() -> bool {
        false
    }
}
