//! A second guard beside the counted tests (`batch_norm_device.rs` here,
//! `crates/allgrad-train/tests/train/device_path.rs`): the batch-norm and CUDA sources read device
//! values only through `allgrad_nn::transfer` (the one counting place), never with Candle's
//! `to_vec*`, `to_scalar` or `to_device` directly, so that no read bypasses the counters.

use std::path::Path;

#[test]
fn batch_norm_and_cuda_sources_read_devices_only_through_the_counting_place() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("allgrad-models/src/batch_norm.rs"), root.join("allgrad-nn/src/conv/cudnn.rs")];
    // Batch norm (the layer, its CPU passes, its finalize ops) and the CUDA kernels, every file.
    for dir in ["allgrad-nn/src/batch_norm", "allgrad-nn/src/cuda"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let forbidden = [".to_vec1", ".to_vec2", ".to_vec3", ".to_scalar", ".to_device("];
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // Up to the unit tests, which read their results on purpose.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (i, line) in code.lines().enumerate() {
            let l = line.trim_start();
            if l.starts_with("//") {
                continue;
            }
            for pat in forbidden {
                if l.contains(pat) {
                    found.push(format!("{}:{}: {}", f.display(), i + 1, l));
                }
            }
        }
    }
    assert!(files.len() >= 8, "the batch-norm or CUDA sources were not found: {files:?}");
    assert!(found.is_empty(), "device reads that bypass allgrad_nn::transfer:\n{}", found.join("\n"));
}
