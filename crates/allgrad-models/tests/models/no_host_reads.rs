//! A second guard beside the counted tests (`tests/repo/device_reads.rs`: `train` with
//! `ALLGRAD_DEVICE_PATH=1`, four methods at one read per step; `batch_norm_device.rs` here;
//! `crates/allgrad-train/tests/train/device_path.rs`): every non-test source file of allgrad-nn,
//! allgrad-models, allgrad-train and allgrad-dist is scanned for Candle's reads (`to_vec0..3`,
//! `to_scalar`), cudarc's device→host copies and synchronisations, and the scopes that leave copies
//! uncounted (`uncounted(`). Each file may hold exactly the number listed below, for the reason
//! given: a new read anywhere must be added here with its reason (or removed), so that no read
//! reaches the step path unseen, whatever the counters' coverage.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Files allowed to read (or leave copies uncounted), how many times, and why. Everything
/// else must hold none.
const ALLOWED: &[(&str, usize, &str)] = &[
    // The host path of CPU tensors: never taken on a device or on the CPU's device path.
    ("allgrad-models/src/face/softmax.rs", 4, "the fused CPU margin softmax (a device takes the composed form)"),
    ("allgrad-models/src/tiled/op.rs", 3, "the fused CPU tiled kernel (a device takes the block path)"),
    (
        "allgrad-models/src/clip/ring.rs",
        2,
        "the ring losses run on the host (embeddings on a device are staged there): the blocks sent, the incoming \
         gradient",
    ),
    ("allgrad-models/src/temperature.rs", 1, "a learned temperature's value check, host path only"),
    ("allgrad-models/src/bert/embeddings.rs", 1, "the token-id range check, host path only"),
    ("allgrad-models/src/face/insightface.rs", 1, "init_from's check that the frozen features.weight is 1 (at load)"),
    ("allgrad-models/src/face/margin.rs", 1, "the margin in f64 on the host: host path, and m1 != 1 (no arccosine op)"),
    ("allgrad-train/src/ddp.rs", 1, "the host path's gradient buckets (a device reduces a tensor)"),
    ("allgrad-train/src/trainer.rs", 3, "the host path's loss and norm; the finite check before a checkpoint"),
    ("allgrad-train/src/optim/mod.rs", 1, "the host path's gradient norm (LARS and clipping)"),
    // The CPU collectives: their host copies stand for NCCL's work in device memory.
    ("allgrad-dist/src/group/tensors.rs", 9, "the CPU backend's tensor collectives (8 reads in one uncounted scope)"),
    // Staging of CUDA collectives through pinned memory, counted by hand where it copies.
    (
        "allgrad-dist/src/group/ring.rs",
        2,
        "a ring pass's exchange of tensors on the host path: the chunks sent, read in one scope uncounted for CPU \
         tensors (they stand for NCCL's sends in device memory; a device's are counted)",
    ),
    ("allgrad-dist/src/group/cuda/host.rs", 3, "the host path of CUDA collectives (counted read and syncs)"),
    ("allgrad-dist/src/group/cuda/mod.rs", 1, "device_barrier: a barrier waits for the device by definition"),
    // The one counting place's conveniences and a CPU kernel's output.
    ("allgrad-nn/src/transfer.rs", 3, "read_vec, read_f64, read_batched: the step's one batched read"),
    ("allgrad-nn/src/cpu.rs", 1, "kernel_output: a CPU kernel's output is written in place, not uploaded"),
    // Outside the step: evaluation, tests' helpers, checks of users' inputs.
    ("allgrad-nn/src/loss.rs", 1, "cross_entropy's target check (evaluation's linear probe)"),
    ("allgrad-models/src/bert/encode.rs", 2, "embedding and similarity for evaluation and `embed`"),
    ("allgrad-models/src/clip/eval.rs", 1, "zero-shot and retrieval evaluation: the gathered cosines, scored on the host"),
    ("allgrad-models/src/face/objective.rs", 2, "verification embeddings (evaluation): own pairs and .bin sets"),
    ("allgrad-models/src/image_ssl/evaluation.rs", 2, "kNN and linear-probe evaluation"),
    ("allgrad-models/src/vectors.rs", 1, "the vectors method's retrieval evaluation"),
    ("allgrad-dist/src/testing.rs", 2, "check_world_size_invariance: a test helper for users"),
];

const PATTERNS: [&str; 9] =
    [".to_vec0", ".to_vec1", ".to_vec2", ".to_vec3", ".to_scalar", "dtoh", "synchronize(", "uncounted(", "dtov"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The lines of `text` before its unit tests that hold one of the patterns, comments left out.
fn reads(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    code.lines()
        .map(str::trim_start)
        .filter(|l| !l.starts_with("//"))
        .filter(|l| PATTERNS.iter().any(|p| l.contains(p)))
        .map(str::to_string)
        .collect()
}

fn scan(crates: &Path, roots: &[&str]) -> BTreeMap<String, Vec<String>> {
    let mut found = BTreeMap::new();
    for root in roots {
        let mut files = Vec::new();
        rust_files(&crates.join(root), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let lines = reads(&text);
            if !lines.is_empty() {
                let rel = f.strip_prefix(crates).unwrap().to_string_lossy().replace('\\', "/");
                found.insert(rel, lines);
            }
        }
    }
    found
}

#[test]
fn every_read_in_the_libraries_sources_is_one_the_allowlist_names_with_its_reason() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let found = scan(&crates, &["allgrad-nn/src", "allgrad-models/src", "allgrad-train/src", "allgrad-dist/src"]);
    let mut problems = Vec::new();
    for (file, lines) in &found {
        match ALLOWED.iter().find(|(f, _, _)| f == file) {
            None => problems.push(format!("{file}: {} read(s) not in the allowlist:\n    {}", lines.len(), lines.join("\n    "))),
            Some((_, n, why)) if *n != lines.len() => problems.push(format!(
                "{file}: {} read(s), the allowlist says {n} ({why}); update it with the reason:\n    {}",
                lines.len(),
                lines.join("\n    ")
            )),
            Some(_) => {}
        }
    }
    for (file, n, why) in ALLOWED {
        if !found.contains_key(*file) {
            problems.push(format!("{file}: allowed {n} read(s) ({why}) but holds none: remove it from the allowlist"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scan_sees_a_read_in_code_and_not_in_comments_or_unit_tests() {
    // Positive control: a planted read is found; a comment or the unit tests are not.
    let text = "fn f(t: &Tensor) { let v = t.to_scalar::<f64>(); }\n\
                // t.to_vec1::<f32>() in a comment\n\
                fn g(s: &Stream) { s.memcpy_dtoh(&a, b); }\n\
                #[cfg(test)]\nmod tests { fn h(t: &Tensor) { t.to_vec2::<f32>(); } }\n";
    let got = reads(text);
    assert_eq!(got.len(), 2, "{got:?}");
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("c/src/deep")).unwrap();
    std::fs::write(d.path().join("c/src/deep/m.rs"), text).unwrap();
    let found = scan(d.path(), &["c/src"]);
    assert_eq!(found.get("c/src/deep/m.rs").map(Vec::len), Some(2), "{found:?}");
}
