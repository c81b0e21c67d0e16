//! The benchmarks' verification `.bin` files: insightface's protocol computed here equals a
//! NumPy re-implementation of its `verification.py` (`scripts/reference/ref_verification.py`)
//! on the same embeddings, in the line it prints and bit for bit; `.bin` files pickled by
//! Python (protocols 2 and 5) read back with their pairs and pixels.

use std::path::{Path, PathBuf};

use allgrad_data::{ColorMode, VerificationBin};
use allgrad_models::face::verification::{flip_sum_normalised, insightface_accuracy};
use allgrad_testkit::{hashed_values, Need};

/// Runs `ref_verification.py ARGS` with ALLGRAD_PYTHON (NumPy and Pillow); `None` after a skip
/// line when it is unset.
fn reference(args: &[&std::ffi::OsStr]) -> Option<String> {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with NumPy and Pillow) is unset");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/ref_verification.py");
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script).args(args);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "ref_verification.py", std::time::Duration::from_secs(120));
    let (stdout, stderr) = (String::from_utf8(o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{}: {}\n{stdout}\n{stderr}", script.display(), o.status);
    Some(stdout)
}

/// 2 * `pairs` raw embeddings (and their mirror images') of width 6 whose pairs lie at spread
/// distances: matching pairs closer on the whole, with overlap, so that folds disagree.
fn embeddings(pairs: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<bool>) {
    let (d, noise) = (6, hashed_values(pairs * 2 * 6 * 2, 54));
    let base = hashed_values(pairs * 6, 7);
    let issame: Vec<bool> = (0..pairs).map(|i| (i * 7 + i / 3) % 5 < 2 || i % 11 == 0).collect();
    let (mut plain, mut flipped) = (Vec::new(), Vec::new());
    for (i, same) in issame.iter().enumerate() {
        let spread = if *same { 0.5 } else { 1.3 };
        for k in 0..2 {
            let row = |m: usize| -> Vec<f32> {
                (0..d)
                    .map(|j| {
                        let b = if *same || k == 0 { base[i * d + j] } else { base[((i + 1) % pairs) * d + j] };
                        (b * 3.0 + spread * noise[((i * 2 + k) * 2 + m) * d + j] * 2.0) as f32
                    })
                    .collect()
            };
            plain.push(row(0));
            flipped.push(row(1));
        }
    }
    (plain, flipped, issame)
}

#[test]
fn insightfaces_protocol_equals_the_numpy_reimplementation_of_verification_py() {
    for pairs in [203, 60] {
        let (plain, flipped, issame) = embeddings(pairs);
        let ours = insightface_accuracy(&flip_sum_normalised(&plain, &flipped), &issame, 10);
        assert!(ours.accuracy > 0.55 && ours.accuracy < 0.98 && ours.std > 0.0, "{pairs} pairs: a trivial case {ours:?}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("emb.json");
        let json = serde_json::json!({"name": "lfw", "plain": plain, "flipped": flipped, "issame": issame});
        std::fs::write(&path, json.to_string()).unwrap();
        let Some(out) = reference(&["evaluate".as_ref(), path.as_os_str()]) else { return };
        let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let line = format!("[lfw]Accuracy-Flip: {:.5}+-{:.5}", ours.accuracy, ours.std);
        assert_eq!(line, r["line"].as_str().unwrap(), "{pairs} pairs (reference KFold: {})", r["kfold"]);
        // Bit for bit, through the f64 bits the script prints (a JSON reader's decimal
        // parsing may be one unit in the last place off).
        let bits = |v: &serde_json::Value| f64::from_bits(v.as_u64().unwrap());
        let folds: Vec<f64> = r["bits"]["folds"].as_array().unwrap().iter().map(bits).collect();
        assert_eq!(ours.folds, folds, "{pairs} pairs: fold accuracies");
        assert_eq!((ours.accuracy, ours.std), (bits(&r["bits"]["accuracy"]), bits(&r["bits"]["std"])), "{pairs} pairs");
    }
}

#[test]
fn bin_files_pickled_by_python_read_back_with_their_pairs_and_pixels() {
    let dir = tempfile::tempdir().unwrap();
    if reference(&["write-bin".as_ref(), dir.path().as_os_str()]).is_none() {
        return;
    }
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("expected.json")).unwrap()).unwrap();
    let issame: Vec<bool> = expected["issame"].as_array().unwrap().iter().map(|v| v.as_bool().unwrap()).collect();
    for proto in ["p2.bin", "p5.bin"] {
        let bin = VerificationBin::open(dir.path().join(proto)).unwrap();
        assert_eq!((bin.num_images(), bin.issame()), (6, issame.as_slice()), "{proto}");
        for (i, want) in expected["pixels"].as_array().unwrap().iter().enumerate() {
            let img = bin.image(i, ColorMode::Rgb).unwrap();
            let want: Vec<i32> = want.as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
            let worst = img.pixels.iter().zip(&want).map(|(a, b)| (*a as i32 - b).abs()).max().unwrap();
            // PNG exactly; the JPEG (image 3) within two decoders' rounding.
            assert!(worst <= if i == 3 { 2 } else { 0 }, "{proto} image {i}: a pixel differs by {worst}");
            assert_eq!(img.pixels.len(), want.len(), "{proto} image {i}");
        }
    }
}
